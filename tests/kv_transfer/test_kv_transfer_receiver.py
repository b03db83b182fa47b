"""A decode rank's receiver, in this process: gRPC status codes at the boundary, the shared
segment's mode and lifetime (on every exit path), and status changes for the daemon."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest
import torch.multiprocessing as mp

from common.rpc import make_channel
from kv_transfer import KVPoll, KVReceiverEndpoint, ReceiverConfig, Source
from kv_transfer.backends.shm import remove_segments_of
from kv_transfer.poll import StatusChange
from kv_transfer.rooms import Notice
from kvbridge.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

KEY = bytes(range(16))  # the rooms' write key (the decode node mints one per room)

SOURCES = [Source(0, 0, 3), Source(1, 3, 6)]
SHM = Path("/dev/shm")


def make_config(rank=1, layers=(2, 4), **kw) -> ReceiverConfig:
    return ReceiverConfig(rank, *layers, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, **kw)


def our_segments() -> set[str]:
    return {p.name for p in SHM.glob(f"kvbridge-{os.getpid()}-*")}


@pytest.fixture
def receiver():
    with KVReceiverEndpoint(make_config(torch_store=False)) as r:
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


def test_segment_is_owner_only_while_open_and_gone_after_close():
    before = our_segments()
    r = KVReceiverEndpoint(make_config(torch_store=False))
    path = SHM / r.endpoint.shm_name
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
    with pytest.raises(RuntimeError, match="daemon crashed"), KVReceiverEndpoint(make_config(torch_store=False)) as r:
        assert (SHM / r.endpoint.shm_name).exists()
        raise RuntimeError("daemon crashed")
    assert our_segments() == before


def test_callback_sees_every_change_of_rank_zero_room():
    seen: list[StatusChange] = []
    with KVReceiverEndpoint(make_config(0, (0, 2), torch_store=False, awaits_first_token=True), seen.append) as r:
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
    with KVReceiverEndpoint(make_config(shared_memory=False, torch_store=False)) as r:
        assert r.endpoint.shm_name == "" and r.endpoint.torch_addr == ""
        assert r.pool.buffer.shape == (8, 2, 2, 4, 2, 8)


def die_holding_a_receiver(out) -> None:
    r = KVReceiverEndpoint(make_config(torch_store=False))
    out.put(r.endpoint.shm_name)
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

    from kv_transfer.backends.torch_p2p import PairClient

    with KVReceiverEndpoint(make_config(torch_store=True)) as r:
        addr, key = r.endpoint.torch_addr, r.endpoint.torch_key
        assert len(key) == 32 and key != "0" * 32
        with pytest.raises(torch.distributed.DistStoreError, match="wait timeout after 2000ms"):
            PairClient(addr, "0" * 32, 0, torch.device("cpu"), timeout_s=2)
        pair = PairClient(addr, key, 0, torch.device("cpu"), timeout_s=30)
        assert pair.backend == "gloo"
        pair.close()
