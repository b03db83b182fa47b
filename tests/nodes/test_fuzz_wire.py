"""The decoders of what crosses between processes without a gRPC schema, fuzzed: the inter-rank
pipeline message (pipeline/log.py Message.decode: JSON from rank 0 to ranks 1..P-1), the
consensus round (consensus/codec.py RoundMsg.decode) and KV layouts (kv_transfer/adapters.py
layout_from_proto, the one checked conversion the Bootstrap service, the decode node and the
prefill ranks use). Inputs: arbitrary bytes, arbitrary JSON, valid
messages with one part replaced by arbitrary JSON, and valid encodings with bytes flipped,
inserted, deleted or cut. Each decoder returns a value that re-encodes to what it decodes to, or
raises ValueError: never another exception.

The other words between ranks are not parsed: a Link's and the control ring's int64 length
prefixes (pipeline/dist.py, control.py) and the nudge word (any value but NUDGE_CLOSE wakes rank 0).
"""

from __future__ import annotations

import collections
import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbridge.common.sampling import MIN_TEMPERATURE, SamplingParams
from kvbridge.consensus.codec import RoundMsg, Tally
from kvbridge.consensus.types import Ruling, Stream, Verdict
from kvbridge.engine.batch import ForwardBatch
from kvbridge.kv_transfer import adapters as kv_wire
from kvbridge.kv_transfer.backends import cuda_ipc
from kvbridge.kv_transfer.handoff import Destination, Registration
from kvbridge.kv_transfer.layout import DTYPES, Endpoint, NodeLayout, PageGeometry, RankInfo, incompatibility
from kvbridge.kv_transfer.rooms import Source
from kvbridge.pipeline import codec
from kvbridge.pipeline.log import (
    ADMIT,
    APPEND,
    CONTROL,
    KINDS,
    RESUME,
    RETRACT,
    REUSE,
    ROUTE,
    SHUTDOWN,
    STEP,
    SWITCH,
    Admitted,
    Appended,
    LogEntry,
    Message,
    Pages,
    Switched,
)
from kvbridge.v1 import prefill_pb2
from tests.nodes.fuzz_fleet import SCALES, say, summary

# default examples per test (x SLOW_SCALE under -m slow)
PP_ROUND_TRIP, PP_BYTES, PP_JSON, PP_PARTS, PP_MUTATED = 300, 500, 500, 800, 800
ROUND_MUTATED, LAYOUTS = 600, 600

TRIED: collections.Counter = collections.Counter()  # inputs decoded, per decoder
SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module", autouse=True)
def counts(request):
    yield
    say(request.config, [line.replace("[bad-input]", "[wire]") for line in summary(TRIED)])


# ---------------------------------------------------------------------- the pipeline message

TEXT = st.text(max_size=12)
JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN and the infinities too: json writes and reads them
    st.text(max_size=8),
)
JSON = st.recursive(
    JSON_LEAF, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4), max_leaves=12
)


@st.composite
def sampling(draw) -> SamplingParams:
    n = draw(st.integers(0, 2**31))
    return SamplingParams(
        max_new_tokens=n,
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0]) | st.floats(MIN_TEMPERATURE, 1e6)),
        top_p=draw(st.sampled_from([1.0, 0.9]) | st.floats(1e-6, 1)),
        top_k=draw(st.integers(0, 2**31)),
        seed=draw(st.none() | st.integers(0, 2**64 - 1)),
        stop=tuple(draw(st.lists(st.text(min_size=1, max_size=5), max_size=3))),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, 2**31), max_size=3))),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.integers(0, n) if n else st.just(0)),
    )


@st.composite
def batches(draw) -> ForwardBatch:
    n = draw(st.integers(1, 4))
    ints = st.lists(st.integers(0, 2**31), min_size=n, max_size=n)
    return ForwardBatch(
        rids=tuple(draw(st.lists(TEXT, min_size=n, max_size=n))),
        starts=tuple(draw(ints)),
        q_lens=tuple(draw(st.lists(st.integers(1, 2**16), min_size=n, max_size=n))),
        page_tables=tuple(
            tuple(t) for t in draw(st.lists(st.lists(st.integers(0, 2**31), max_size=5), min_size=n, max_size=n))
        ),
        input_ids=(),
        sample=tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n))),
    )


IDS = st.lists(st.integers(0, 2**31), max_size=4).map(tuple)
U31 = st.integers(0, 2**31)


IPC_HANDLE = cuda_ipc._pack_bytes(cuda_ipc._FIXED.pack(0, 1 << 20, 0, 0, 0, False), b"h" * 64, b"r", b"e")
ENDPOINT_DATA = {  # well-formed values of each backend's endpoint, and near misses
    "shm": st.sampled_from([b"kvbridge-1-0-ab", b"", b"kvbridge-", b"/etc/passwd", b"kvbridge-a/b"]),
    "torch": st.sampled_from(
        [b"127.0.0.1:2 " + b"ab" * 16, b"127.0.0.1:2", b"h:0 " + b"0" * 32, b"h:1 AB" + b"0" * 30]
    ),
    "cuda_ipc": st.sampled_from([IPC_HANDLE, IPC_HANDLE[:-1], b"\x00\xff", b""]),
    "grpc": st.sampled_from([b""]),
    "nixl": st.sampled_from([b"", b"agent-1"]),  # a backend this node does not know: dropped
}
SHM_NAME = re.compile(r"^kvbridge-[A-Za-z0-9_.-]{1,200}$")
TORCH_ENDPOINT = re.compile(r"^[^ ]+:([0-9]+) [0-9a-f]{32}$")


def endpoint_ok(name: str, data: bytes) -> bool:
    """The endpoint contract, written out here (proto/kvbridge/v1/prefill.proto RankEndpoint)."""
    text = data.decode("ascii", "replace")
    if name == "shm":
        return bool(SHM_NAME.match(text))
    if name == "torch":
        m = TORCH_ENDPOINT.match(text)
        return bool(m) and 0 < int(m.group(1)) < 65536
    if name == "cuda_ipc":
        return data == IPC_HANDLE
    return True


@st.composite
def rank_endpoints(draw) -> dict[str, bytes]:
    names = draw(st.lists(st.sampled_from(sorted(ENDPOINT_DATA)) | TEXT, max_size=4, unique=True))
    return {n: draw(ENDPOINT_DATA.get(n, st.binary(max_size=8))) for n in names}


@st.composite
def node_layouts(draw) -> NodeLayout:
    """A layout as the Bootstrap service admits one (ranks tiling the layers)."""
    cuts = sorted(set(draw(st.lists(st.integers(1, 63), max_size=3))))
    bounds = [0, *cuts, 64]
    ranks = tuple(
        RankInfo(i, lo, hi, draw(TEXT), tuple(Endpoint(n, d) for n, d in draw(rank_endpoints()).items()))
        for i, (lo, hi) in enumerate(itertools.pairwise(bounds))
    )
    geometry = PageGeometry(draw(U31), draw(U31), draw(U31), draw(st.sampled_from(sorted(DTYPES))))
    backends = tuple(draw(st.lists(TEXT, max_size=3)))
    return NodeLayout(geometry, 64, draw(U31), ranks, draw(TEXT), backends, draw(TEXT))


@st.composite
def records(draw, kind: str):
    """The record a `kind` entry carries (pipeline/log.py RECORDS)."""
    if kind == ADMIT:
        sources = tuple(Source(draw(U31), draw(U31), draw(U31)) for _ in range(draw(st.integers(0, 2))))
        to = Destination(draw(U31), draw(IDS), draw(U31), sources, draw(TEXT), draw(st.binary(max_size=16)))
        return Admitted(draw(U31), draw(IDS), draw(U31), draw(st.none() | st.just(to)))
    if kind == ROUTE:
        secret, layout = draw(st.binary(max_size=16)), draw(node_layouts())
        return Registration(draw(U31), secret, draw(TEXT), draw(IDS), draw(U31), layout, draw(TEXT))
    if kind in (RETRACT, RESUME, REUSE):
        return Pages(draw(IDS))
    if kind == APPEND:
        return Appended(draw(IDS))
    if kind == SWITCH:
        return Switched(draw(TEXT), draw(U31))
    return None


@st.composite
def messages(draw) -> Message:
    kind = draw(st.sampled_from([STEP, STEP, CONTROL, SHUTDOWN]))
    first = draw(st.integers(0, 2**63))
    decisions = []
    for i in range(draw(st.integers(0, 4))):
        d_kind = draw(st.sampled_from(KINDS))
        params = draw(sampling()) if d_kind == ADMIT else None
        decisions.append(LogEntry(first + i, d_kind, draw(TEXT), params, draw(records(d_kind))))
    return Message(kind, tuple(decisions), draw(batches()) if kind == STEP else None)


def decoded_or_refused(data) -> Message | None:
    """Message.decode(data), which must raise ValueError or give a message that round-trips."""
    TRIED["pp message"] += 1
    try:
        msg = Message.decode(data)
    except ValueError:
        return None
    again = msg.encode()
    back = Message.decode(again)
    assert back.encode() == again, (data[:300], again[:300])
    assert back == msg or "NaN" in again.decode(), (msg, back)  # (NaN != NaN: the bytes are compared instead)
    return msg


@SCALES
def test_a_pipeline_message_round_trips(scale):
    @settings(max_examples=PP_ROUND_TRIP * scale, **SETTINGS)
    @given(messages())
    def one(msg):
        TRIED["pp message"] += 1
        assert Message.decode(msg.encode()) == msg

    one()


@SCALES
def test_arbitrary_bytes_are_a_pipeline_message_or_refused(scale):
    @settings(max_examples=PP_BYTES * scale, **SETTINGS)
    @given(st.binary(max_size=200) | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))
    @example(b"[" * 5_000)  # json.loads: RecursionError
    @example(b'{"kind":"step","decisions":[[Infinity,"admit","r",null,null]],"batch":null}')  # int(inf): OverflowError
    @example(b'{"kind":"control","decisions":[[1e400,"finish","r",null,null]],"batch":null}')
    @example(b'{"kind":"control","decisions":[[NaN,"finish","r",null,null]],"batch":null}')
    @example(b'{"kind":"control","decisions":[["9' + b"9" * 5000 + b'","finish","r",null,null]],"batch":null}')
    @example(b"\xff\xfe{\x00}\x00")  # utf-16, as json.loads detects it
    def one(data):
        decoded_or_refused(data)

    one()


@SCALES
def test_arbitrary_json_is_a_pipeline_message_or_refused(scale):
    @settings(max_examples=PP_JSON * scale, **SETTINGS)
    @given(JSON | st.dictionaries(st.sampled_from(["kind", "decisions", "batch", "x"]), JSON, min_size=1))
    def one(value):
        decoded_or_refused(json.dumps(value).encode())

    one()


def _parts(value, path=()):
    """Every (path, value) in a JSON value, the whole of it first."""
    yield path, value
    if isinstance(value, list):
        for i, v in enumerate(value):
            yield from _parts(v, (*path, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _parts(v, (*path, k))


def _replaced(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, list):
        return [_replaced(v, rest, new) if i == head else v for i, v in enumerate(value)]
    return {k: _replaced(v, rest, new) if k == head else v for k, v in value.items()}


@SCALES
def test_a_pipeline_message_with_parts_replaced_is_one_or_refused(scale):
    """A valid message's JSON with one to three parts (a field, a list entry, a whole list)
    replaced by arbitrary JSON, deleted or duplicated."""

    @settings(max_examples=PP_PARTS * scale, **SETTINGS)
    @given(messages(), st.data())
    def one(msg, data):
        value = json.loads(msg.encode())
        for _ in range(data.draw(st.integers(1, 3))):
            paths = [p for p, _ in _parts(value)]
            path = data.draw(st.sampled_from(paths))
            how = data.draw(st.sampled_from(["replace", "replace", "delete", "duplicate"]))
            if how == "replace" or not path:
                value = _replaced(value, path, data.draw(JSON))
                continue
            parent_path, key = path[:-1], path[-1]
            parent = dict(_parts(value))[parent_path]
            if isinstance(parent, list):
                new = parent[:key] + parent[key + 1 :] if how == "delete" else [*parent, parent[key]]
            else:
                new = {k: v for k, v in parent.items() if k != key} if how == "delete" else {**parent, "x": parent[key]}
            value = _replaced(value, parent_path, new)
        decoded_or_refused(json.dumps(value).encode())

    one()


@st.composite
def mutated(draw, encoded: bytes) -> bytes:
    """`encoded` with one to four bytes flipped, inserted or deleted, or cut short."""
    raw = bytearray(encoded)
    if draw(st.integers(0, 4)) == 0:
        return bytes(raw[: draw(st.integers(0, max(len(raw) - 1, 0)))])
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        how = draw(st.sampled_from(["flip", "flip", "insert", "delete"]))
        byte = draw(st.integers(0, 255) | st.sampled_from(list(b'[]{}",:-.0123456789eEnNtf\\')))
        if how == "flip" and raw:
            raw[at] = byte
        elif how == "insert":
            raw.insert(at, byte)
        elif raw:
            del raw[at]
    return bytes(raw)


@SCALES
def test_a_mutated_pipeline_message_is_one_or_refused(scale):
    @settings(max_examples=PP_MUTATED * scale, **SETTINGS)
    @given(messages().flatmap(lambda m: mutated(m.encode())))
    def one(data):
        decoded_or_refused(data)

    one()


# ---------------------------------------------------------------------- the consensus round

RIDS = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def rounds(draw) -> RoundMsg:
    first = draw(st.integers(0, 2**40))
    decisions = []
    for i in range(draw(st.integers(0, 4))):
        verdict = draw(st.sampled_from(Verdict))
        stream = None if verdict == Verdict.ABORTED else draw(st.sampled_from(Stream))
        decisions.append(Ruling(first + i, stream, draw(RIDS), verdict))
    tallies = []
    for _ in Stream:
        ready = draw(st.frozensets(RIDS, max_size=3))
        tallies.append(Tally(ready, draw(st.frozensets(RIDS, max_size=3)) - ready))
    return RoundMsg(
        draw(st.integers(0, 2**64 - 1)), draw(st.integers(1, 0xFFFF)), first, tuple(decisions), tuple(tallies)
    )


@SCALES
def test_a_mutated_consensus_round_is_refused_or_canonical(scale):
    """Any round message, mutated (tests/consensus/test_consensus_wire.py mutates one fixed message)."""

    @settings(max_examples=ROUND_MUTATED * scale, **SETTINGS)
    @given(rounds().flatmap(lambda m: mutated(m.encode())))
    def one(data):
        TRIED["consensus round"] += 1
        try:
            msg = RoundMsg.decode(data)
        except ValueError:
            return
        assert msg.encode() == data

    one()


# ---------------------------------------------------------------------- KV layouts

U32 = st.integers(0, 2**32 - 1)


@st.composite
def endpoints(draw, i: int, start: int, tiled: bool) -> prefill_pb2.RankEndpoint:
    end = start + draw(st.integers(1, 4))
    if not tiled:
        i, start, end = draw(st.integers(0, 4)), draw(st.integers(0, 8)), draw(st.integers(0, 8))
    return prefill_pb2.RankEndpoint(
        rank=i,
        layer_start=start,
        layer_end=end,
        receiver_addr=draw(st.sampled_from(["", "127.0.0.1:1"]) | TEXT),
        endpoints=draw(rank_endpoints()),
    )


@st.composite
def kv_layouts(draw) -> prefill_pb2.KVLayout:
    """Mostly well-formed layouts (ranks tiling the layers), some with a field or rank broken;
    or whatever protobuf parses out of arbitrary bytes."""
    if draw(st.integers(0, 5)) == 0:
        m = prefill_pb2.KVLayout()
        try:
            m.ParseFromString(draw(st.binary(max_size=80)))
        except Exception:  # (protobuf's DecodeError: not a layout at all)
            m.Clear()
        m.DiscardUnknownFields()  # (kept by the parser, never re-encoded by us)
        return m
    ranks, start = [], 0
    for i in range(draw(st.integers(0, 4))):
        ranks.append(draw(endpoints(i, start, tiled=draw(st.integers(0, 5)) > 0)))
        start = ranks[-1].layer_end
    return prefill_pb2.KVLayout(
        model_fingerprint=draw(TEXT),
        num_layers=draw(st.just(start) | U32),
        page_size=draw(st.sampled_from([16, 1]) | U32),
        dtype=draw(st.sampled_from([*DTYPES, "int8", ""]) | TEXT),
        num_kv_heads=draw(st.sampled_from([1, 4]) | U32),
        head_dim=draw(st.sampled_from([64, 8]) | U32),
        num_pages=draw(st.sampled_from([1024, 1]) | U32),
        ranks=ranks,
        backends=draw(st.lists(st.sampled_from(["grpc", "shm", "torch", "cuda_ipc"]) | TEXT, max_size=3)),
        host_id=draw(TEXT),
    )


def is_valid(m: prefill_pb2.KVLayout) -> bool:
    """The layout contract (proto/kvbridge/v1/prefill.proto, kv_transfer/adapters.py)."""
    start, tiled = 0, bool(m.ranks)
    for i, r in enumerate(m.ranks):
        tiled = tiled and r.rank == i and r.layer_start == start and r.layer_end > r.layer_start
        start = r.layer_end
    known = {"shm", "torch", "cuda_ipc", "grpc"}  # (registered here; others are dropped unread)
    handles = all(endpoint_ok(n, d) for r in m.ranks for n, d in r.endpoints.items() if n in known)
    sizes = m.page_size and m.num_pages and m.num_kv_heads and m.head_dim
    return bool(tiled and start == m.num_layers and sizes and m.dtype in DTYPES and handles)


@SCALES
def test_a_kv_layout_is_decoded_or_refused(scale):
    @settings(max_examples=LAYOUTS * scale, **SETTINGS)
    @given(kv_layouts())
    def one(m):
        TRIED["kv layout"] += 1
        valid = is_valid(m)
        try:
            layout = kv_wire.layout_from_proto(m)
        except ValueError:
            assert not valid, m
            return
        assert valid, f"accepted a layout that breaks the contract: {m}"
        expected = prefill_pb2.KVLayout()
        expected.CopyFrom(m)
        for r in expected.ranks:  # a backend this node does not know is dropped
            for name in [n for n in r.endpoints if n not in {"shm", "torch", "cuda_ipc", "grpc"}]:
                del r.endpoints[name]
        assert kv_wire.layout_to_proto(layout) == expected
        assert layout.layer_ranges[0][0] == 0 and layout.layer_ranges[-1][1] == layout.num_layers
        assert layout.geometry.layer_block_bytes > 0 and incompatibility(layout, layout) == ""
        assert codec.from_json(NodeLayout, codec.to_json(layout)) == layout  # (as a ROUTE entry carries it)

    one()
