"""The OpenAI-compatible HTTP front, on the standard library's ThreadingHTTPServer (one thread
per connection, HTTP/1.1 keep-alive; streams use chunked transfer encoding).

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
    GET  /v1/models, /v1/models/{id}, /health

A client that goes away (its socket reaches EOF, or a write fails) cancels the upstream calls,
so the nodes abort the request. While the router drains, new requests and /health get 503.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import chain
from urllib.parse import unquote, urlsplit

import grpc

from kvbridge import __version__
from router.dispatch import DRAINING, Dispatcher, RouteError
from router.openai_api import BadRequest, Reply, error_body, parse_request

MAX_BODY_BYTES = 16 << 20
IDLE_TIMEOUT_S = 120.0  # a connection that sends nothing for this long is closed
DISCONNECT_POLL_S = 0.2  # how often a waiting request checks whether its client is still there
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
log = logging.getLogger("kvbridge.router")


class HTTPFront:
    def __init__(self, host: str, port: int, dispatcher: Dispatcher):
        handler = type("Handler", (_Handler,), {"dispatcher": dispatcher})
        server_cls = type("Server", (ThreadingHTTPServer,), {"daemon_threads": True, "handle_error": _handle_error})
        if ":" in host:
            server_cls.address_family = socket.AF_INET6
        try:
            self.server = server_cls((host.strip("[]"), port), handler)
        except OSError as e:
            raise ValueError(f"cannot bind {host}:{port} for HTTP: {e.strerror or e}") from None
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvbridge-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def _handle_error(server, request, client_address) -> None:
    """A connection that failed outside a request's own handling: a client that hung up is normal
    (no traceback on stderr); anything else is logged once, as one line."""
    exc = sys.exc_info()[1]
    if isinstance(exc, (*_GONE, TimeoutError)):
        return
    log.warning("http connection from %s failed: %s: %s", client_address[0], type(exc).__name__, exc)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"kvbridge-router/{__version__}"
    timeout = IDLE_TIMEOUT_S
    dispatcher: Dispatcher  # set on the subclass made by HTTPFront
    _answered = False  # a status line went out for the current request

    def send_response(self, code: int, message: str | None = None) -> None:
        self._answered = True
        super().send_response(code, message)

    def log_message(self, format, *args) -> None:
        pass  # no access log on stderr

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a malformed request line, a header too long) in the OpenAI
        error format, as JSON, like every other answer."""
        body = json.dumps(
            {"error": {"message": message or explain or "bad request", "type": "invalid_request_error",
                       "param": None, "code": str(code)}}
        ).encode()  # fmt: skip
        self.close_connection = True
        self.request_version = self.protocol_version  # a garbled request line still gets a status line
        try:
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(body)
        except _GONE:
            pass

    def _not_allowed(self) -> None:
        self.close_connection = True
        message = f"method {self.command} is not allowed here (use GET or POST)"
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
        self._send_json(405, {"error": error})

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    # ------------------------------------------------------------------ routes

    def do_GET(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path == "/health":
            if self.dispatcher.draining:
                self._send_error(grpc.StatusCode.UNAVAILABLE, DRAINING)
            elif not self.dispatcher.can_route():
                self._send_error(grpc.StatusCode.UNAVAILABLE, "no healthy node can serve requests")
            else:
                self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [self._model_card(m) for m in self._models()]})
        elif path.startswith("/v1/models/"):
            name = path.removeprefix("/v1/models/")
            card = next((self._model_card(m) for m in self._models() if m.model == name), None)
            if card is None:
                self._send_error(grpc.StatusCode.NOT_FOUND, f"model {name!r} is not served here", "model")
            else:
                self._send_json(200, card)
        else:
            self._send_error(grpc.StatusCode.NOT_FOUND, f"no route GET {path}")

    def do_POST(self) -> None:
        self._answered = False
        path = unquote(urlsplit(self.path).path)
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self.close_connection = True  # the body is left unread
            self._send_error(grpc.StatusCode.NOT_FOUND, f"no route POST {path}")
            return
        try:
            raw = self._read_body()
            if raw is None:
                return
            try:
                req = parse_request(raw, chat=path == "/v1/chat/completions")
            except BadRequest as e:
                self._send_error(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param)
                return
            served = [m.model for m in self._models()]
            if req.model and served and req.model not in served:
                self._send_error(grpc.StatusCode.NOT_FOUND, f"model {req.model!r} is not served here", "model")
                return
            self._generate(req.model or (served[0] if served else ""), req)
        except _GONE:
            self.close_connection = True
        except TimeoutError:
            self.close_connection = True
            self._send_error(grpc.StatusCode.DEADLINE_EXCEEDED, "timed out reading the request body")
        except Exception as e:  # a bug: answer 500 if nothing went out yet; the server keeps serving
            log.exception("POST %s failed", path)
            self.close_connection = True
            if not self._answered:
                self._send_error(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")

    # ------------------------------------------------------------------ generation

    def _generate(self, model: str, req) -> None:
        routed = self.dispatcher.route(req.request)
        reply = Reply(req, routed.rid, model)
        responses = iter(routed)
        stop_watching = self._watch_disconnect(routed.cancel)
        try:
            try:
                first = next(responses, None)
            except RouteError as e:
                self._send_error(e.code, e.message)
                return
            stream = chain([first] if first is not None else [], responses)
            if req.stream:
                self._stream(reply, stream)
            else:
                try:
                    for resp in stream:
                        reply.add(resp)
                except RouteError as e:
                    self._send_error(e.code, e.message)
                    return
                self._send_json(200, reply.final())
        except _GONE:
            routed.cancel()
            self.close_connection = True
        finally:
            stop_watching()
            responses.close()  # cancels whatever is still open upstream

    def _stream(self, reply: Reply, responses) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for resp in responses:
                if (chunk := reply.add(resp)) is not None:
                    self._event(chunk)
            if (chunk := reply.usage_chunk()) is not None:
                self._event(chunk)
        except RouteError as e:
            self._event(error_body(e.code, e.message)[1])
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    def _watch_disconnect(self, on_gone: Callable[[], None]) -> Callable[[], None]:
        """Poll the socket while the request runs: EOF or a reset means the client left. Returns
        the function that stops watching."""
        sock, done = self.connection, threading.Event()

        def watch() -> None:
            while not done.is_set():
                try:
                    readable, _, _ = select.select([sock], [], [], DISCONNECT_POLL_S)
                    if readable:
                        if sock.recv(1, socket.MSG_PEEK) == b"":
                            on_gone()
                        return  # EOF, or the client sent more (a pipelined request): stop either way
                except (OSError, ValueError):  # reset, or the socket was closed under us
                    if not done.is_set():
                        on_gone()
                    return

        thread = threading.Thread(target=watch, name="kvbridge-http-watch", daemon=True)
        thread.start()
        return done.set

    # ------------------------------------------------------------------ plumbing

    def _models(self):
        return self.dispatcher.pool.models()

    def _model_card(self, m) -> dict:
        return {
            "id": m.model,
            "object": "model",
            "created": int(self.dispatcher.started_at),
            "owned_by": "kvbridge",
            "max_model_len": m.max_context,
        }

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering with an error."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            self.close_connection = True
            self._send_error(grpc.StatusCode.INVALID_ARGUMENT, f"Content-Length must be a number, got {length!r}")
            return None
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            self._send_json(413, error_body(grpc.StatusCode.INVALID_ARGUMENT, f"body over {MAX_BODY_BYTES} bytes")[1])
            return None
        return self.rfile.read(int(length))

    def _read_chunked(self) -> bytes | None:
        parts, total = [], 0
        while True:
            size_line = self.rfile.readline(64).split(b";")[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                size = -1
            total += max(size, 0)
            if size < 0 or total > MAX_BODY_BYTES:
                self.close_connection = True
                self._send_error(grpc.StatusCode.INVALID_ARGUMENT, "bad chunked body (bad size or too large)")
                return None
            if size == 0:
                while self.rfile.readline(1024).strip():  # trailers
                    pass
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline(8)  # the chunk's CRLF

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        status, body = error_body(code, message, param)
        self._send_json(status, body)

    def _event(self, obj: dict) -> None:
        self._write_chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
