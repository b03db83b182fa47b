"""The OpenAI-compatible HTTP front: a Starlette app served by uvicorn (its h11 protocol) as a task
on the router's event loop, so a connection or a request costs a coroutine, never a thread.
HTTP/1.1 keep-alive; streams are server-sent events in chunked transfer encoding.

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
    GET  /v1/models, /v1/models/{id}, /health
    POST /tokenize, /detokenize; GET /version   as vLLM serves them (router/tokenize.py)

Every answer other than a success is JSON in the OpenAI error format (openai_api.error_body), also
those the server makes itself: a malformed request (400, or h11's hint: 431 headers too large, 501
transfer coding), an unknown route (404), another method (405). Malformed framing is refused at
once and the connection closed: a bad or conflicting Content-Length, a bad chunk size, and what h11
accepts but RFC 9112 calls faulty (router/connection.py: each connection's protocol). Limits, each
answered at once:

- max_concurrent_requests requests are handled at once; one more gets 503 with Retry-After.
- A body over max_body_bytes gets 413 as soon as its Content-Length or a chunk size says so or its
  bytes take it over (a chunked body without a size is cut off at the limit too); one not in within
  http_body_timeout_s of its headers gets 408. Both close the connection, the 413 once the client
  stops sending the rest (dropped unread: at most connection.LINGER_BYTES, or that timeout), so that
  a client that sends its whole body before reading gets the 413 rather than a reset.
- A connection whose request headers are not in within http_header_timeout_s of its opening or of
  its previous response is closed (uvicorn has no such timeout: router/connection.py adds it), so a
  client trickling bytes holds nothing for long; headers over MAX_HEADER_BYTES are refused.
- A connection idle for http_keep_alive_s after a response is closed.
- A prompt that cannot fit the longest context a node serves by its size (common/limits.py: a chat
  over MAX_CHAT_MESSAGES messages, a text or chat over max_context x 32 bytes) gets 400 before it
  is routed or tokenized; a non-streamed answer growing past max_answer_bytes gets 400 naming the
  flag (router/reply.py), its routed requests cancelled.

A client that goes away while its request runs (its connection closed, or a write to it failed:
uvicorn then reports http.disconnect) cancels the request upstream, so the nodes abort it; a task
watches for that beside each request. While the router drains, new requests and /health get 503.
An X-Request-Id from the client (1..128 visible ASCII characters) is echoed on the answer; the
request's rid is still the router's own. Header names go out in canonical case (Content-Type).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import socket
import ssl
from collections.abc import Callable

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvbridge.common import rpc, tracing
from kvbridge.common.limits import prompt_size_problem
from kvbridge.common.security import check_bearer
from kvbridge.common.shown import MAX_SHOWN_CHARS, clipped, shown
from kvbridge.router.answer import Fanout, HTTPAnswer
from kvbridge.router.answer import error as _error
from kvbridge.router.answer import json_response as _json
from kvbridge.router.config import RouterConfig
from kvbridge.router.connection import HEADERS_TOO_LARGE, MAX_HEADER_BYTES, SERVER, FrontProtocol, body_too_large
from kvbridge.router.dispatch import Dispatcher
from kvbridge.router.gateway import gateway_prefill
from kvbridge.router.openai_api import BadRequest, OpenAIRequest, error_body, json_body, parse_request
from kvbridge.router.reply import Reply
from kvbridge.router.routed import DRAINING
from kvbridge.router.tokenize import Refused, detokenize, echo_texts, tokenize, version
from kvbridge.router.worker import offloaded
from kvbridge.v1 import generation_pb2

RETRY_AFTER_S = 1  # what a 503 for the concurrency limit tells the client to wait
STOP_WAIT_S = 5.0  # past the grace period, requests in flight get this long to end before uvicorn cancels them
_KEYED = ("/v1/", "/tokenize", "/detokenize")  # paths that need the API key when there is one
_REQUEST_ID = re.compile(rb"[!-~]{1,128}")  # an X-Request-Id that is echoed
INLINE_BODY_BYTES = 64 << 10  # a body up to this size is parsed on the loop; a larger one in the worker thread
log = logging.getLogger("kvbridge.router")


class HTTPFront:
    """The HTTP server of one router: bound at construction (ValueError naming the address when
    it cannot be), served from start() on, on the loop that runs start()."""

    def __init__(self, config: RouterConfig, dispatcher: Dispatcher):
        self.config, self.dispatcher = config, dispatcher
        self.requests_in_flight = 0  # requests being handled now (on the loop only)
        app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/tokenize", functools.partial(self._tokens, answer=tokenize), methods=["POST"]),
                Route("/detokenize", functools.partial(self._tokens, answer=detokenize), methods=["POST"]),
                Route("/version", self._version, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _route_error, Exception: _internal_error},
        )
        app.router.redirect_slashes = False  # /v1/completions/ is not a route (a redirect would not be JSON)
        self.app = app
        self.sock = _bind(config.host, config.http_port)
        self.port = self.sock.getsockname()[1]
        limits = {
            "header_timeout_s": config.http_header_timeout_s,
            "max_body_bytes": config.max_body_bytes,
            "linger_s": config.http_body_timeout_s,
        }
        protocol = type("H11Protocol", (FrontProtocol,), limits)
        security = rpc.security()
        self.api_key = security.api_key  # "" = the API is open
        tls = {}
        if security.tls:  # under mutual TLS, clients' certificates as --client-cert-reqs says
            tls = {"ssl_certfile": security.cert_file, "ssl_keyfile": security.key_file}
            if (asked := security.client_certs(config.client_cert_reqs)) != ssl.CERT_NONE:
                tls |= {"ssl_ca_certs": security.ca_file, "ssl_cert_reqs": asked}
        self.server = uvicorn.Server(
            uvicorn.Config(
                self,
                http=protocol,
                ws="none",
                lifespan="off",
                interface="asgi3",
                log_config=None,
                log_level=logging.ERROR,  # uvicorn's own lines: only its errors (our app logs its own)
                access_log=False,
                proxy_headers=False,
                server_header=False,  # ours, in canonical case
                timeout_keep_alive=config.http_keep_alive_s,
                timeout_graceful_shutdown=STOP_WAIT_S,
                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                **tls,
            )
        )
        self._serving: asyncio.Task | None = None

    async def start(self) -> None:
        """Serve (on the running loop) until stop()."""
        self._serving = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._serving.done():  # startup failed
                self._serving.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    def stop_accepting(self, grace_s: float) -> None:
        """Take no new connections (nor requests on idle ones); those in flight get `grace_s` and
        STOP_WAIT_S more to end before stop() cancels them."""
        self.server.config.timeout_graceful_shutdown = grace_s + STOP_WAIT_S
        self.server.should_exit = True

    async def stop(self) -> None:
        """Stop serving and wait until uvicorn is done: idle connections close at once, requests in
        flight get what stop_accepting() allowed (cancel them upstream first: they end at once)."""
        self.server.should_exit = True
        if self._serving is not None:
            await self._serving
        else:
            self.sock.close()

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off and websockets are not served
            return
        out = _Outgoing(scope, send)
        if _header_bytes(scope) > MAX_HEADER_BYTES:  # (h11 counts only headers that arrive in pieces)
            await _json(431, HEADERS_TOO_LARGE, {"Connection": "close"})(scope, receive, out)
            return
        if self.api_key and scope["path"].startswith(_KEYED) and (refused := self._refusal(scope)):
            await refused(scope, receive, out)
            return
        if self.requests_in_flight >= self.config.max_concurrent_requests:
            message = f"the router is handling {self.requests_in_flight} requests, its limit; retry later"
            status, body = error_body(grpc.StatusCode.UNAVAILABLE, message)
            await _json(status, body, {"Retry-After": str(RETRY_AFTER_S)})(scope, receive, out)
            return
        self.requests_in_flight += 1
        try:
            await self.app(scope, receive, out)
        except Exception:  # a bug (Starlette answered 500 through _internal_error if nothing went out yet)
            log.exception("HTTP %s %s failed", scope["method"], scope["path"])
        finally:
            self.requests_in_flight -= 1

    def _refusal(self, scope: Scope) -> Response | None:
        """401 (OpenAI's body) unless the request carries `Authorization: Bearer <the API key>`."""
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        verdict = check_bearer(header.decode("latin-1") if header is not None else None, self.api_key)
        if not verdict:
            return None
        message = "missing API key: send Authorization: Bearer KEY" if verdict == "UNAUTHENTICATED" else "wrong API key"
        body = {
            "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        }
        return _json(401, body, {"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------ routes

    async def _completions(self, request: Request) -> Response | HTTPAnswer:
        return await self._generate(request, chat=False)

    async def _chat_completions(self, request: Request) -> Response | HTTPAnswer:
        return await self._generate(request, chat=True)

    async def _models(self, request: Request) -> Response:
        return _json(200, {"object": "list", "data": [self._model_card(m) for m in self.dispatcher.pool.models()]})

    async def _model(self, request: Request) -> Response:
        name = request.path_params["model"]
        card = next((self._model_card(m) for m in self.dispatcher.pool.models() if m.model == name), None)
        if card is None:
            return _error(grpc.StatusCode.NOT_FOUND, f"model {shown(name)} is not served here", "model")
        return _json(200, card)

    async def _health(self, request: Request) -> Response:
        if self.dispatcher.draining:
            return _error(grpc.StatusCode.UNAVAILABLE, DRAINING)
        if not self.dispatcher.can_route():
            return _error(grpc.StatusCode.UNAVAILABLE, "no healthy node can serve requests")
        return _json(200, {"status": "ok"})

    async def _tokens(self, request: Request, answer) -> Response | ASGIApp:
        """/tokenize, /detokenize: `answer` (router/tokenize.py) to the body."""
        raw = await self._read_body(request)
        if not isinstance(raw, bytearray):
            return raw
        try:
            body = await _parsed(json_body, raw)
        except BadRequest as e:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param)
        return _json(*await answer(body, self.dispatcher.pool, self.dispatcher.prompts))

    async def _version(self, request: Request) -> Response:
        return _json(200, version())

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: Request, chat: bool) -> Response | HTTPAnswer:
        raw = await self._read_body(request)
        if not isinstance(raw, bytearray):
            return raw
        try:
            req = await _parsed(_generation, raw, chat, self.dispatcher.prompts.max_context())
        except BadRequest as e:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param)
        served = [m.model for m in self.dispatcher.pool.models()]
        if req.model and served and req.model not in served:
            return _error(grpc.StatusCode.NOT_FOUND, f"model {shown(req.model)} is not served here", "model")
        try:
            prefill = gateway_prefill(request.headers, self.dispatcher.pool)  # (a gateway's choice)
            echo = await echo_texts(req, self.dispatcher.pool, self.dispatcher.prompts)  # (completions' echo)
        except Refused as e:
            return _error(e.code, str(e), e.param)
        parent = tracing.extract(request.headers)  # (the client's trace, W3C traceparent)
        routed = Fanout([self.dispatcher.route(r, prefill=prefill, parent=parent) for r in req.requests()])
        model = req.model or (served[0] if served else "")
        reply = Reply(req, routed.rid, model, echo=echo, max_bytes=self.config.max_answer_bytes)
        return HTTPAnswer(routed, reply, req.stream)

    async def _read_body(self, request: Request) -> bytearray | Response | ASGIApp:
        """The request body, or the answer instead: 413 over the limit (FrontProtocol refuses it
        first, as it arrives), 408 too slow, none to a client that left."""
        limit = self.config.max_body_bytes
        too_large = body_too_large(limit)
        length = request.headers.get("content-length")  # (h11 checked that it is a number)
        if length is not None and int(length) > limit:
            return _json(413, too_large, {"Connection": "close"})
        body = bytearray()  # (grown in place: a list of parts joined at the end would hold the body twice)
        try:
            async with asyncio.timeout(self.config.http_body_timeout_s):
                async for part in request.stream():
                    if len(body) + len(part) > limit:
                        return _json(413, too_large, {"Connection": "close"})
                    body += part
        except ClientDisconnect:
            return _gone
        except TimeoutError:
            message = f"the request body did not arrive within {self.config.http_body_timeout_s:g} s"
            return _json(408, error_body(grpc.StatusCode.DEADLINE_EXCEEDED, message)[1], {"Connection": "close"})
        return body

    def _model_card(self, m: generation_pb2.ModelInfo) -> dict:
        return {
            "id": m.model,
            "object": "model",
            "created": int(self.dispatcher.started_at),
            "owned_by": "kvbridge",
            "max_model_len": m.max_context,
        }


async def _parsed(parse: Callable, raw: bytearray, *args):
    """parse(raw, *args): on the loop for a body of up to INLINE_BODY_BYTES (well under a ms), in the
    router's worker thread for a larger one (4 MiB of empty chat messages: ~0.1 s); the loop runs
    meanwhile."""
    if len(raw) <= INLINE_BODY_BYTES:
        return parse(raw, *args)
    return await offloaded(parse, raw, *args)


def _generation(raw: bytearray, chat: bool, max_context: int | None) -> OpenAIRequest:
    """parse_request, and BadRequest for a prompt that cannot fit `max_context` by its size
    (router/prompts.py): before anything expands it."""
    req = parse_request(raw, chat=chat, max_context=max_context)
    for i, prompt in enumerate(req.prompts):
        if problem := prompt_size_problem(prompt, max_context):
            where = f"prompt[{i}]: " if len(req.prompts) > 1 else ""
            raise BadRequest(where + problem, "messages" if chat else "prompt")
    return req


class _Outgoing:
    """The ASGI send of one request: header names in canonical case, the Server header, and the
    client's X-Request-Id echoed."""

    def __init__(self, scope: Scope, send: Send):
        self.send = send
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        self.extra = [(b"Server", SERVER)]
        if given is not None and _REQUEST_ID.fullmatch(given):
            self.extra.append((b"X-Request-Id", given))

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(_canonical(k), v) for k, v in message.get("headers", ())]
            message = {**message, "headers": headers + self.extra}
        await self.send(message)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port} for HTTP: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def _header_bytes(scope: Scope) -> int:
    """The size of the request line and headers, about as they came."""
    return len(scope["raw_path"]) + len(scope["query_string"]) + sum(len(k) + len(v) + 4 for k, v in scope["headers"])


def _canonical(name: bytes) -> bytes:
    return b"-".join(part.capitalize() for part in name.split(b"-"))


async def _gone(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a client that left while sending its body: none."""


async def _route_error(request: Request, exc: HTTPException) -> Response:
    method, path = request.method, request.scope["path"]
    if exc.status_code == 405:
        allowed = ", ".join(sorted((exc.headers or {}).get("Allow", "").split(", ")))
        message = f"method {method} is not allowed on {clipped(path, MAX_SHOWN_CHARS)} (use {allowed})"
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
        return _json(405, {"error": error}, exc.headers)
    if exc.status_code == 404:
        return _error(grpc.StatusCode.NOT_FOUND, f"no route {method} {path}")
    return _json(exc.status_code, error_body(grpc.StatusCode.INVALID_ARGUMENT, exc.detail)[1])


async def _internal_error(request: Request, exc: Exception) -> Response:
    return _error(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
