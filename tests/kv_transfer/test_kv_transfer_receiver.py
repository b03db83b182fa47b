"""A decode rank's receiver, in this process: gRPC status codes at the boundary, the shared
segment's mode and lifetime (on every exit path), and status changes for the daemon."""

from __future__ import annotations

import asyncio
import os
import queue
import stat
import time
from pathlib import Path

import grpc
import pytest
import torch.multiprocessing as mp

from kvbridge.bench.otlp_sink import OTLPSink
from kvbridge.common import tracing
from kvbridge.common.rpc import make_channel, peer_host
from kvbridge.kv_transfer import KVPoll, KVReceiverEndpoint, ReceiverConfig, Source
from kvbridge.kv_transfer.backends.shm import remove_segments_of
from kvbridge.kv_transfer.layout import Endpoint
from kvbridge.kv_transfer.poll import StatusChange
from kvbridge.kv_transfer.rooms import Notice
from kvbridge.kv_transfer.service import MAX_UNKEYED_STREAMS_PER_PEER, WaitingStreams
from kvbridge.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.relay import Relay

KEY = bytes(range(16))  # the rooms' write key (the decode node mints one per room)

SOURCES = [Source(0, 0, 3), Source(1, 3, 6)]
SHM = Path("/dev/shm")
SHM_ONLY = ("shm",)  # (and grpc, which every rank's KVReceiver serves)


def make_config(rank=1, layers=(2, 4), **kw) -> ReceiverConfig:
    return ReceiverConfig(rank, *layers, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, **kw)


def our_segments() -> set[str]:
    return {p.name for p in SHM.glob(f"kvbridge-{os.getpid()}-*")}


@pytest.fixture
def receiver():
    with KVReceiverEndpoint(make_config(backends=SHM_ONLY)) as r:
        yield r


@pytest.fixture
def stub(receiver):
    channel = make_channel(receiver.endpoint.receiver_addr)
    yield kv_transfer_pb2_grpc.KVReceiverStub(channel)
    channel.close()


def chunk(room, src=0, lo=2, hi=3, pages=(1,), nbytes=None) -> kv_transfer_pb2.PageChunk:
    block = 2 * 4 * 2 * 8 * 4  # one layer of one page, float32
    data = bytes(range(256)) * (block * len(pages) * (hi - lo) // 256) if nbytes is None else b"\1" * nbytes
    return kv_transfer_pb2.PageChunk(
        secret=KEY, room=room, src_rank=src, layer_start=lo, layer_end=hi, page_ids=pages, data=data
    )


def call_error(fn, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, timeout=10)
    return e.value


def test_unknown_room_is_not_found_on_every_call(stub):
    e = call_error(stub.WritePages, iter([chunk(77)]))
    assert (e.code(), e.details()) == (grpc.StatusCode.NOT_FOUND, "room 77 is not expected on decode rank 1")
    e = call_error(
        stub.TransferDone, kv_transfer_pb2.TransferNotice(secret=KEY, room=77, src_rank=0, layer_start=2, layer_end=3)
    )
    assert e.code() == grpc.StatusCode.NOT_FOUND
    e = call_error(stub.FirstToken, kv_transfer_pb2.FirstTokenNotice(secret=KEY, room=77, token=1, prompt_tokens=1))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION  # rank 1 takes no first tokens at all


@pytest.mark.parametrize(
    "bad,details",
    [
        (chunk(5, pages=(8,)), "page id 8 out of range [0, 8)"),
        (chunk(5, pages=(4,)), "page id 4 is not registered for room 5"),
        (chunk(5, lo=3, hi=4), "layers [3, 4) are outside prefill rank 0's overlap [2, 3) with decode rank 1"),
        (chunk(5, nbytes=100), "100 bytes for 1 pages x 1 layers; expected 512"),
    ],
)
def test_bad_chunk_is_invalid_argument_and_fails_only_its_room(receiver, stub, bad, details):
    receiver.expect(5, "bad", [1, 2], SOURCES, "grpc", KEY)
    receiver.expect(6, "good", [3], SOURCES, "grpc", KEY)
    e = call_error(stub.WritePages, iter([chunk(5, pages=(1,)), bad]))
    assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert (receiver.poll(5), receiver.reason(5)) == (KVPoll.FAILED, details)
    e = call_error(stub.WritePages, iter([chunk(5)]))  # the failed room takes nothing more
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    # the other room is still served
    ack = stub.WritePages(iter([chunk(6, src=0, lo=2, hi=3, pages=(3,)), chunk(6, src=1, lo=3, hi=4, pages=(3,))]))
    assert ack.bytes == 2 * 512
    for src, (lo, hi) in ((0, (2, 3)), (1, (3, 4))):
        notice = kv_transfer_pb2.TransferNotice(
            secret=KEY, room=6, src_rank=src, layer_start=lo, layer_end=hi, num_tokens=3, bytes=512
        )
        stub.TransferDone(notice, timeout=10)
    assert receiver.poll(6) == KVPoll.SUCCESS
    landed = receiver.pool.buffer[3].numpy().tobytes()  # both layers of page 3, as bytes (some are NaN floats)
    assert landed == chunk(6).data * 2
    assert receiver.pool.buffer[[0, 4, 5, 6, 7]].abs().sum() == 0  # never registered: still zero


def test_a_notices_trace_context_is_taken_only_when_well_formed(receiver, stub):
    """A TransferNotice's traceparent comes from a peer: a well-formed one makes this rank's `kv landed`
    span its child; a malformed one is ignored, and either way the notice counts as it would without."""
    sink = OTLPSink()
    tracing.setup("kvbridge-test-rank1", sink.start())
    try:
        receiver.expect(12, "r12", [3], SOURCES, "grpc", KEY)
        stub.WritePages(iter([chunk(12, 0, 2, 3, (3,)), chunk(12, 1, 3, 4, (3,))]), timeout=30)
        trace_id, parent = "ab" * 16, "cd" * 8
        for src, (lo, hi), tp in ((0, (2, 3), f"00-{trace_id}-{parent}-01"), (1, (3, 4), "00-" + "z" * 60 + "-01")):
            notice = kv_transfer_pb2.TransferNotice(
                secret=KEY, room=12, src_rank=src, layer_start=lo, layer_end=hi, num_tokens=3, bytes=512,
                push_seconds=0.25, traceparent=tp,
            )  # fmt: skip
            assert stub.TransferDone(notice, timeout=10).bytes == 512
        assert receiver.poll(12) == KVPoll.SUCCESS
        tracing._provider.force_flush()
        landed = sink.wait_for(trace_id, lambda s: len(s) == 1, timeout=10)
        assert [(s.name, s.parent_id, s.attributes["kvbridge.prefill_rank"]) for s in landed] == [
            ("kv landed", parent, 0)
        ]
        assert (landed[0].attributes["kvbridge.bytes"], landed[0].attributes["kvbridge.push_seconds"]) == (512, 0.25)
        assert len(sink.spans) == 1  # (nothing for the malformed one)
    finally:
        tracing.shutdown()
        sink.stop()


def test_segment_is_owner_only_while_open_and_gone_after_close():
    before = our_segments()
    r = KVReceiverEndpoint(make_config(backends=SHM_ONLY))
    path = SHM / r.endpoint.endpoint("shm").decode()
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 8 * 2 * 2 * 4 * 2 * 8 * 4
    r.close()
    r.close()  # idempotent
    assert not path.exists() and our_segments() == before


def test_segment_is_gone_when_the_constructor_fails_after_creating_it():
    before = our_segments()
    with pytest.raises(ValueError, match=r"cannot bind 256\.0\.0\.1:0"):
        KVReceiverEndpoint(make_config(host="256.0.0.1"))
    assert our_segments() == before


def test_segment_is_gone_when_the_with_block_raises():
    before = our_segments()
    with pytest.raises(RuntimeError, match="daemon crashed"), KVReceiverEndpoint(make_config(backends=SHM_ONLY)) as r:
        assert (SHM / r.endpoint.endpoint("shm").decode()).exists()
        raise RuntimeError("daemon crashed")
    assert our_segments() == before


def test_callback_sees_every_change_of_rank_zero_room():
    seen: list[StatusChange] = []
    with KVReceiverEndpoint(make_config(0, (0, 2), backends=SHM_ONLY, awaits_first_token=True), seen.append) as r:
        r.expect(9, "rid9", [0], SOURCES, "shm", KEY)
        r.rooms.done(Notice(0, 0, 2, 4, 2 * 512), 9, KEY)
        assert r.poll(9) == KVPoll.WAITING_FOR_INPUT  # the first token is still missing
        channel = make_channel(r.endpoint.receiver_addr)
        kv_transfer_pb2_grpc.KVReceiverStub(channel).FirstToken(
            kv_transfer_pb2.FirstTokenNotice(secret=KEY, room=9, token=17, prompt_tokens=4), timeout=10
        )
        channel.close()
        assert r.first_token(9) == (17, 4)
    assert seen == [StatusChange(9, "rid9", KVPoll.SUCCESS, "")]


def test_plain_memory_pool_has_no_segment():
    before = our_segments()
    with KVReceiverEndpoint(make_config(backends=("grpc",))) as r:
        assert r.endpoint.endpoints == (Endpoint("grpc", b""),) and our_segments() == before
        assert r.pool.buffer.shape == (8, 2, 2, 4, 2, 8)


def test_a_rank_opens_every_backend_that_moves_its_pool_and_publishes_each_endpoint():
    with KVReceiverEndpoint(make_config()) as r:
        assert [e.backend for e in r.endpoint.endpoints] == ["shm", "torch", "grpc"]  # cuda_ipc: pools on a GPU
        assert (SHM / r.endpoint.endpoint("shm").decode()).exists()
        addr, key = r.endpoint.endpoint("torch").decode().split(" ")
        assert addr.startswith("127.0.0.1:") and len(key) == 32
    with pytest.raises(ValueError, match="the cuda_ipc backend does not move pools on cpu"):
        KVReceiverEndpoint(make_config(backends=("cuda_ipc",)))


def test_a_room_for_a_backend_the_rank_did_not_open_is_refused():
    with KVReceiverEndpoint(make_config(backends=("grpc",))) as r:
        with pytest.raises(ValueError, match=r"room 5: backend 'shm' is not open on this rank \(open: grpc\)"):
            r.expect(5, "r5", [1], SOURCES, "shm", KEY)
        with pytest.raises(ValueError, match="backend 'nixl' is not open"):
            r.expect(5, "r5", [1], SOURCES, "nixl", KEY)
        r.expect(5, "r5", [1], SOURCES, "grpc", KEY)
        assert r.poll(5) == KVPoll.WAITING_FOR_INPUT


def die_holding_a_receiver(out) -> None:
    r = KVReceiverEndpoint(make_config(backends=SHM_ONLY))
    out.put(r.endpoint.endpoint("shm").decode())
    out.close()
    out.join_thread()  # the name is sent before the process dies
    os._exit(3)  # no close(), no cleanup


def test_segments_of_a_dead_rank_process_can_be_removed_by_pid():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=die_holding_a_receiver, args=(out,))
    proc.start()
    name = out.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 3 and (SHM / name).exists()
    assert remove_segments_of(proc.pid) == [name]
    assert not (SHM / name).exists()


def test_a_torch_pair_opens_only_with_the_stores_key():
    """The torch store takes any writer: pairs live under the key the layout publishes, so a peer
    without it finds no acceptor (its hello is never answered) and a peer with it gets a pair."""
    import torch.distributed

    from kvbridge.kv_transfer.backends.torch_p2p import PairClient

    with KVReceiverEndpoint(make_config(backends=("torch",))) as r:
        addr, key = r.endpoint.endpoint("torch").decode().split(" ")
        assert len(key) == 32 and key != "0" * 32
        with pytest.raises(torch.distributed.DistStoreError, match="wait timeout after 2000ms"):
            PairClient(addr, "0" * 32, 0, torch.device("cpu"), timeout_s=2)
        pair = PairClient(addr, key, 0, torch.device("cpu"), timeout_s=30)
        assert pair.backend == "gloo"
        pair.close()


# ---- the KVReceiver's streams: keyed at once, kept moving, few waiting per peer host ----


class Held:
    """A WritePages stream that sends what it is given, when it is given it (None: its end)."""

    def __init__(self, stub, timeout: float = 60):
        self._chunks: queue.Queue = queue.Queue()
        self.call = stub.WritePages.future(iter(self._chunks.get, None), timeout=timeout)

    def send(self, c) -> None:
        self._chunks.put(c)

    def end(self) -> None:
        self._chunks.put(None)

    def error(self) -> tuple[grpc.StatusCode, str]:
        e = self.call.exception(timeout=60)
        return (e.code(), e.details()) if e is not None else (grpc.StatusCode.OK, "")


def on_loop(receiver, fn):
    return receiver._server.loop.invoke(fn)


def waiting(receiver, peer=None) -> int:
    """Streams of `peer` (every peer: None) waiting for their first chunk."""
    return on_loop(receiver, lambda: receiver.servicer.waiting.count(peer))


def wait_until(predicate, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def hand_off(receiver, stub, room: int) -> int:
    """Room `room` (page 3) from both of its sources over one stream, and their notices: the bytes acknowledged."""
    receiver.expect(room, f"r{room}", [3], SOURCES, "grpc", KEY)
    ack = stub.WritePages(iter([chunk(room, 0, 2, 3, (3,)), chunk(room, 1, 3, 4, (3,))]), timeout=30)
    for src, (lo, hi) in ((0, (2, 3)), (1, (3, 4))):
        notice = kv_transfer_pb2.TransferNotice(
            secret=KEY, room=room, src_rank=src, layer_start=lo, layer_end=hi, num_tokens=3, bytes=512
        )
        stub.TransferDone(notice, timeout=30)
    return ack.bytes


@pytest.fixture
def patient():
    """A receiver whose streams may idle for a minute (floods stay open while a test runs)."""
    with KVReceiverEndpoint(make_config(backends=SHM_ONLY, stream_idle_s=60)) as r:
        yield r


def test_silent_streams_from_a_peer_do_not_keep_a_hand_off_from_landing(patient):
    """40 streams that never send a chunk (a thread each on the old threaded server: its 32 workers
    were all held, and no notice landed) push each other out past 16; the next sender's stream,
    from the same host, pushes out one more and its room lands while 15 still wait."""
    receiver, channel = patient, make_channel(patient.endpoint.receiver_addr)
    stub = kv_transfer_pb2_grpc.KVReceiverStub(channel)
    silent = [Held(stub) for _ in range(40)]
    wait_until(lambda: sum(s.call.done() for s in silent) == 24, "24 streams never ended")
    assert waiting(receiver, "127.0.0.1") == MAX_UNKEYED_STREAMS_PER_PEER == 16
    assert hand_off(receiver, stub, 6) == 2 * 512
    assert receiver.poll(6) == KVPoll.SUCCESS
    assert receiver.pool.buffer[3].numpy().tobytes() == chunk(6).data * 2
    ended = [s for s in silent if s.call.done()]
    assert len(ended) == 25 and waiting(receiver) == 15
    pushed_out = (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "127.0.0.1 opened a newer KV stream: a peer host may have at most 16 waiting for their first chunk "
        "(MAX_UNKEYED_STREAMS_PER_PEER); its oldest is ended",
    )
    assert {s.error() for s in ended} == {pushed_out}
    assert silent.index(ended[-1]) == 24  # the oldest went first
    for s in silent:
        s.call.cancel()
    wait_until(lambda: waiting(receiver) == 0, "cancelled streams still counted")
    channel.close()


def test_a_flood_from_one_peer_host_does_not_push_out_another_hosts_stream(patient):
    relay = Relay(patient.endpoint.receiver_addr)
    far = make_channel(relay.addr)
    near = make_channel(patient.endpoint.receiver_addr)
    patient.expect(6, "r6", [3], SOURCES, "grpc", KEY)
    theirs = Held(kv_transfer_pb2_grpc.KVReceiverStub(far))
    wait_until(lambda: waiting(patient, "127.0.0.2") == 1, "the relayed stream never waited")
    flood = [Held(kv_transfer_pb2_grpc.KVReceiverStub(near)) for _ in range(MAX_UNKEYED_STREAMS_PER_PEER + 8)]
    wait_until(lambda: sum(s.call.done() for s in flood) == 8, "the flood never pushed itself out")
    assert (waiting(patient, "127.0.0.2"), waiting(patient, "127.0.0.1")) == (1, 16)
    theirs.send(chunk(6, 0, 2, 3, (3,)))
    theirs.end()
    assert theirs.call.result(timeout=30).bytes == 512
    for s in flood:
        s.call.cancel()
    for c in (far, near):
        c.close()
    relay.close()


def test_streams_that_wait_past_the_idle_limit_end_deadline_exceeded():
    with KVReceiverEndpoint(make_config(backends=SHM_ONLY, stream_idle_s=1)) as r:
        channel = make_channel(r.endpoint.receiver_addr)
        stub = kv_transfer_pb2_grpc.KVReceiverStub(channel)
        r.expect(5, "r5", [1, 2], SOURCES, "grpc", KEY)
        silent, stalled = Held(stub), Held(stub)
        stalled.send(chunk(5, pages=(1,)))
        assert silent.error() == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "no PageChunk within 1 s of the stream's start (the KV stream idle limit, --kv-stream-idle-s)",
        )
        assert stalled.error() == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "no PageChunk within 1 s of the last one (the KV stream idle limit, --kv-stream-idle-s)",
        )
        assert r.pool.buffer[1, 0].numpy().tobytes() == chunk(5).data  # its chunk landed before it stalled
        assert r.poll(5) == KVPoll.TRANSFERRING  # (its sender fails the room: the stream's error is its own)
        assert hand_off(r, stub, 6) == 2 * 512  # and the receiver serves on
        channel.close()


def test_a_first_chunk_with_a_wrong_key_is_permission_denied_and_the_stream_is_read_no_further(receiver, stub):
    receiver.expect(5, "r5", [1, 2], SOURCES, "grpc", KEY)
    forged = chunk(5, pages=(1,))
    forged.secret = bytes(16)
    e = call_error(stub.WritePages, iter([forged, chunk(5, pages=(2,))]))
    assert (e.code(), e.details()) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "room 5: the write key is not the room's (only its prefill node has it)",
    )
    assert receiver.poll(5) == KVPoll.WAITING_FOR_INPUT
    assert receiver.pool.buffer.abs().sum() == 0  # neither chunk landed
    assert waiting(receiver) == 0


def test_waiting_streams_past_a_limit_end_the_oldest_of_their_host_then_of_all():
    async def run() -> list[str]:
        w = WaitingStreams(per_peer=2, total=3)
        a1, a2, b1 = w.add("a"), w.add("a"), w.add("b")
        a3 = w.add("a")  # a's third: a1 ends
        b2 = w.add("b")  # four in all: the oldest of all, a2, ends
        w.remove(b1)
        c1 = w.add("c")
        ended = [name for name, s in zip(["a1", "a2", "b1", "a3", "b2", "c1"], [a1, a2, b1, a3, b2, c1]) if s.why]
        return ended, [w.count(p) for p in ("a", "b", "c", None)], a1.why, a2.why

    ended, counts, why_a1, why_a2 = asyncio.run(run())
    assert ended == ["a1", "a2"] and counts == [1, 1, 1, 3]
    assert why_a1.startswith("a opened a newer KV stream: a peer host may have at most 2 waiting")
    assert why_a2 == "at most 3 KV streams may wait for their first chunk (MAX_UNKEYED_STREAMS); the oldest is ended"


@pytest.mark.parametrize(
    "peer,host",
    [
        ("ipv4:10.0.0.5:41234", "10.0.0.5"),
        ("ipv6:[::1]:41234", "::1"),
        ("ipv6:%5B::1%5D:41234", "::1"),
        ("ipv6:[::ffff:10.0.0.5]:41234", "10.0.0.5"),
        ("unix:/tmp/sock", "unix:/tmp/sock"),
    ],
)
def test_peer_host_is_the_address_without_its_port(peer, host):
    assert peer_host(peer) == host
