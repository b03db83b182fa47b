"""The router's HTTP front against in-test nodes: its limits (body size, header and body timeouts,
requests at once), the connections it keeps and closes, X-Request-Id, errors in the OpenAI
format, a vanished client cancelling upstream, and no thread per request or connection."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import socket
import time

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.router import connection
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import generation_pb2, generation_pb2_grpc
from tests.router.fakes import make_request, wait_until

BODY = json.dumps({"prompt": [1, 2, 3]}).encode()
STREAM_BODY = json.dumps({"prompt": [1, 2, 3], "stream": True}).encode()


def post_head(path: str = "/v1/completions", length: int | None = None, extra: str = "") -> bytes:
    framing = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}{extra}\r\n".encode()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer with a Content-Length: (status, headers by lowercase name, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "closed inside the body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """The server closed the connection (EOF, or a reset); False if it sent anything first."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def first_event(sock: socket.socket) -> dict:
    """Read a streamed answer up to its first event."""
    data = b""
    while b"\n\n" not in data.partition(b"\r\n\r\n")[2]:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the first event: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    event = rest.split(b"\r\n", 1)[1].split(b"\n\n")[0]  # past the chunk's size line
    return json.loads(event.removeprefix(b"data: "))


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers by lowercase name, parsed JSON body) on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read())
    finally:
        conn.close()


def error(message: str, kind: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_text(body: dict) -> str:
    return body["choices"][0]["text"]


# ---------------------------------------------------------------- body limit and timeouts


def test_a_body_declared_over_the_limit_gets_413_before_it_is_sent(fleet):
    router, nodes = fleet(colocated=1, router={"max_body_bytes": 1000})
    with connect(router.http_port) as sock:
        sock.sendall(post_head(length=1001))  # the body never comes
        status, headers, body = read_answer(sock)
        assert (status, headers["connection"], json.loads(body)) == (
            413, "close", error("body over 1000 bytes", "invalid_request_error", "invalid_argument")
        )  # fmt: skip
        assert closed_by_server(sock)
    assert nodes["colocated"][0].requests == []


def test_a_chunked_body_is_cut_off_at_the_limit_with_413(fleet):
    router, nodes = fleet(colocated=1, router={"max_body_bytes": 1000})
    with connect(router.http_port) as sock:
        sock.sendall(post_head())
        for _ in range(3):  # 1200 bytes in three chunks: the third crosses the limit
            sock.sendall(b"190\r\n" + b"x" * 400 + b"\r\n")
        status, headers, body = read_answer(sock)
        assert (status, headers["connection"], json.loads(body)) == (
            413, "close", error("body over 1000 bytes", "invalid_request_error", "invalid_argument")
        )  # fmt: skip
        assert closed_by_server(sock)
    assert nodes["colocated"][0].requests == []
    with connect(router.http_port) as sock:  # a chunked body under the limit is served
        sock.sendall(post_head() + b"%X\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
        status, _, body = read_answer(sock)
        assert (status, completion_text(json.loads(body))) == (200, "t0 t1 t2 t3 ")


def test_a_chunk_declared_over_the_limit_gets_413_before_it_is_sent(fleet):
    router, nodes = fleet(colocated=1, router={"max_body_bytes": 1000})
    with connect(router.http_port) as sock:
        sock.sendall(post_head() + b"190\r\n" + b"x" * 400 + b"\r\n" + b"259\r\nab")  # 400 + 601 declared
        status, headers, body = read_answer(sock)
        assert (status, headers["connection"], json.loads(body)) == (
            413, "close", error("body over 1000 bytes", "invalid_request_error", "invalid_argument")
        )  # fmt: skip
        assert closed_by_server(sock)
    assert nodes["colocated"][0].requests == []


BIG_BODY = json.dumps({"prompt": "x" * 7_600_000}).encode()  # 7.6 MB: over the default limit (4 MiB)


def send_whole(sock: socket.socket, body: bytes, chunked: bool) -> None:
    """The request, its whole body sent before anything is read (as http.client and requests do)."""
    if not chunked:
        sock.sendall(post_head(length=len(body)) + body)
        return
    sock.sendall(post_head())
    for start in range(0, len(body), 1 << 16):
        part = body[start : start + (1 << 16)]
        sock.sendall(b"%X\r\n%s\r\n" % (len(part), part))
    sock.sendall(b"0\r\n\r\n")


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_sent_whole_before_reading_gets_its_413(fleet, chunked):
    """The router closed at the limit, and the kernel answered the bytes still coming with a reset:
    a client still sending never read its 413. Now it drops them until the client stops."""
    router, nodes = fleet(colocated=1)
    with connect(router.http_port) as sock:
        send_whole(sock, BIG_BODY, chunked)
        status, headers, body = read_answer(sock)
        assert (status, headers["connection"], json.loads(body)) == (
            413, "close", error("body over 4194304 bytes", "invalid_request_error", "invalid_argument")
        )  # fmt: skip
        assert closed_by_server(sock)
    assert nodes["colocated"][0].requests == []
    assert wait_until(lambda: router.http.requests_in_flight == 0)


def test_what_a_refused_client_still_sends_is_dropped_up_to_a_bound(fleet, monkeypatch):
    monkeypatch.setattr(connection, "LINGER_BYTES", 1 << 20)
    router, _ = fleet(colocated=1)
    with connect(router.http_port) as sock, pytest.raises(ConnectionError):  # (a reset, or a broken pipe)
        send_whole(sock, BIG_BODY * 8, chunked=False)  # 61 MB: cut off once 1 MiB past the limit is dropped


@pytest.mark.parametrize("path", ["/v1/completions", "/nowhere"])  # the body read or not
def test_a_malformed_body_gets_400_on_any_route_and_logs_nothing(fleet, caplog, path):
    router, _ = fleet(colocated=1)
    with caplog.at_level(logging.WARNING), connect(router.http_port) as sock:
        sock.sendall(post_head(path) + b"zz\r\n" + BODY + b"\r\n0\r\n\r\n")
        status, headers, body = read_answer(sock)
        message = "malformed HTTP request: illegal chunk header: bytearray(b'zz\\r\\n')"
        assert (status, headers["content-type"], json.loads(body)) == (
            400, "application/json", error(message, "invalid_request_error", "invalid_argument")
        )  # fmt: skip
        assert closed_by_server(sock)
    assert wait_until(lambda: router.http.requests_in_flight == 0)
    assert [r.getMessage() for r in caplog.records] == []


def test_a_body_that_does_not_arrive_in_time_gets_408(fleet):
    router, nodes = fleet(colocated=1, router={"http_body_timeout_s": 0.3})
    with connect(router.http_port) as sock:
        sock.sendall(post_head(length=len(BODY)) + BODY[:5])  # the rest never comes
        status, headers, body = read_answer(sock)
        message = "the request body did not arrive within 0.3 s"
        assert (status, headers["connection"], json.loads(body)) == (
            408, "close", error(message, "server_error", "deadline_exceeded")
        )  # fmt: skip
        assert closed_by_server(sock)
    assert nodes["colocated"][0].requests == []


# ---------------------------------------------------------------- connections


def test_a_client_trickling_its_headers_is_disconnected_while_others_are_served(fleet):
    router, _ = fleet(colocated=1, router={"http_header_timeout_s": 0.5, "http_keep_alive_s": 0.5})
    with connect(router.http_port) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        status, _, body = request(router.http_port, "POST", "/v1/completions", BODY)  # meanwhile, another client
        assert (status, completion_text(body)) == (200, "t0 t1 t2 t3 ")
        slow.settimeout(0.1)
        got, sent = b"", 0
        while sent < 300:  # a byte every 0.1 s: the connection stays busy, its headers never end
            try:
                slow.sendall(b"a")
                sent += 1
                got += slow.recv(1024)
                break  # the server answered, or closed (b"")
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        assert got == b""  # closed without an answer
        assert sent < 300


def test_two_hundred_idle_connections_do_not_stop_a_request(fleet):
    router, _ = fleet(colocated=1)
    held = [connect(router.http_port) for _ in range(200)]
    try:
        for sock in held:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")  # headers started, never finished
        status, _, body = request(router.http_port, "POST", "/v1/completions", BODY)
        assert (status, completion_text(body)) == (200, "t0 t1 t2 t3 ")
    finally:
        for sock in held:
            sock.close()


def test_keep_alive_serves_several_requests_on_one_connection(fleet):
    router, _ = fleet(colocated=1)
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=30)
    try:
        answers = []
        for _ in range(3):
            conn.request("POST", "/v1/completions", body=BODY)
            resp = conn.getresponse()
            answers.append((resp.status, completion_text(json.loads(resp.read())), conn.sock.getsockname()))
        assert [a[:2] for a in answers] == [(200, "t0 t1 t2 t3 ")] * 3
        assert len({a[2] for a in answers}) == 1  # one socket
    finally:
        conn.close()


@pytest.mark.parametrize("pieces", [1, 8])  # all at once (whole when parsed), or in pieces (cut off while coming)
def test_headers_over_the_cap_get_431_in_the_openai_format(fleet, pieces):
    router, _ = fleet(colocated=1)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n"
    with connect(router.http_port) as sock:
        step = -(-len(head) // pieces)
        for i in range(0, len(head), step):
            sock.sendall(head[i : i + step])
            if pieces > 1:
                time.sleep(0.05)  # (so that they arrive apart)
        status, headers, body = read_answer(sock)
        assert (status, headers["content-type"], headers["connection"], json.loads(body)) == (
            431, "application/json", "close",
            error("request headers over 65536 bytes", "invalid_request_error", "invalid_argument"),
        )  # fmt: skip


def test_malformed_requests_and_other_methods_get_openai_errors(fleet):
    router, _ = fleet(colocated=1)
    with connect(router.http_port) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        status, headers, body = read_answer(sock)
        assert (status, headers["content-type"], json.loads(body)["error"]["code"]) == (
            400, "application/json", "invalid_argument"
        )  # fmt: skip
    status, headers, body = request(router.http_port, "PUT", "/v1/completions", b"{}")
    message = "method PUT is not allowed on /v1/completions (use POST)"
    assert (status, headers["allow"], body) == (
        405, "POST", error(message, "invalid_request_error", "method_not_allowed")
    )  # fmt: skip
    status, _, body = request(router.http_port, "POST", "/v1/completions/", BODY)  # no redirect: not a route
    assert (status, body) == (404, error("no route POST /v1/completions/", "not_found_error", "not_found"))


def head_of(*headers: str, method: str = "POST", path: str = "/v1/completions", version: str = "1.1") -> bytes:
    return (f"{method} {path} HTTP/{version}\r\nHost: x\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


CHUNKED_BODY = b"%X\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
FRAMINGS = {  # raw request -> (status, the error's message after "malformed HTTP request: ")
    "length-then-chunked": (
        head_of("Content-Length: 5", "Transfer-Encoding: chunked") + b"hello",
        400, "both Content-Length and Transfer-Encoding: send one",
    ),
    "chunked-then-length": (
        head_of("Transfer-Encoding: chunked", f"Content-Length: {len(BODY)}") + CHUNKED_BODY,
        400, "both Content-Length and Transfer-Encoding: send one",
    ),
    "both-on-a-get": (
        head_of("Content-Length: 0", "Transfer-Encoding: chunked", method="GET", path="/health") + b"0\r\n\r\n",
        400, "both Content-Length and Transfer-Encoding: send one",
    ),
    "chunked-in-http-1.0": (
        head_of("Transfer-Encoding: chunked", version="1.0") + CHUNKED_BODY,
        400, "Transfer-Encoding in an HTTP/1.0 request",
    ),
    "two-lengths": (
        head_of("Content-Length: 5", "Content-Length: 6") + b"hello!", 400, "conflicting Content-Length headers",
    ),
    "length-list": (head_of("Content-Length: 5, 6") + b"hello!", 400, "conflicting Content-Length headers"),
    "length-not-a-number": (head_of("Content-Length: abc") + b"hello", 400, "bad Content-Length"),
    "length-negative": (head_of("Content-Length: -1") + b"hello", 400, "bad Content-Length"),
    "length-plus": (head_of("Content-Length: +5") + b"hello", 400, "bad Content-Length"),
    "length-of-30-digits": (head_of("Content-Length: " + "9" * 30) + b"hello", 400, "bad Content-Length"),
    "bad-chunk-size": (
        head_of("Transfer-Encoding: chunked") + b"zz\r\nhello\r\n0\r\n\r\n",
        400, "illegal chunk header: bytearray(b'zz\\r\\n')",
    ),
    "negative-chunk-size": (
        head_of("Transfer-Encoding: chunked") + b"-5\r\nhello\r\n0\r\n\r\n",
        400, "illegal chunk header: bytearray(b'-5\\r\\n')",
    ),
    "two-hosts": (head_of("Host: y", f"Content-Length: {len(BODY)}") + BODY, 400, "Found multiple Host: headers"),
    "space-before-colon": (
        head_of(f"Content-Length : {len(BODY)}") + BODY,
        400, f"illegal header line: bytearray(b'Content-Length : {len(BODY)}')",
    ),
    "unknown-coding": (  # (RFC 9112: 501 for a transfer coding the server does not implement)
        head_of("Transfer-Encoding: gzip") + b"hello", 501, "Only Transfer-Encoding: chunked is supported",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", FRAMINGS)
def test_malformed_framing_gets_its_answer_at_once_and_the_connection_closes(fleet, name):
    """Content-Length beside Transfer-Encoding waited for the body timeout (h11 let the chunked framing
    win and waited for chunks). Each framing is refused on arrival: the router's timeouts are 300 s,
    and the client waits 30."""
    router, _ = fleet(colocated=1, router={"http_header_timeout_s": 300.0, "http_body_timeout_s": 300.0})
    data, status, says = FRAMINGS[name]
    with connect(router.http_port) as sock:
        sock.sendall(data)
        got, headers, body = read_answer(sock)
        assert (got, json.loads(body)) == (
            status,
            error(f"malformed HTTP request: {says}", "invalid_request_error", "invalid_argument"),
        )
        assert headers["connection"] == "close" and closed_by_server(sock)
    status, _, body = request(router.http_port, "POST", "/v1/completions", BODY)  # and the router serves on
    assert status == 200 and completion_text(body)


# ---------------------------------------------------------------- requests at once, request ids, errors


def test_over_the_concurrency_limit_a_request_gets_503_with_retry_after_at_once(fleet):
    router, nodes = fleet(colocated=1, first_s=60.0, router={"max_concurrent_requests": 2})
    [node] = nodes["colocated"]
    held = [connect(router.http_port) for _ in range(2)]
    for sock in held:
        sock.sendall(post_head(length=len(STREAM_BODY)) + STREAM_BODY)
    assert wait_until(lambda: len(node.requests) == 2)
    status, headers, body = request(router.http_port, "POST", "/v1/completions", BODY)
    message = "the router is handling 2 requests, its limit; retry later"
    assert (status, headers["retry-after"], body) == (503, "1", error(message, "server_error", "unavailable"))
    assert len(node.requests) == 2  # never routed

    held.pop().close()
    assert wait_until(lambda: router.http.requests_in_flight == 1)
    node.first_s = 0.0
    status, _, body = request(router.http_port, "POST", "/v1/completions", BODY)
    assert (status, completion_text(body)) == (200, "t0 t1 t2 t3 ")
    held.pop().close()
    assert wait_until(lambda: len(node.cancelled) == 2)


def test_the_clients_request_id_is_echoed_and_the_rid_stays_the_routers(fleet):
    router, nodes = fleet(colocated=1)
    status, headers, body = request(router.http_port, "POST", "/v1/completions", BODY, {"X-Request-Id": "abc.1-2"})
    assert (status, headers["x-request-id"]) == (200, "abc.1-2")
    [seen] = nodes["colocated"][0].requests
    assert body["id"] == "cmpl-" + seen.rid and len(seen.rid) == 32
    status, headers, _ = request(router.http_port, "GET", "/nowhere", headers={"X-Request-Id": "on-errors-too"})
    assert (status, headers["x-request-id"]) == (404, "on-errors-too")
    for bad in ("x" * 129, "has space"):
        status, headers, _ = request(router.http_port, "GET", "/health", headers={"X-Request-Id": bad})
        assert (status, "x-request-id" in headers) == (200, False)


def test_full_nodes_after_the_retries_are_429(fleet):
    router, nodes = fleet(colocated=2)
    for node in nodes["colocated"]:
        node.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
    status, _, body = request(router.http_port, "POST", "/v1/completions", BODY)
    last = max(nodes["colocated"], key=lambda n: n.arrived[0])
    message = f"{last.address} fails as told (from colocated/{last.address})"
    assert (status, body) == (429, error(message, "rate_limit_error", "resource_exhausted"))
    assert [len(n.requests) for n in nodes["colocated"]] == [1, 1]


# ---------------------------------------------------------------- clients that leave


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_the_request_upstream_without_a_traceback(fleet, caplog, stream):
    router, nodes = fleet(colocated=1, tokens=5000, token_s=0.01)
    [node] = nodes["colocated"]
    body = STREAM_BODY if stream else BODY
    with caplog.at_level(logging.WARNING):
        sock = connect(router.http_port)
        sock.sendall(post_head(length=len(body)) + body)
        if stream:
            assert first_event(sock)["choices"][0]["text"] == "t0 "
        else:
            assert wait_until(lambda: node.requests)
        sock.close()
        rid = node.requests[0].rid
        assert wait_until(lambda: node.cancelled == [rid])
        assert wait_until(lambda: router.dispatcher.num_in_flight() == 0 and router.http.requests_in_flight == 0)
    assert node.completed == [] and router.pool.outstanding() == {f"colocated/{node.address}": 0}
    assert [r.getMessage() for r in caplog.records] == []
    registry = router.dispatcher.metrics.registry
    assert registry.get_sample_value("kvbridge_router_requests_total", {"outcome": "abort"}) == 1


# ---------------------------------------------------------------- no thread per request


class SlowGeneration(generation_pb2_grpc.GenerationServicer):
    """An asyncio node: one token at once, then nothing until cancelled (it records the rid)."""

    def __init__(self):
        self.cancelled: list[str] = []

    async def Generate(self, request, context):
        await context.write(generation_pb2.GenerateResponse(rid=request.rid, token_ids=[100], text="t0 "))
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.append(request.rid)
            raise


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_hundreds_of_open_streams_take_no_thread_each():
    """300 HTTP streams and 100 gRPC streams open through the router at once, against an asyncio
    node that answers each with one token and then holds it."""
    slow = SlowGeneration()
    node = rpc.AioServer(
        "127.0.0.1", 0, [(generation_pb2_grpc.add_GenerationServicer_to_server, slow)], ["kvbridge.v1.Generation"]
    )
    router = start_router(RouterConfig(port=0, http_port=0, colocated=(f"127.0.0.1:{node.port}",), health_retry_s=0.1))
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
    clients: list[socket.socket] = []
    calls = []
    try:
        warm = connect(router.http_port)  # one stream first, so that lazily made threads exist before counting
        warm.sendall(post_head(length=len(STREAM_BODY)) + STREAM_BODY)
        first_event(warm)
        warm.close()
        warm_call = stub.Generate(make_request(), timeout=60)
        next(warm_call)
        warm_call.cancel()
        assert wait_until(lambda: len(slow.cancelled) == 2)
        before = threads()
        for _ in range(300):
            clients.append(connect(router.http_port))
            clients[-1].sendall(post_head(length=len(STREAM_BODY)) + STREAM_BODY)
        calls = [stub.Generate(make_request(), timeout=60) for _ in range(100)]
        rids = [first_event(sock)["id"].removeprefix("cmpl-") for sock in clients]
        rids += [next(call).rid for call in calls]
        assert router.dispatcher.num_in_flight() == 400
        during = threads()
        print(f"threads: {before} before, {during} with 400 streams open ({during - before:+d})")
        assert during - before < 100
    finally:
        for sock in clients:
            sock.close()
        for call in calls:
            call.cancel()
    try:
        assert wait_until(lambda: len(slow.cancelled) == 402, timeout=30)
        assert sorted(slow.cancelled[2:]) == sorted(rids)
        assert wait_until(lambda: router.dispatcher.num_in_flight() == 0)
    finally:
        router.stop(grace_s=0)
        node.stop(0)
