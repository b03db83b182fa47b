"""The prefill node's Prefill and Bootstrap services and the decode ranks' KVReceivers fuzzed,
on the shared fleet of tests/nodes/fuzz_fleet.py, node-direct: Prefill with any prompt, sampling params,
rid and room (paired with a decode node or left waiting), Register with a decode layout broken in up
to three fields (`MUTATIONS`) and any write key, GetLayout; and WritePages, TransferDone and
FirstToken to each decode rank for a room held open by this test (playing the prefill node,
`FakePrefill`), with rooms, write keys (a forged one is PERMISSION_DENIED and fails nothing), source
ranks, layer ranges, page ids and byte counts broken. Each input gets the status its checks expect;
after each test the fleet is healthy and idle (`report`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.kv_transfer import adapters as kv_wire
from kvbridge.v1 import (
    generation_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.nodes.fuzz_fleet import (
    CALL_S,
    SCALES,
    SETTINGS,
    TEXT,
    VOCAB,
    WAIT_S,
    C,
    Expect,
    Fleet,
    client,
    drain_stream,
    fleet_fixture,
    fresh_rooms,
    greedy_request,
    mostly,
    node_expect,
    node_rid_checks,
    overlap_of,
    pd_call,
    prompt_length,
    prompts,
    report,
    sampling_params,
    tried,
    unique,
)
from tests.pd import fleet_signed, signed_route

fleet = fleet_fixture()

PREFILL_BOOTSTRAP, KV_RECEIVER = 280, 200  # default examples per test (x SLOW_SCALE under -m slow)

REGISTER_ROOMS = mostly(st.integers(2**62, 2**64 - 1), st.just(0))  # apart from Prefill rooms (< 2**62)
REGISTERED: set[int] = set()  # rooms registered without a Prefill call (a second Register: ALREADY_EXISTS)


def mutate_layout(draw, layout: prefill_pb2.KVLayout) -> prefill_pb2.KVLayout:
    """A decode layout with up to three fields broken."""
    out = prefill_pb2.KVLayout()
    out.CopyFrom(layout)
    for what in draw(
        mostly(st.just([]), st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3, unique=True))
    ):
        MUTATIONS[what](draw, out)
    return out


ENDPOINTS = {  # (backend, endpoint data) -> whether that backend accepts it from a peer
    ("shm", b"kvbridge-1-0-ab"): True,
    ("shm", b"/etc/passwd"): False,
    ("shm", b""): False,
    ("torch", b"127.0.0.1:1 " + b"0f" * 16): True,
    ("torch", b"127.0.0.1:1"): False,
    ("cuda_ipc", b"\x00\xff"): False,
    ("grpc", b""): True,
    ("nixl", b"zz"): True,  # unknown to the node: dropped, not refused
}


def layout_expect(m: prefill_pb2.KVLayout, prefill: prefill_pb2.KVLayout) -> Expect:
    """The layout contract (proto/kvbridge/v1/prefill.proto): ranks listed from 0 whose layer ranges
    tile [0, num_layers), positive sizes, a known dtype (INVALID_ARGUMENT otherwise); then the same
    model, page geometry and layer count as the prefill node (FAILED_PRECONDITION otherwise)."""
    start, tiled = 0, bool(m.ranks)
    for i, r in enumerate(m.ranks):
        tiled = tiled and r.rank == i and r.layer_start == start and r.layer_end > r.layer_start
        start = r.layer_end
    hex_ok = all(ENDPOINTS.get((n, d), True) for r in m.ranks for n, d in r.endpoints.items())
    sizes = m.page_size and m.num_pages and m.num_kv_heads and m.head_dim
    if not (tiled and start == m.num_layers and sizes and m.dtype in ("float32", "float16", "bfloat16") and hex_ok):
        return Expect([(C.INVALID_ARGUMENT, "decode_layout")])
    fields_ = ("model_fingerprint", "num_layers", "page_size", "dtype", "num_kv_heads", "head_dim")
    if any(getattr(m, name) != getattr(prefill, name) for name in fields_):
        return Expect([(C.FAILED_PRECONDITION, "differs")])
    return Expect()


def _layers(draw, m):
    if m.ranks:
        r = m.ranks[draw(st.integers(0, len(m.ranks) - 1))]
        r.layer_start, r.layer_end = draw(st.integers(0, 8)), draw(st.integers(0, 8))


def _rank_ids(draw, m):
    if m.ranks:
        m.ranks[draw(st.integers(0, len(m.ranks) - 1))].rank += draw(st.integers(1, 2**31))


def _rank_count(draw, m):
    if draw(st.booleans()):
        del m.ranks[-1:]
    else:
        m.ranks.add(rank=len(m.ranks), layer_start=m.num_layers, layer_end=m.num_layers + 1)


def _no_ranks(draw, m):
    del m.ranks[:]


def _num_layers(draw, m):
    m.num_layers = draw(st.integers(0, 64))


def _page_size(draw, m):
    m.page_size = draw(st.sampled_from([0, 1, 2, 8, 16, 2**32 - 1]))


def _num_pages(draw, m):
    m.num_pages = draw(st.sampled_from([0, 1, 2**32 - 1]))


def _dtype(draw, m):
    m.dtype = draw(st.one_of(st.sampled_from(["bfloat16", "float16", "float64", "", "int8"]), TEXT))


def _fingerprint(draw, m):
    m.model_fingerprint = draw(TEXT)


def _heads(draw, m):
    if draw(st.booleans()):
        m.num_kv_heads = draw(st.integers(0, 2**32 - 1))
    else:
        m.head_dim = draw(st.integers(0, 2**32 - 1))


def _endpoints(draw, m):
    if m.ranks:
        r = m.ranks[draw(st.integers(0, len(m.ranks) - 1))]
        r.receiver_addr = draw(st.sampled_from(["", "127.0.0.1:1", "nowhere"]))
        name, data = draw(st.sampled_from(sorted(ENDPOINTS)))
        r.endpoints[name] = data


MUTATIONS = {
    "layers": _layers,
    "rank_ids": _rank_ids,
    "rank_count": _rank_count,
    "no_ranks": _no_ranks,
    "num_layers": _num_layers,
    "page_size": _page_size,
    "num_pages": _num_pages,
    "dtype": _dtype,
    "fingerprint": _fingerprint,
    "heads": _heads,
    "endpoints": _endpoints,
}


def prefill_input(f: Fleet, draw) -> None:
    rid = unique(draw(mostly(st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True), st.just(""), TEXT)))
    room = draw(fresh_rooms())
    prompt, sampling = draw(prompts()), draw(sampling_params())
    paired = draw(st.integers(0, 2)) < 2
    tried("prefill+bootstrap")
    e = Expect()
    if not rid or not room:
        e.add(C.INVALID_ARGUMENT, "rid and room are required")
    else:
        e = node_rid_checks(rid, node_expect(f, prompt, sampling))
    if e.ok and paired:  # a decode node registers the room: the prefill completes
        code, details, tokens, presult = pd_call(f, rid, room, prompt, sampling)
        assert code is None and tokens, details
        assert isinstance(presult, prefill_pb2.PrefillResponse) or presult is None, presult
        if presult is not None:
            assert presult.prompt_tokens == prompt_length(f, prompt) and presult.first_token == tokens[0]
        return
    req = prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=prompt, sampling=sampling)
    waits = e.ok
    if waits:  # nobody registers the room: it waits for its decode node until the caller gives up
        e = Expect([(C.DEADLINE_EXCEEDED, "Deadline")])
    try:
        client(prefill_pb2_grpc.PrefillStub, f.p.address).Prefill(req, timeout=WAIT_S if waits else CALL_S)
        code, details = None, ""
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
    e.check(f"Prefill {req}", code, details)


def register_input(f: Fleet, draw) -> None:
    """Register: a (possibly broken) decode layout, backend, room and pages."""
    layout = mutate_layout(draw, kv_wire.layout_to_proto(f.d.node.layout))
    backend = draw(mostly(st.sampled_from(["grpc", "shm", "torch"]), st.sampled_from(["cuda_ipc", "", "pigeon"]), TEXT))
    room = draw(REGISTER_ROOMS)
    out_of_range = st.lists(mostly(st.integers(0, 1023), st.integers(1024, 2**32 - 1)), min_size=1, max_size=6)
    pages = draw(mostly(st.lists(st.integers(0, 1023), min_size=1, max_size=6), st.just([]), out_of_range))
    secret = draw(
        mostly(st.binary(min_size=16, max_size=16), st.sampled_from([b"", b"k" * 15, b"k" * 17]), FORGED_KEYS)
    )
    held = draw(mostly(st.just(0), st.integers(1, 8), st.integers(1025, 2**32 - 1)))  # pages the decode node holds
    req = prefill_pb2.RegisterRequest(
        rid=draw(TEXT),
        room=room,
        backend=backend,
        decode_layout=layout,
        page_ids=pages,
        decode_addr=draw(TEXT),
        held_pages=held,
    )
    req.secret = secret
    signed = draw(mostly(st.just(True), st.just(False)))
    if signed:
        fleet_signed(req)
    else:  # none, or another key's
        req.proof = draw(st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)))
    tried("prefill+bootstrap")
    e = layout_expect(layout, kv_wire.layout_to_proto(f.p.node.layout))
    if not signed:  # checked first: nothing else of it is looked at
        e = Expect([(C.PERMISSION_DENIED, "registration not signed by a fleet member")])
    if e.ok:
        if backend not in ("shm", "torch", "grpc"):
            e.add(C.INVALID_ARGUMENT, f"backend {backend!r}")
        elif len(set(pages)) != len(pages):
            e.add(C.INVALID_ARGUMENT, "page ids repeat")
        elif not room or not (pages or held) or any(q >= layout.num_pages for q in pages):
            e.add(C.INVALID_ARGUMENT, "needs page ids in [0,")
        elif held > layout.num_pages:
            e.add(C.INVALID_ARGUMENT, f"held_pages {held} is more than the decode pool's")
        elif len(secret) != 16:
            e.add(C.INVALID_ARGUMENT, "secret must be 16 bytes")
        elif room in REGISTERED:  # still waiting for its Prefill call, unless it expired meanwhile
            e = Expect([(C.ALREADY_EXISTS, f"room {room} is registered already")], maybe_ok=True)
    try:
        client(prefill_pb2_grpc.BootstrapStub, f.p.address).Register(req, timeout=10)
        code, details = None, ""
        REGISTERED.add(room)
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
    e.check(f"Register {req}", code, details)


@SCALES
def test_prefill_and_bootstrap_on_the_prefill_node(fleet, scale):
    @settings(max_examples=PREFILL_BOOTSTRAP * scale, **SETTINGS)
    @given(data=st.data())
    def one(data):
        op = data.draw(st.sampled_from(["prefill", "prefill", "register", "register", "register", "layout"]))
        if op == "layout":
            tried("prefill+bootstrap")
            nonce = data.draw(st.binary(min_size=16, max_size=64))
            got = client(prefill_pb2_grpc.BootstrapStub, fleet.p.address).GetLayout(
                prefill_pb2.GetLayoutRequest(nonce=nonce), timeout=10
            )
            assert got.layout == kv_wire.layout_to_proto(fleet.p.node.layout)
            assert got.proof == fleet_signed(prefill_pb2.GetLayoutResponse(layout=got.layout), nonce).proof
        elif op == "prefill":
            prefill_input(fleet, data.draw)
        else:
            register_input(fleet, data.draw)

    one()
    report("prefill+bootstrap", fleet)


# ---------------------------------------------------------------------- the decode ranks' KVReceiver


@dataclass
class HeldRoom:
    """A decode request whose prefill side is this test (FakePrefill): its room waits on every
    decode rank for pages that only the test sends."""

    room: int
    reg: prefill_pb2.RegisterRequest
    call: object  # the decode Generate stream
    prompt_len: int


def hold_room(f: Fleet, prompt_len: int) -> HeldRoom:
    room = secrets.randbits(62) + 1
    route = signed_route(room, f.fake.address)
    req = greedy_request(secrets.token_hex(8), list(range(1, prompt_len + 1)), n=4)
    req.prefill.CopyFrom(route)
    call = client(generation_pb2_grpc.GenerationStub, f.d.address).Generate(req, timeout=CALL_S)
    reg = f.fake.registration(room)
    assert reg is not None, "the decode node never registered its room"
    return HeldRoom(room, reg, call, prompt_len)


FORGED_KEYS = st.one_of(st.binary(min_size=16, max_size=16), st.sampled_from([b"", b"\0" * 16]), st.binary(max_size=40))
ACCOUNTING = ("bytes", "never wrote pages", "disagree", "first token says", "second notice", "second first token")


@st.composite
def receiver_messages(draw, f: Fleet, held: HeldRoom):
    """One message to one decode rank: a valid one with some fields broken. Returns
    (decode rank index, kind, message, what it must get)."""
    ranks = held.reg.decode_layout.ranks
    j = draw(st.integers(0, len(ranks) - 1))
    sources = [(pr.rank, ov) for pr in f.p.node.layout.ranks if (ov := overlap_of(pr, ranks[j]))]
    src, (lo, hi) = draw(st.sampled_from(sources))
    geometry = f.d.node.layout.geometry
    block = geometry.layer_block_bytes
    pages = list(held.reg.page_ids)
    kind = draw(st.sampled_from(["write", "write", "done", "first"]))
    room = held.room
    if draw(st.integers(0, 5)) == 5:
        room = draw(st.integers(0, 2**64 - 1).filter(lambda r: r != held.room))
    unknown = Expect([(C.NOT_FOUND, f"room {room} is not expected")])
    secret = held.reg.secret
    if draw(st.integers(0, 5)) == 5:  # a forged write key: refused before anything of the room is looked at
        secret = draw(FORGED_KEYS.filter(lambda k: k != held.reg.secret))
    forged = Expect([(C.PERMISSION_DENIED, "write key")])  # (the room is left as it was)
    bad = C.INVALID_ARGUMENT
    if kind == "first":
        token = draw(st.integers(0, VOCAB - 1))
        prompt_tokens = draw(st.one_of(st.just(held.prompt_len), st.integers(0, 2**32 - 1)))
        msg = kv_transfer_pb2.FirstTokenNotice(room=room, token=token, prompt_tokens=prompt_tokens, secret=secret)
        if j != 0:
            return j, kind, msg, Expect([(C.FAILED_PRECONDITION, "takes no first tokens")])
        if room != held.room:
            return j, kind, msg, unknown
        if secret != held.reg.secret:
            return j, kind, msg, forged
        return j, kind, msg, Expect([(bad, h) for h in ACCOUNTING], maybe_ok=True)
    if draw(st.booleans()):
        src = draw(st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        lo, hi = draw(st.integers(0, 8)), draw(st.integers(0, 8))
    overlap = dict(sources).get(src)
    e = Expect()
    if overlap is None:
        e.add(bad, f"prefill rank {src} is not a source")
    if kind == "done":
        capacity = len(pages) * geometry.page_size
        num_tokens = draw(st.one_of(st.just(held.prompt_len), st.integers(0, 2**32 - 1)))
        nbytes = draw(st.one_of(st.just(len(pages) * max(hi - lo, 0) * block), st.integers(0, 2**64 - 1)))
        error = draw(st.one_of(st.just(""), st.just(""), TEXT))
        msg = kv_transfer_pb2.TransferNotice(
            room=room, src_rank=src, layer_start=lo, layer_end=hi, num_tokens=num_tokens, bytes=nbytes, error=error
        )
        msg.secret = secret
        if room != held.room:
            return j, kind, msg, unknown
        if secret != held.reg.secret:
            return j, kind, msg, forged
        if error:  # the source failed: acknowledged, and the room fails
            return j, kind, msg, Expect()
        if overlap is not None and (lo, hi) != overlap:
            e.add(bad, f"notice for layers [{lo}, {hi})")
        if overlap is not None and not 1 <= num_tokens <= capacity:
            e.add(bad, f"num_tokens {num_tokens}")
        if e.ok:  # a well-formed notice: its accounting may still fail the room, or wait for more bytes
            return j, kind, msg, Expect([(bad, h) for h in ACCOUNTING], maybe_ok=True)
        return j, kind, msg, e
    if overlap is not None and not overlap[0] <= lo < hi <= overlap[1]:
        e.add(bad, f"layers [{lo}, {hi}) are outside")
    which = draw(st.sampled_from(["all", "all", "some", "repeat", "none", "outside", "unregistered"]))
    if which == "none":
        pages = []
        e.add(bad, "a write with no pages")
    elif which == "some":
        pages = draw(st.lists(st.sampled_from(pages), min_size=1, unique=True))
    elif which == "repeat":
        pages = [*pages, pages[0]]
    elif which == "outside":
        pages = [*pages, draw(st.integers(1024, 2**32 - 1))]
        e.add(bad, f"page id {pages[-1]} out of range")
    elif which == "unregistered":
        pages = [*pages, draw(st.integers(0, 1023).filter(lambda q: q not in held.reg.page_ids))]
        e.add(bad, f"page id {pages[-1]} is not registered")
    exact = len(pages) * max(hi - lo, 0) * block
    size = draw(st.one_of(st.just(exact), st.just(exact), st.just(exact + 1), st.integers(0, 3 * block)))
    if size != exact:
        e.add(bad, f"{size} bytes for {len(pages)} pages")
    msg = kv_transfer_pb2.PageChunk(
        room=room, src_rank=src, layer_start=lo, layer_end=hi, page_ids=pages, data=bytes(size), secret=secret
    )
    if room != held.room:
        return j, kind, msg, unknown
    return j, kind, msg, forged if secret != held.reg.secret else e


def send(addr: str, kind: str, msg):
    stub = client(kv_transfer_pb2_grpc.KVReceiverStub, addr)
    try:
        if kind == "write":
            stub.WritePages(iter([msg]), timeout=10)
        elif kind == "done":
            stub.TransferDone(msg, timeout=10)
        else:
            stub.FirstToken(msg, timeout=10)
        return None, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""


@SCALES
def test_kv_receivers_of_the_decode_ranks(fleet, scale):
    @settings(max_examples=KV_RECEIVER * scale, **SETTINGS)
    @given(data=st.data(), prompt_len=st.integers(1, 12), count=st.integers(1, 3))
    def one(data, prompt_len, count):
        held = hold_room(fleet, prompt_len)
        failed = False  # an earlier message failed the room
        try:
            for i in range(count):
                j, kind, msg, e = data.draw(receiver_messages(fleet, held))
                if i == 0:  # (counted once drawn: an example hypothesis gives up on while drawing is no input)
                    tried("kv-receiver")
                code, details = send(held.reg.decode_layout.ranks[j].receiver_addr, kind, msg)
                ours = msg.room == held.room and msg.secret == held.reg.secret
                if failed and msg.room == held.room:  # closed on this rank by now, or forgotten already
                    e.maybe_ok = e.maybe_ok or e.ok
                    e.add(C.FAILED_PRECONDITION, "is already FAILED")
                    e.add(C.NOT_FOUND, "is not expected")
                e.check(f"KVReceiver {kind} to decode rank {j}: {str(msg)[:2000]}", code, details)
                if ours and (code == C.INVALID_ARGUMENT or (kind == "done" and msg.error)):
                    failed = True  # (a forged key fails nothing)
            if failed:  # the decode request fails with the room (it does not hang)
                tokens, error = drain_stream(held.call)
                assert error is not None and error.code() == C.UNAVAILABLE, (tokens, error)
        finally:
            held.call.cancel()

    one()
    report("kv-receiver", fleet)
