"""The fleet the bad-input fuzzers (tests/nodes/test_fuzz_*.py) run against, and what they share: a
colocated node (pp 1), a prefill node (pp 2), a decode node (pp 2, grpc transfers) and a router
(gRPC and HTTP) over them, on tiny-random, in this process; the generation strategies; an input's
expected outcome (`Expect`); the per-group counts and health check (`report`: every rank lives,
every node is idle, with no KV page used, and a normal request gets the tokens it got at first).
One fleet serves every module of a session: started by the first that asks, stopped after the last
test that uses it, with a line per group and the total. A fuzz test takes `scale` (SCALES): its
default example count, and SLOW_SCALE times that under `pytest -m slow`.

Inputs of the last runs, default / -m slow: Generate@router 242 / 1201, @colocated 243 / 1202,
@decode 240 / 1200, Prefill+Bootstrap 280 / 1400, KVReceiver 206 / 1050, Admin 300 / 1500, HTTP 568 /
2808: 2079 / 10361 (1.5 / 5.5 min on 2 cores); the wire decoders' (test_fuzz_wire.py) 4106 / 20506.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import itertools
import json
import math
import secrets
import socket
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st

from kvbridge.common import rpc
from kvbridge.engine.config import PPConfig
from kvbridge.kv_transfer import adapters as kv_wire
from kvbridge.nodes import start_node
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.conftest import hard_deadline
from tests.pd import TINY, fleet_signed, signed_route, token_prompt

HARD_TIMEOUT_S = 900  # a test module (slow run included); faulthandler dumps every thread and exits past it
VOCAB = 320  # tiny-random
MAX_CONTEXT = 4096
NORMAL_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
NORMAL_TOKENS = 6
MAX_RESPONSES = 4  # a successful stream is read this far, then cancelled (frees it like a client that left)
CALL_S = 30.0  # deadline of a call that should answer (a hang fails the example)
WAIT_S = 0.4  # deadline of a valid Prefill that no decode node registers: it waits, then DEADLINE_EXCEEDED
C = grpc.StatusCode
NEVER = (C.UNKNOWN, C.INTERNAL)

TRIED: collections.Counter = collections.Counter()  # inputs tried, per group
SERVED: collections.Counter = collections.Counter()  # of which served (the rest were refused, as they must be)
_group = [""]  # the group of the example running now


def tried(group: str) -> None:
    TRIED[group] += 1
    _group[0] = group


def served() -> None:
    SERVED[_group[0]] += 1


SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    # no shrinking: an input's outcome may depend on what earlier ones left on the fleet (a shrunk
    # input would not reproduce), and after a node died every replay fails for minutes
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
SLOW_SCALE = 5  # examples of a fuzz test under `pytest -m slow`, in multiples of its default count
SCALES = pytest.mark.parametrize(
    "scale", [pytest.param(1, id="x1"), pytest.param(SLOW_SCALE, marks=pytest.mark.slow, id=f"x{SLOW_SCALE}")]
)


# ---------------------------------------------------------------------- the fleet


class FakePrefill:
    """A Bootstrap service that answers GetLayout with a prefill layout, records registrations and
    confirms revocations (the test writes nothing after a hand-off fails): it stands in for a
    prefill node so a test can play the prefill side of a transfer."""

    def __init__(self, layout):
        self.layout = layout
        self.registrations: dict[int, prefill_pb2.RegisterRequest] = {}
        self.revoked: list[int] = []  # rooms the decode node gave up on, in order
        self._cv = threading.Condition()
        outer = self

        class Servicer(prefill_pb2_grpc.BootstrapServicer):
            def GetLayout(self, request, context):
                answer = prefill_pb2.GetLayoutResponse(layout=kv_wire.layout_to_proto(outer.layout))
                return fleet_signed(answer, request.nonce)

            def Register(self, request, context):
                with outer._cv:
                    outer.registrations[request.room] = request
                    outer._cv.notify_all()
                return prefill_pb2.RegisterResponse()

            def Revoke(self, request, context):
                outer.revoked.append(request.room)
                return prefill_pb2.RevokeResponse()

        add = prefill_pb2_grpc.add_BootstrapServicer_to_server
        self.server, port, _ = rpc.make_server("127.0.0.1", 0, [(add, Servicer())], ["kvbridge.v1.Bootstrap"])
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def registration(self, room: int, timeout: float = 10.0) -> prefill_pb2.RegisterRequest | None:
        with self._cv:
            self._cv.wait_for(lambda: room in self.registrations, timeout)
            return self.registrations.pop(room, None)

    def stop(self) -> None:
        self.server.stop(0).wait()


@dataclass
class Fleet:
    c: object  # colocated ColocatedServer
    p: object  # PrefillServer
    d: object  # DecodeServer
    router: object
    fake: FakePrefill
    baseline: dict = field(default_factory=dict)

    @property
    def nodes(self):
        return (self.c, self.p, self.d)

    @property
    def router_addr(self) -> str:
        return f"127.0.0.1:{self.router.port}"

    @property
    def tokenizer(self):
        return self.c.node.front.tokenizer


def client(cls, addr: str):
    return cls(rpc.make_channel(addr))


def stop_node(server) -> None:
    if server.dead or server.node.ranks.dead_ranks():
        server.node.ranks.kill()
        server.server.stop(0)
    else:
        server.stop()


def start_fleet() -> Fleet:
    with ThreadPoolExecutor(3) as pool:
        c = pool.submit(start_node, "colocated", NodeConfig(TINY, PPConfig()))
        p = pool.submit(start_node, "prefill", NodeConfig(TINY, PPConfig(pp_size=2)))
        d = pool.submit(start_node, "decode", NodeConfig(TINY, PPConfig(pp_size=2), transfer_backend="grpc"))
        c, p, d = c.result(), p.result(), d.result()
    router = start_router(
        RouterConfig(
            port=0, http_port=0, colocated=(c.address,), prefill=(p.address,), decode=(d.address,), startup_wait_s=10
        )
    )
    f = Fleet(c, p, d, router, FakePrefill(p.node.layout))
    f.baseline = normal_outputs(f)
    return f


def stop_fleet(f: Fleet) -> None:
    procs = [proc for node in f.nodes for proc in node.node.ranks.procs]
    f.router.stop()
    f.fake.stop()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(stop_node, f.nodes))
    # nothing outlives the fleet: no rank process, no shared-memory pool segment
    assert not [proc.name for proc in procs if proc.is_alive()]
    assert not [seg.name for proc in procs for seg in Path("/dev/shm").glob(f"kvbridge-{proc.pid}-*")]


def summary(counts: collections.Counter, served_counts: collections.Counter | None = None) -> list[str]:
    """A line per group and the total."""
    ok = {g: f" ({served_counts[g]} served)" if served_counts is not None else "" for g in counts}
    lines = [f"[bad-input] {group}: {n} inputs{ok[group]}" for group, n in counts.items()]
    return [*lines, f"[bad-input] total: {sum(counts.values())} inputs over {len(counts)} groups"]


def say(config, lines: list[str]) -> None:
    """Lines on the terminal, output captured or not."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join(lines), flush=True)


_live: list[Fleet] = []  # the session's fleet, while it runs
_fixtures: list = []  # every module's `fleet` fixture (fleet_fixture)


def _stop_live(config) -> None:
    if _live:
        f = _live.pop()
        stop_fleet(f)
        say(config, summary(TRIED, SERVED))


def fleet_fixture():
    """A module fixture over the session's fleet (`fleet = fleet_fixture()` in a test module)."""

    @pytest.fixture(scope="module")
    def fleet(request):
        with hard_deadline(HARD_TIMEOUT_S):
            if not _live:
                _live.append(start_fleet())
                request.config.add_cleanup(lambda: _stop_live(request.config))  # after an early exit (-x) too
            yield _live[0]
        users = [item for item in request.session.items if getattr(item.module, "fleet", None) in _fixtures]
        if users and users[-1].module is request.module:  # no later test needs it
            _stop_live(request.config)

    _fixtures.append(fleet)
    return fleet


def generate(addr: str, req: generation_pb2.GenerateRequest, max_responses: int = MAX_RESPONSES, timeout=CALL_S):
    """(status code or None, details, tokens). A stream still going after max_responses is cancelled
    (and counts as a success)."""
    call = client(generation_pb2_grpc.GenerationStub, addr).Generate(req, timeout=timeout)
    tokens: list[int] = []
    try:
        for i, resp in enumerate(call):
            tokens += resp.token_ids
            if i + 1 >= max_responses:
                call.cancel()
                break
        return None, "", tokens
    except grpc.RpcError as e:
        return e.code(), e.details() or "", tokens


def greedy_request(rid: str = "", prompt=NORMAL_PROMPT, n: int = NORMAL_TOKENS) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True)
    return generation_pb2.GenerateRequest(rid=rid, prompt=token_prompt(prompt), sampling=sampling)


def pd_call(f: Fleet, rid: str, room: int, prompt, sampling, max_responses: int = MAX_RESPONSES):
    """What the router does: D.Generate with a route to P, and P.Prefill beside it.
    Returns (D's code, D's details, tokens, P's response or RpcError or None if cancelled)."""
    preq = prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=prompt, sampling=sampling)
    pcall = client(prefill_pb2_grpc.PrefillStub, f.p.address).Prefill.future(preq, timeout=CALL_S)
    route = signed_route(room, f.p.address)
    dreq = generation_pb2.GenerateRequest(rid=rid, prompt=prompt, sampling=sampling, prefill=route)
    code, details, tokens = generate(f.d.address, dreq, max_responses)
    try:
        presult = pcall.result(timeout=CALL_S)
    except grpc.FutureCancelledError:
        presult = None
    except grpc.RpcError as e:
        presult = e
    return code, details, tokens, presult


def http_request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body bytes) on a fresh connection; raises on a dropped connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CALL_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def completion_text(port: int, prompt, n: int) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0}).encode()
    status, _, data = http_request(port, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 200, data
    return json.loads(data)["choices"][0]["text"]


def normal_outputs(f: Fleet) -> dict:
    """A normal greedy request on every path: colocated, P+D directly, the router (twice: both of its
    choices), and the router's HTTP front."""
    out = {}
    code, details, out["colocated"] = generate(f.c.address, greedy_request(), max_responses=100)
    assert code is None, details
    route_rid, room = secrets.token_hex(8), secrets.randbits(62) + 1
    sampling = greedy_request().sampling
    code, details, out["p+d"], presult = pd_call(f, route_rid, room, token_prompt(NORMAL_PROMPT), sampling, 100)
    assert code is None and isinstance(presult, prefill_pb2.PrefillResponse), (details, presult)
    for i in range(2):
        code, details, out[f"router-{i}"] = generate(f.router_addr, greedy_request(), max_responses=100)
        assert code is None, details
    out["http"] = completion_text(f.router.http_port, NORMAL_PROMPT, NORMAL_TOKENS)
    return out


def status(addr: str) -> admin_pb2.Status:
    return client(admin_pb2_grpc.AdminStub, addr).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)


def assert_fleet_healthy(f: Fleet, group: str) -> None:
    """Every rank alive, every node idle and not draining, nothing left over anywhere, and the same
    tokens as at the start on every path."""
    for node in f.nodes:
        assert not node.dead and not node.node.ranks.dead_ranks(), f"{group}: a rank of the {node.role} node died"
    deadline = time.monotonic() + 20
    for node in (*f.nodes, None):
        addr = node.address if node is not None else f.router_addr
        while True:
            st = status(addr)
            busy = [r.kv_pages_used for r in st.ranks if r.kv_pages_used] or st.requests_in_flight
            busy = busy or st.transfers_in_flight or (node is None and any(n.outstanding for n in st.nodes))
            if not busy:
                break
            assert time.monotonic() < deadline, f"{group}: {st.role} is not idle: {st}"
            time.sleep(0.05)
        assert not st.draining, f"{group}: {st.role} still draining"
    assert [(n.role, n.address) for n in f.router.pool.nodes] == [
        ("colocated", f.c.address),
        ("prefill", f.p.address),
        ("decode", f.d.address),
    ], f"{group}: the router's fleet changed"
    assert f.d.generation.pending == {}, f"{group}: the decode node still holds registrations {f.d.generation.pending}"
    again = normal_outputs(f)
    assert again == f.baseline, f"{group}: a normal request changed: {again} != {f.baseline}"


def report(group: str, f: Fleet) -> None:
    assert_fleet_healthy(f, group)
    n, ok = TRIED[group], SERVED[group]
    print(f"\n[bad-input] {group}: {n} inputs ({ok} served, {n - ok} refused); fleet healthy and idle", flush=True)


# ---------------------------------------------------------------------- generation inputs

F32 = st.floats(width=32)
SPECIAL_FLOATS = [0.0, -0.0, 1.0, 0.5, 2.0, -1.0, 1e-40, 1e-6, 1e-5, 1.5, 3e38, math.nan, math.inf, -math.inf]
TEXT = st.text(max_size=24)
LONG_LENGTHS = [4096, 4097, 10_000, 200_000]  # at and far over the context (4096)


def mostly(valid, *odd):
    """`valid` four times in five, else one of `odd` (edge and bad values): so that a fair share of
    inputs is valid as a whole, and the served path is exercised too."""
    return st.integers(0, 4).flatmap(lambda i: valid if i < 4 else st.one_of(*odd))  # (0 is drawn most)


def fresh_rooms(top: int = 2**62 - 1):
    """Rooms for inputs meant to be served: a number no earlier example used (a room whose request
    was just cancelled may still be held on the node: its next user would rightly get
    ALREADY_EXISTS), or the top of the range, or 0 (invalid)."""
    return mostly(st.builds(lambda: next(_ROOMS)), st.builds(lambda: top - next(_ROOMS) % 1024), st.just(0))


_ROOMS = itertools.count(secrets.randbits(40) + 1024)


def _runs(lengths: list[int], max_size: int):
    """Lists of strings each one character repeated a given number of times (near the size limits)."""
    run = st.builds(lambda n, ch: ch * n, st.sampled_from(lengths), st.sampled_from(["s", "é", " x", "😀"]))
    return st.lists(run, min_size=1, max_size=max_size)


def _ids(counts: list[int], top: int):
    """Lists of exactly one of `counts` ids below `top` (near the count limits)."""
    return st.sampled_from(counts).map(lambda n: [i % top for i in range(n)])


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_new_tokens=draw(mostly(st.integers(0, 8), st.just(2**32 - 1), st.integers(0, 2**32 - 1))),
        temperature=draw(
            mostly(st.sampled_from([0.0, 0.0, 0.7, 1.0]) | st.floats(1e-5, 2), st.sampled_from(SPECIAL_FLOATS), F32)
        ),
        top_p=draw(mostly(st.sampled_from([0.0, 1.0, 0.9]) | st.floats(1e-3, 1), st.sampled_from(SPECIAL_FLOATS), F32)),
        top_k=draw(
            mostly(st.sampled_from([0, 1, 5, 50]), st.sampled_from([VOCAB, 2**32 - 1]), st.integers(0, 2**32 - 1))
        ),
        stop=draw(
            mostly(
                st.lists(st.text(min_size=1, max_size=5), max_size=3),
                st.lists(st.one_of(st.just(""), TEXT), max_size=3),
                st.lists(st.text(min_size=1, max_size=2), min_size=17, max_size=20),
                _runs([1023, 1024, 1025], 5),  # one string's limit (1024), all strings' (4096)
            )
        ),
        stop_token_ids=draw(
            mostly(
                st.lists(st.integers(0, VOCAB - 1), max_size=3),
                st.lists(st.integers(0, 2**32 - 1)),
                _ids([1024, 1025], 2**32 - 1),
            )
        ),
        ignore_eos=draw(st.booleans()),
        bad_words=draw(
            mostly(
                st.just([]) | st.lists(st.text(min_size=1, max_size=6), max_size=3),
                st.lists(st.sampled_from([" ", "\t", "ok"]), min_size=1, max_size=2),  # (blank words)
                _runs([128, 129], 17),  # one word's limit (128), all words' (2048)
                st.sampled_from([128, 129]).map(lambda n: [f"w{i}" for i in range(n)]),
            )
        ),
        allowed_token_ids=draw(
            mostly(
                st.just([]) | st.lists(st.integers(0, VOCAB - 1), max_size=5),
                st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3),
                _ids([65536, 65537], VOCAB),
            )
        ),
    )
    bias = mostly(
        st.just({}) | st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, -1.5, 0.0, 3.0, 100.0])),
        st.dictionaries(st.integers(0, 2**32 - 1), st.sampled_from([101.0, -1e9, math.nan, 1.0]), min_size=1),
        st.sampled_from([1024, 1025]).map(lambda n: {i: 1.0 for i in range(n)}),
    )
    msg.logit_bias.update(draw(bias))
    seed = draw(st.one_of(st.none(), st.sampled_from([0, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1)))
    if seed is not None:
        msg.seed = seed
    return msg


ROLES = mostly(st.sampled_from(["system", "user", "assistant"]), st.sampled_from(["", "robot", "USER"]), TEXT)


@st.composite
def prompts(draw) -> common_pb2.Prompt:
    kind = draw(mostly(st.sampled_from(["text", "ids", "chat"]), st.sampled_from(["none", "long_text", "long_ids"])))
    if kind == "none":
        return common_pb2.Prompt()
    if kind == "text":
        return common_pb2.Prompt(text=draw(mostly(st.text(min_size=1, max_size=64), st.just(""))))
    if kind == "long_text":
        return common_pb2.Prompt(text="a" * draw(st.sampled_from(LONG_LENGTHS)))
    if kind == "ids":
        ids = mostly(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB, 2**31, 2**32 - 1]))
        return token_prompt(draw(mostly(st.lists(ids, min_size=1, max_size=24), st.just([]))))
    if kind == "long_ids":
        return token_prompt([7] * draw(st.sampled_from(LONG_LENGTHS)))
    messages = draw(mostly(st.lists(st.tuples(ROLES, st.text(max_size=32)), min_size=1, max_size=3), st.just([])))
    chat = [common_pb2.ChatMessage(role=r, content=c) for r, c in messages]
    return common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=chat))


@dataclass
class Expect:
    """The outcome an input must have: success when no problem, else one of the codes, with a
    message that holds one of the hints (each problem's field, or its value)."""

    problems: list[tuple[grpc.StatusCode, str]] = field(default_factory=list)
    maybe_ok: bool = False  # success is fine too (when the outcome depends on timing or on earlier inputs)

    def add(self, code: grpc.StatusCode, hint: str) -> None:
        self.problems.append((code, hint))

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self, where: str, code, details: str) -> None:
        assert code not in NEVER, f"{where}: {code} {details!r}"
        if code is None:
            served()
        if self.ok:
            assert code is None, f"{where}: a valid input failed: {code} {details!r}"
            return
        if code is None and self.maybe_ok:
            return
        assert code is not None, f"{where}: expected one of {self.problems}, it succeeded"
        hints = [h for c, h in self.problems if c == code]
        assert hints, f"{where}: {code} {details!r}; expected one of {self.problems}"
        assert any(h in details for h in hints), f"{where}: {details!r} names none of {hints}"


def prompt_bytes(prompt: common_pb2.Prompt) -> int:
    if prompt.WhichOneof("kind") == "text":
        return len(prompt.text.encode())
    if prompt.WhichOneof("kind") == "chat":
        return sum(len(m.content.encode()) + len(m.role.encode()) for m in prompt.chat.messages)
    return 0


def prompt_length(f: Fleet, prompt: common_pb2.Prompt) -> int | None:
    kind = prompt.WhichOneof("kind")
    if kind == "text":
        return len(f.tokenizer.encode(prompt.text))
    if kind == "token_ids":
        return len(prompt.token_ids.ids)
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
        return len(f.tokenizer.encode(f.tokenizer.apply_chat_template(messages)))
    return None


def node_expect(f: Fleet, prompt: common_pb2.Prompt, s: common_pb2.SamplingParams, e: Expect | None = None) -> Expect:
    """What a node (colocated, prefill, decode) must say about a prompt and sampling params."""
    e = e or Expect()
    bad = C.INVALID_ARGUMENT
    kind = prompt.WhichOneof("kind")
    if kind is None:
        e.add(bad, "prompt")
    elif kind == "chat" and not prompt.chat.messages:
        e.add(bad, "no messages")
    elif kind == "chat" and any(m.role not in ("system", "user", "assistant") for m in prompt.chat.messages):
        e.add(bad, "role")
    elif prompt_bytes(prompt) > MAX_CONTEXT * 32:  # refused before it is tokenized
        e.add(bad, "bytes; a prompt that fits the context")
    else:
        n = prompt_length(f, prompt)
        if n == 0:
            e.add(bad, "prompt")
        elif n >= MAX_CONTEXT:
            e.add(bad, f"{n} tokens")
        oov = [t for t in prompt.token_ids.ids if t >= VOCAB] if kind == "token_ids" else []
        if oov:
            e.add(bad, f"token id {oov[0]}")
    for name, ids in (("allowed_token_ids", s.allowed_token_ids), ("logit_bias", s.logit_bias)):
        if any(t >= VOCAB for t in ids):  # (what the router cannot know: the node's vocabulary)
            e.add(bad, f"sampling.{name} holds token id")
    sampling_expect(s, e)
    return e


def sampling_expect(s: common_pb2.SamplingParams, e: Expect) -> Expect:
    """What the router and every node say about sampling params (the same rules: common/sampling.py)."""
    bad = C.INVALID_ARGUMENT
    t, p = s.temperature, s.top_p or 1.0
    if not t >= 0 or (t > 0 and not 1e-5 <= t < math.inf):
        e.add(bad, "temperature")
    if not 0 < p <= 1:
        e.add(bad, "top_p")
    if len(s.stop) > 16:
        e.add(bad, "stop has")
    if "" in s.stop or any(len(t) > 1024 for t in s.stop):
        e.add(bad, "stop[")
    if sum(map(len, s.stop)) > 4096:
        e.add(bad, "stop: total length")
    if len(s.stop_token_ids) > 1024:
        e.add(bad, "stop_token_ids has")
    if len(s.bad_words) > 128:
        e.add(bad, "bad_words has")
    if any(len(w) > 128 for w in s.bad_words):
        e.add(bad, "bad_words[")
    if sum(map(len, s.bad_words)) > 2048:
        e.add(bad, "bad_words: total length")
    if any(not w.strip() for w in s.bad_words):
        e.add(bad, "bad_words holds an empty word")
    if len(s.logit_bias) > 1024:
        e.add(bad, "logit_bias has")
    if any(not -100 <= b <= 100 for b in s.logit_bias.values()):
        e.add(bad, "logit_bias[")
    if len(s.allowed_token_ids) > 65536:
        e.add(bad, "allowed_token_ids has")
    return e


def router_checks(rid: str, prompt: common_pb2.Prompt, s: common_pb2.SamplingParams) -> Expect:
    """What the router itself refuses, before any node sees the request."""
    e = Expect()
    bad = C.INVALID_ARGUMENT
    if rid and (len(rid) > 128 or not all(ch in string.ascii_letters + string.digits + "._:-" for ch in rid)):
        e.add(bad, "rid")
    kind = prompt.WhichOneof("kind")
    if kind is None or (kind == "text" and not prompt.text) or (kind == "token_ids" and not prompt.token_ids.ids):
        e.add(bad, "is empty")
    sampling_expect(s, e)
    if kind == "chat" and not prompt.chat.messages:
        e.add(bad, "no messages")
    if kind == "chat" and any(m.role not in ("system", "user", "assistant") for m in prompt.chat.messages):
        e.add(bad, "role")
    return e


def node_rid_checks(rid: str, e: Expect) -> Expect:
    """What every node's front refuses of a rid (common/limits.py), before anything else of the request."""
    if rid and (len(rid) > 160 or not all(ch in string.ascii_letters + string.digits + "._:-" for ch in rid)):
        e.add(C.INVALID_ARGUMENT, "rid must be 1..160 characters")
    return e


_unique = iter(range(10**9))


def unique(rid: str) -> str:
    """A generated rid made unique (requests of earlier examples may still be ending)."""
    return f"{rid}-{next(_unique)}" if rid else ""


class Holder:
    """A request in flight under a given rid (for duplicate-rid inputs), until release()."""

    def __init__(self, addr: str, req: generation_pb2.GenerateRequest, list_at: str | None = None):
        self.call = client(generation_pb2_grpc.GenerationStub, addr).Generate(req, timeout=CALL_S)
        if list_at is None:
            next(self.call)  # its first token: it is in flight
            return
        admin = client(admin_pb2_grpc.AdminStub, list_at)
        deadline = time.monotonic() + 10
        while req.rid not in [r.rid for r in admin.ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests]:
            assert time.monotonic() < deadline, f"{req.rid} never showed up on {list_at}"
            time.sleep(0.01)

    def release(self) -> None:
        self.call.cancel()


def holder_request(rid: str) -> generation_pb2.GenerateRequest:
    return greedy_request(rid, [1, 2, 3], n=4000)


RIDS = mostly(
    st.just("") | st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
    TEXT,
    st.sampled_from(["r" * 129, "x" * 5000]),
)
DUPLICATE = st.integers(0, 4).map(lambda i: i == 4)  # one input in five reuses the rid of a request in flight


def overlap_of(prefill_rank, decode_rank) -> tuple[int, int] | None:
    lo, hi = max(prefill_rank.layer_start, decode_rank.layer_start), min(prefill_rank.layer_end, decode_rank.layer_end)
    return (lo, hi) if lo < hi else None


def drain_stream(call) -> tuple[list[int], grpc.RpcError | None]:
    tokens = []
    try:
        for resp in call:
            tokens += resp.token_ids
        return tokens, None
    except grpc.RpcError as e:
        return tokens, e


def raw_http(port: int, data: bytes) -> bytes:
    """Send raw bytes; the first answer (read until its declared body is in, or the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=CALL_S) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
            head, sep, body = out.partition(b"\r\n\r\n")
            length = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
            if sep and length and len(body) >= (n := int(length[0].split(b":")[1])):
                return head + sep + body[:n]  # the first answer only


def parse_raw(out: bytes) -> tuple[int, dict, bytes]:
    if not out.startswith(b"HTTP/"):  # no status line at all (an HTTP/0.9-style answer)
        return 0, {}, out
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body
