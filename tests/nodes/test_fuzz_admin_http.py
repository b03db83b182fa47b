"""Admin fuzzed on every process (the three nodes and the router), and the router's OpenAI HTTP
front (bodies: JSON objects with sampling fields broken, any JSON, bytes, text; request lines, paths
and framings; combinations of framing headers), on the shared fleet of tests/nodes/fuzz_fleet.py. The
fleet runs without API keys, so no call is UNAUTHENTICATED. Each Admin call gets the status its checks
expect; each HTTP request a whole answer (200, or an OpenAI error with 400/404/405/413/422; 501 for a
transfer coding other than chunked), never another 5xx, a hang or a dropped connection. After each
test the fleet is healthy and idle (`report`).
"""

from __future__ import annotations

import json
import math
import string

import grpc
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvbridge.router.config import parse_address
from kvbridge.v1 import admin_pb2, admin_pb2_grpc
from tests.nodes.fuzz_fleet import (
    SCALES,
    SETTINGS,
    TEXT,
    VOCAB,
    C,
    Expect,
    Fleet,
    client,
    fleet_fixture,
    generate,
    greedy_request,
    http_request,
    parse_raw,
    raw_http,
    report,
    served,
    tried,
)

fleet = fleet_fixture()

ADMIN, HTTP_BODIES, HTTP_FRAMING = 300, 440, 120  # default examples per test (x SLOW_SCALE under -m slow)

# ---------------------------------------------------------------------- admin

ASCII = st.text(alphabet=string.printable, max_size=24)
PHASES_ANY = st.one_of(
    st.sampled_from(["", "waiting", "prefilling", "decoding", "bootstrap", "prealloc", "routing", "colocated"]),
    st.just("prefill+decode"),
    ASCII,
)


def admin_input(fleet: Fleet, draw) -> None:
    """One Admin call to one process, and what it must answer."""
    target = draw(st.sampled_from(["colocated", "prefill", "decode", "router"]))
    addr = {"colocated": fleet.c.address, "prefill": fleet.p.address, "decode": fleet.d.address}.get(target)
    addr = addr or fleet.router_addr
    admin = client(admin_pb2_grpc.AdminStub, addr)
    router = target == "router"
    op = draw(st.sampled_from(["list", "list", "abort", "drain", "status", "config", "add", "add", "remove", "nodes"]))
    e = Expect()
    bad = C.INVALID_ARGUMENT
    role = address = None
    if op == "list":
        size = draw(st.one_of(st.sampled_from([0, 1, 1000, 1001, 2**32 - 1]), st.integers(0, 2**32 - 1)))
        token = draw(st.one_of(st.just(""), st.from_regex(r"[0-9]{1,30}", fullmatch=True), ASCII))
        phase = draw(PHASES_ANY)
        request = admin_pb2.ListRequestsRequest(page_size=size, page_token=token, phase=phase)
        method = admin.ListRequests
        if size > 1000:
            e.add(bad, f"page_size must be at most 1000, got {size}")
        if token and not token.isdigit():
            e.add(bad, f"page_token {token!r}")
        if router and phase and phase not in ("routing", "colocated", "prefill+decode", "local_prefill"):
            e.add(bad, "phase must be one of")
    elif op == "abort":
        rid = draw(st.one_of(st.just(""), TEXT, st.sampled_from(["x" * 1000])))
        request, method = admin_pb2.AbortRequestRequest(rid=rid), admin.AbortRequest
        if rid:
            e.add(C.NOT_FOUND, f"no request {repr(rid)[:40]}")  # (long ids are cut in the message)
        else:
            e.add(bad, "rid is required")
    elif op == "drain":
        wait_s = draw(st.one_of(st.sampled_from([0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e308]), st.floats()))
        request, method = admin_pb2.DrainRequest(wait_s=wait_s), admin.Drain
        if not wait_s >= 0:
            e.add(bad, f"wait_s must be >= 0, got {wait_s}")
    elif op == "status":
        request, method = admin_pb2.GetStatusRequest(), admin.GetStatus
    elif op == "config":
        request, method = admin_pb2.GetConfigRequest(), admin.GetConfig
    elif op in ("add", "remove"):
        role = draw(st.one_of(st.sampled_from(["colocated", "prefill", "decode", "", "router", "Decode"]), ASCII))
        address = draw(
            st.one_of(
                st.sampled_from(["127.0.0.1:1", "127.0.0.1:0", "127.0.0.1:65536", "[::1]:1", "::1:1", "h", ""]),
                st.builds("{}:{}".format, st.sampled_from(["127.0.0.1", "[::1]", "x"]), st.integers(0, 70000)),
                ASCII,
            )
        )
        if op == "add":
            request, method = admin_pb2.AddNodeRequest(role=role, address=address), admin.AddNode
        else:
            request, method = admin_pb2.RemoveNodeRequest(role=role, address=address), admin.RemoveNode
        roles = ("colocated", "prefill", "decode")
        if not router:
            e.add(C.UNIMPLEMENTED, "ask the router")
        elif (op == "add" or role) and role not in roles:
            e.add(bad, "role must be one of")
        else:
            try:
                parse_address(address)
            except ValueError:
                e.add(bad, "expected HOST:PORT")
                e.add(bad, "bad host")
            else:
                if op == "remove":
                    e.add(C.NOT_FOUND, f"node {address!r}")
    else:
        request, method = admin_pb2.ListNodesRequest(), admin.ListNodes
        if not router:
            e.add(C.UNIMPLEMENTED, "ask the router")
    tried("admin")
    out, code, details = None, None, ""
    try:
        try:
            out = method(request, timeout=10)
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
        e.check(f"{target} Admin.{op} {request}", code, details)
        if op == "drain" and code is None:
            assert out.draining and out.empty, out
            if target in ("colocated", "decode"):  # a draining node refuses new requests
                refused = generate(addr, greedy_request(), max_responses=1)
                assert refused[0] == C.UNAVAILABLE and "draining" in refused[1], refused
        if op == "add" and code is None:
            assert (out.role, out.address, out.healthy) == (role, address, False), out
    finally:
        if op == "drain":
            assert not admin.Resume(admin_pb2.ResumeRequest(), timeout=10).draining
        if op == "add" and router and code is None:
            admin.RemoveNode(admin_pb2.RemoveNodeRequest(role=role, address=address), timeout=10)


@SCALES
def test_admin_on_every_process(fleet, scale):
    @settings(max_examples=ADMIN * scale, **SETTINGS)
    @given(data=st.data())
    def one(data):
        admin_input(fleet, data.draw)

    one()
    report("admin", fleet)


# ---------------------------------------------------------------------- HTTP

JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
JSON = st.recursive(
    JSON_LEAF, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TEXT, kids, max_size=3), max_leaves=8
)
MAX_TOKENS = st.sampled_from([-1, 0, 2**32, "4", 1.5, 4.0, True, None, [4], {}])
PROMPT_VALUES = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "\ud800x", "a" * 5000, "<|im_end|>"]),
    st.lists(st.integers(-5, VOCAB + 5), max_size=6),
    st.lists(st.text(max_size=5), max_size=2),
    st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=3), max_size=2),
    JSON,
)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), JSON)},
            optional={"content": st.one_of(st.text(max_size=16), st.just("\udfff"), JSON)},
        ),
        max_size=3,
    ),
    JSON,
)
SAMPLING_FIELDS = {
    "model": st.one_of(st.just("tiny-random"), TEXT, JSON),
    "temperature": st.one_of(st.sampled_from([0, 0.5, 2, 2.5, -1, 1e-40, "1"]), JSON),
    "top_p": st.one_of(st.sampled_from([0, 0.5, 1, 1.5, -0.1]), JSON),
    "top_k": st.one_of(st.sampled_from([-2, -1, 0, 5, 2**32]), JSON),
    "seed": st.one_of(st.sampled_from([0, -1, 2**64, 2**64 - 1, 1.5]), JSON),
    "stop": st.one_of(
        st.text(max_size=4),
        st.lists(st.text(max_size=4), max_size=18),
        st.lists(st.sampled_from(["\ud800", "ok", "s" * 1025, "s" * 1024]), max_size=5),  # (surrogates, limits)
        JSON,
    ),
    "bad_words": st.one_of(
        st.lists(st.text(max_size=4), max_size=3),
        st.lists(st.sampled_from(["\udfff", "ok", " ", "b" * 129, "b" * 128]), max_size=17),
        st.sampled_from([128, 129]).map(lambda n: [f"w{i}" for i in range(n)]),
        JSON,
    ),
    "allowed_token_ids": st.one_of(
        st.lists(st.integers(-1, VOCAB), max_size=3), st.sampled_from([65536, 65537]).map(lambda n: [1] * n), JSON
    ),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 2**33), max_size=3), JSON),
    "ignore_eos": st.one_of(st.booleans(), JSON),
    "n": st.one_of(st.sampled_from([1, 2, 0, 1.0]), JSON),
    "stream": st.one_of(st.booleans(), JSON),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "echo": st.one_of(st.booleans(), JSON),
    "logprobs": st.one_of(st.none(), st.booleans(), st.integers(0, 5)),
    "presence_penalty": st.one_of(st.sampled_from([0, 0.5]), JSON),
    "logit_bias": st.one_of(
        st.just({}),
        st.just({"5": 1}),
        st.just({"\ud800": 1}),
        st.sampled_from([1024, 1025]).map(lambda n: {str(i % VOCAB): 1 for i in range(n)}),
        JSON,
    ),
    "response_format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), JSON),
    "unknown_field": JSON,
}


@st.composite
def http_bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    kind = draw(st.sampled_from(["object", "object", "object", "object", "json", "bytes", "text"]))
    if kind == "json":
        return path, json.dumps(draw(JSON)).encode()
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "text":
        return path, draw(st.text(max_size=64)).encode("utf-8", "surrogatepass")
    completions = path == "/v1/completions"
    if completions:
        body = {"prompt": draw(st.text(min_size=1, max_size=24) | st.lists(st.integers(0, VOCAB - 1), min_size=1))}
    else:
        body = {"messages": [{"role": "user", "content": draw(st.text(max_size=24))}]}
    body["max_tokens"] = draw(st.integers(1, 4))
    body |= draw(st.dictionaries(st.sampled_from(sorted(SAMPLING_FIELDS)), st.just(None), max_size=3))
    for name in list(body):
        if name in SAMPLING_FIELDS:
            body[name] = draw(SAMPLING_FIELDS[name])
    if draw(st.integers(0, 3)) == 3:  # and break one of the required ones
        name = draw(st.sampled_from(["max_tokens", "prompt" if completions else "messages"]))
        strategy = {"max_tokens": MAX_TOKENS, "prompt": PROMPT_VALUES, "messages": MESSAGES}[name]
        if draw(st.booleans()):
            del body[name]
        else:
            body[name] = draw(strategy)
    return path, json.dumps(body).encode()


def check_http_answer(where: str, status: int, headers: dict, data: bytes, completion: bool = True) -> None:
    """A client error in the OpenAI error format, or a whole answer: never 5xx, never a cut-off."""
    assert status in (200, 400, 404, 405, 413, 422), f"{where}: {status} {data[:300]!r}"
    if status == 200:
        served()
    kind = headers.get("Content-Type", "")
    if status == 200 and kind == "text/event-stream":
        assert data.rstrip().endswith(b"data: [DONE]"), f"{where}: the stream did not end: {data[-200:]!r}"
        return
    assert kind == "application/json", f"{where}: {status} {kind} {data[:200]!r}"
    obj = json.loads(data)
    if status == 200:
        assert not completion or (obj["choices"] and obj["usage"]["completion_tokens"] >= 0), f"{where}: {obj}"
        return
    err = obj["error"]
    assert isinstance(err["message"], str) and err["message"], f"{where}: {obj}"
    assert isinstance(err["type"], str) and isinstance(err["code"], str), f"{where}: {obj}"


@SCALES
def test_http_bodies(fleet, scale):
    @settings(max_examples=HTTP_BODIES * scale, **SETTINGS)
    @given(body=http_bodies())
    @example(body=("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e-40}'))
    @example(body=("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'))
    @example(body=("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}'))
    @example(body=("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'))
    @example(body=("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "bad_words": ["\\ud800"]}'))  # (was a 500)
    @example(body=("/v1/completions", b"[" * 100_000))
    @example(body=("/v1/completions", b'{"max_tokens": 2, "prompt": "' + b"a" * 2_000_000 + b'"}'))
    @example(body=("/v1/completions", b"\xff\xfe\x00{"))
    def one(body):
        tried("http")
        path, raw = body
        status_, headers, data = http_request(
            fleet.router.http_port, "POST", path, raw, {"Content-Type": "application/json"}
        )
        check_http_answer(f"POST {path} {raw[:300]!r}", status_, headers, data)

    one()
    report("http", fleet)


@SCALES
def test_http_paths_and_framing(fleet, scale):
    @settings(max_examples=HTTP_FRAMING * scale, **SETTINGS)
    @given(
        method=st.sampled_from(["GET", "POST"]),
        path=st.one_of(
            st.sampled_from(["/", "/v1", "/v1/models/", "/v1/models/nope", "/v1/completions/", "/health/x", "/%ff"]),
            st.text(alphabet=string.ascii_letters + string.digits + "/%._-~", max_size=40).map(lambda t: "/" + t),
        ),
        framing=st.sampled_from(["length", "bad-length", "negative", "huge", "chunked", "bad-chunked", "huge-chunked"]),
    )
    @example(method="POST", path="/v1/completions", framing="huge")
    def one(method, path, framing):
        tried("http")
        body = b'{"prompt": [1, 2], "max_tokens": 2}'
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        if framing == "length":
            msg = head + f"Content-Length: {len(body)}\r\n\r\n"
            data = msg.encode() + body
        elif framing in ("bad-length", "negative"):
            data = (head + f"Content-Length: {'abc' if framing == 'bad-length' else '-5'}\r\n\r\n").encode() + body
        elif framing == "huge":  # the declared size alone gets 413: the body is never sent
            data = (head + f"Content-Length: {(16 << 20) + 1}\r\n\r\n").encode() + body[:5]
        elif framing == "chunked":
            data = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"%X\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        elif framing == "bad-chunked":
            data = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"zz\r\n" + body + b"\r\n0\r\n\r\n"
        else:
            data = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"%X\r\nab\r\n" % ((16 << 20) + 1)
        out = raw_http(fleet.router.http_port, data)
        assert out, f"{method} {path} {framing}: the connection was dropped without an answer"
        status_, headers, payload = parse_raw(out)
        completion = method == "POST" and path in ("/v1/completions", "/v1/chat/completions")
        check_http_answer(f"{method} {path} {framing}", status_, headers, payload, completion)
        known = path in ("/v1/completions", "/v1/chat/completions") if method == "POST" else path == "/health"
        if not known and not (method == "GET" and path.startswith("/v1/models")):
            # a malformed framing is refused (400) before any route is looked at, whatever the method
            malformed = framing in ("bad-length", "negative", "bad-chunked")
            assert status_ in (404, 405, 413) or ((method == "POST" or malformed) and status_ == 400), (path, status_)

    one()
    report("http", fleet)


FRAMING_HEADERS = {  # name -> the header line, given the body's length n
    "length": lambda n: f"Content-Length: {n}",
    "length-other": lambda n: f"Content-Length: {n + 1}",
    "length-list": lambda n: f"Content-Length: {n}, {n}",
    "length-abc": lambda n: "Content-Length: abc",
    "length-negative": lambda n: f"Content-Length: -{n}",
    "chunked": lambda n: "Transfer-Encoding: chunked",
    "chunked-upper": lambda n: "Transfer-Encoding: CHUNKED",
    "gzip": lambda n: "Transfer-Encoding: gzip",
    "gzip-chunked": lambda n: "Transfer-Encoding: gzip, chunked",
    "host": lambda n: "Host: y",
}


@SCALES
def test_http_header_combinations(fleet, scale):
    """Framing headers in any combination (up to three, repeats allowed), on HTTP/1.1 or 1.0, with the
    body sent plain, chunked or as a bad chunk: each gets an answer on arrival (never the body timeout),
    and a message with both Content-Length and Transfer-Encoding is refused with 400."""

    @settings(max_examples=HTTP_FRAMING * scale, **SETTINGS)
    @given(
        names=st.lists(st.sampled_from(sorted(FRAMING_HEADERS)), max_size=3),
        version=st.sampled_from(["1.1", "1.1", "1.0"]),
        sent=st.sampled_from(["plain", "chunked", "bad-chunk"]),
    )
    @example(names=["length", "chunked"], version="1.1", sent="plain")
    @example(names=["chunked", "length"], version="1.1", sent="chunked")
    @example(names=["length", "length-other"], version="1.1", sent="plain")
    @example(names=["chunked"], version="1.0", sent="chunked")
    def one(names, version, sent):
        tried("http")
        body = b'{"prompt": [1, 2], "max_tokens": 2}'
        lines = "".join(FRAMING_HEADERS[name](len(body)) + "\r\n" for name in names)
        head = f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n{lines}\r\n"
        # every body is at least as long as any Content-Length declared and ends a line, so no framing
        # leaves the server waiting on the client
        payload = {
            "plain": body + b"\r\n",
            "chunked": b"%X\r\n%s\r\n0\r\n\r\n" % (len(body), body),
            "bad-chunk": b"zz\r\n" + body + b"\r\n0\r\n\r\n",
        }[sent]
        where = f"{names} HTTP/{version} {sent}"
        out = raw_http(fleet.router.http_port, head.encode() + payload)
        assert out, f"{where}: the connection was dropped without an answer"
        status_, headers, data = parse_raw(out)
        codings = [n for n in names if n in ("chunked", "chunked-upper", "gzip", "gzip-chunked")]
        unknown = len(codings) > 1 or any(n.startswith("gzip") for n in codings)
        if unknown and status_ == 501:  # (RFC 9112: a transfer coding the server does not implement)
            return
        check_http_answer(where, status_, headers, data)
        faulty = bool(codings) and (any(n.startswith("length") for n in names) or version == "1.0")  # RFC 9112 6.1
        if faulty or "host" in names:
            assert status_ == 400 and b"malformed HTTP request" in data, f"{where}: {status_} {data[:300]!r}"

    one()
    report("http", fleet)
