"""The prefill side's Sender, against receivers in this process: the daemon's calls, their
checks, the state changes it reports, and the notices decode ranks get on failures."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from kvbridge.engine.kv_pool import KVPool
from kvbridge.engine.model import stage_ranges
from kvbridge.kv_transfer import (
    KVPoll,
    KVReceiverEndpoint,
    NodeLayout,
    PageGeometry,
    RankInfo,
    ReceiverConfig,
    SenderConfig,
    make_sender,
)
from kvbridge.kv_transfer.adapters import sources_of
from kvbridge.kv_transfer.poll import StatusChange
from kvbridge.kv_transfer.rooms import Source

KEY = bytes(range(16))  # the rooms' write key (the decode node mints one per room)

GEOMETRY = PageGeometry(page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
NUM_LAYERS, NUM_PAGES = 6, 16
WHOLE_MODEL = [Source(0, 0, NUM_LAYERS)]  # a prefill node of one rank


def make_decode(ranges, **kw) -> list[KVReceiverEndpoint]:
    return [
        KVReceiverEndpoint(ReceiverConfig(j, lo, hi, NUM_PAGES, 4, 2, 8, backends=("shm",), **kw))
        for j, (lo, hi) in enumerate(ranges)
    ]


def layout_of(ranks, geometry=GEOMETRY) -> NodeLayout:
    return NodeLayout(geometry, NUM_LAYERS, NUM_PAGES, tuple(ranks), "fp", ("shm", "grpc"), "host")


def make_prefill_pool(layers, seed) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randn(GEOMETRY.pool_shape(NUM_PAGES, layers), generator=g)
    return KVPool(NUM_PAGES, layers, 4, 2, 8, torch.float32, buffer=buffer)


def wait_terminal(poll, rooms, timeout_s=20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(poll(r).is_terminal for r in rooms):
        assert time.monotonic() < deadline, [poll(r).name for r in rooms]
        time.sleep(0.01)


@pytest.mark.parametrize("engine", ["shm", "grpc"])
def test_p3_by_d2_pages_land_on_the_overlapping_layers(engine):
    p_ranges, d_ranges = stage_ranges(NUM_LAYERS, 3), stage_ranges(NUM_LAYERS, 2)  # [(0,2),(2,4),(4,6)] x [(0,3),(3,6)]
    receivers = make_decode(d_ranges)
    pools = [make_prefill_pool(r, seed=i) for i, r in enumerate(p_ranges)]
    senders = [make_sender(engine, pool, i) for i, pool in enumerate(pools)]
    try:
        decode = layout_of(r.endpoint for r in receivers)
        prefill = layout_of(RankInfo(i, *r) for i, r in enumerate(p_ranges))
        for r in receivers:
            r.expect(9, "rid", [4, 5, 6], sources_of(prefill), engine, KEY)
        for s in senders:
            s.connect(9, decode, [4, 5, 6], KEY)
            s.push(9, [1, 2], [4, 5], 6)
            s.push(9, [2, 3], [5, 6], 10)
            s.finish(9, 10)
        wait_terminal(lambda room: min(x.poll(room) for x in [*senders, *receivers]), [9])
        assert [s.poll(9) for s in senders] == [KVPoll.SUCCESS] * 3
        assert [r.poll(9) for r in receivers] == [KVPoll.SUCCESS] * 2
        for r, (ds, de) in zip(receivers, d_ranges):
            for layer in range(ds, de):
                i = next(i for i, (ps, pe) in enumerate(p_ranges) if ps <= layer < pe)
                want = pools[i].buffer[[1, 2, 3], layer - p_ranges[i][0]]
                assert torch.equal(r.pool.buffer[[4, 5, 6], layer - ds], want)
            assert r.pool.buffer[[0, 1, 2, 3, 7]].abs().sum() == 0
    finally:
        for x in [*senders, *receivers]:
            x.close()


def test_state_changes_reach_the_callback_in_order():
    [receiver] = make_decode([(0, 6)])
    seen: list[StatusChange] = []
    done = threading.Event()

    def on_change(c: StatusChange) -> None:
        seen.append(c)
        if c.state.is_terminal:
            done.set()

    sender = make_sender("shm", make_prefill_pool((0, 6), 0), 0, on_change=on_change)
    try:
        receiver.expect(3, "r3", [0], WHOLE_MODEL, "shm", KEY)
        sender.connect(3, layout_of([receiver.endpoint]), [0], KEY, rid="r3")
        sender.push(3, [5], [0], 2)
        sender.finish(3, 2)
        assert done.wait(20)
        assert [(c.room, c.rid, c.state) for c in seen] == [
            (3, "r3", KVPoll.WAITING_FOR_INPUT),
            (3, "r3", KVPoll.TRANSFERRING),
            (3, "r3", KVPoll.SUCCESS),
        ]
    finally:
        sender.close()
        receiver.close()


def test_push_checks_the_daemons_arguments():
    pool = make_prefill_pool((0, 6), 0)
    with make_sender("grpc", pool, 0) as sender:
        with pytest.raises(KeyError, match="room 1 is not connected on prefill rank 0"):
            sender.push(1, [0], [0], 4)
        decode = layout_of([RankInfo(0, 0, 6, receiver_addr="127.0.0.1:1")])
        sender.connect(1, decode, [2, 3], KEY)
        with pytest.raises(ValueError, match="2 source pages, 1 destinations"):
            sender.push(1, [0, 1], [2], 4)
        with pytest.raises(ValueError, match=r"source page 16 out of range \[0, 16\)"):
            sender.push(1, [16], [2], 4)
        with pytest.raises(ValueError, match="destination page 4 was not registered"):
            sender.push(1, [0], [4], 4)
        with pytest.raises(ValueError, match="room 1 is already known"):
            sender.connect(1, decode, [2, 3], KEY)


def test_incompatible_registration_fails_both_sides_with_both_values():
    [receiver] = make_decode([(0, 6)])
    sender = make_sender("shm", make_prefill_pool((0, 6), 0), 0)
    try:
        receiver.expect(4, "r4", [0], WHOLE_MODEL, "shm", KEY)
        other = dataclasses.replace(GEOMETRY, page_size=16)
        sender.connect(4, layout_of([receiver.endpoint], geometry=other), [0], KEY)
        want = f"page geometry differs: prefill {GEOMETRY}, decode {other}"
        assert (sender.poll(4), sender.reason(4)) == (KVPoll.FAILED, want)
        wait_terminal(receiver.poll, [4])
        assert receiver.reason(4) == f"prefill rank 0: {want}"
    finally:
        sender.close()
        receiver.close()


def test_abort_then_forget_still_tells_the_decode_ranks():
    [receiver] = make_decode([(0, 6)])
    sender = make_sender("shm", make_prefill_pool((0, 6), 0), 0)
    try:
        receiver.expect(5, "r5", [0], WHOLE_MODEL, "shm", KEY)
        sender.connect(5, layout_of([receiver.endpoint]), [0], KEY)
        sender.abort(5, "client went away")
        sender.forget(5)
        with pytest.raises(KeyError):
            sender.poll(5)
        wait_terminal(receiver.poll, [5])
        assert receiver.reason(5) == "prefill rank 0: client went away"
    finally:
        sender.close()
        receiver.close()


def test_worker_survives_an_unreachable_decode_rank():
    with make_sender("grpc", make_prefill_pool((0, 6), 0), 0) as sender:
        dead = layout_of([RankInfo(0, 0, 6, receiver_addr="127.0.0.1:1")])  # nothing listens on port 1
        sender.connect(6, dead, [0], KEY)
        sender.push(6, [0], [0], 4)
        sender.finish(6, 4)
        wait_terminal(sender.poll, [6], timeout_s=60)
        assert sender.poll(6) == KVPoll.FAILED and "UNAVAILABLE" in sender.reason(6)
        [receiver] = make_decode([(0, 6)])  # a later room to a live rank still goes through
        try:
            receiver.expect(7, "r7", [1], WHOLE_MODEL, "grpc", KEY)
            sender.connect(7, layout_of([receiver.endpoint]), [1], KEY)
            sender.push(7, [0], [1], 4)
            sender.finish(7, 4)
            wait_terminal(sender.poll, [7])
            assert sender.poll(7) == KVPoll.SUCCESS and receiver.poll(7) == KVPoll.SUCCESS
        finally:
            receiver.close()


@pytest.mark.long
def test_idle_torch_pair_outlives_its_timeout_through_pings():
    [receiver] = [KVReceiverEndpoint(ReceiverConfig(0, 0, 6, NUM_PAGES, 4, 2, 8, torch_timeout_s=1.5))]
    config = SenderConfig(torch_timeout_s=1.5, tick_s=0.05)
    sender = make_sender("torch", make_prefill_pool((0, 6), 0), 0, config)
    try:
        for room in (1, 2):
            receiver.expect(room, f"r{room}", [room], WHOLE_MODEL, "torch", KEY)
            sender.connect(room, layout_of([receiver.endpoint]), [room], KEY)
            sender.push(room, [0], [room], 4)
            sender.finish(room, 4)
            wait_terminal(receiver.poll, [room])
            assert receiver.poll(room) == KVPoll.SUCCESS
            time.sleep(4)  # idle for over twice the pair's receive timeout: without pings room 2 fails
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("p_size", [1, 2])
def test_the_first_token_rides_the_notice_to_decode_rank_zero_when_the_last_rank_feeds_it(monkeypatch, p_size):
    """P pp 1 -> D pp 1: one TransferDone carries the token. P pp 2 -> D pp 1: the last rank feeds
    rank 0 too (its layers [3, 6)), so again no FirstToken call."""
    from kvbridge.kv_transfer.service import KVReceiverServicer

    calls = []
    first_token = KVReceiverServicer.FirstToken
    monkeypatch.setattr(KVReceiverServicer, "FirstToken", lambda *a: calls.append(a) or first_token(*a))
    p_ranges = stage_ranges(NUM_LAYERS, p_size)
    [receiver] = make_decode([(0, NUM_LAYERS)], awaits_first_token=True)
    senders = [make_sender("shm", make_prefill_pool(r, seed=i), i) for i, r in enumerate(p_ranges)]
    try:
        prefill = layout_of(RankInfo(i, *r) for i, r in enumerate(p_ranges))
        receiver.expect(9, "rid", [4, 5], sources_of(prefill), "shm", KEY)
        for s in senders:
            s.connect(9, layout_of([receiver.endpoint]), [4, 5], KEY)
            s.push(9, [1, 2], [4, 5], 7)
        senders[-1].send_first_token(9, 42, 7)
        for s in senders:
            s.finish(9, 7)
        wait_terminal(lambda room: min(x.poll(room) for x in [*senders, receiver]), [9])
        assert [s.poll(9) for s in senders] == [KVPoll.SUCCESS] * p_size and receiver.poll(9) == KVPoll.SUCCESS
        assert receiver.first_token(9) == (42, 7) and calls == []
    finally:
        for s in senders:
            s.close()
        receiver.close()


def test_a_room_number_is_connected_again_right_after_it_was_forgotten():
    """Found by the slow decode-node fuzzer (one room number twice in a row): the worker dropped a
    forgotten room's state later, by number, and took the new room's with it (its pushes never
    went). Jobs carry their room now, so the second hand-off of the number lands like the first."""
    [receiver] = make_decode([(0, 6)])
    sender = make_sender("grpc", make_prefill_pool((0, 6), 0), 0)
    outcomes = []
    try:
        for rid in ("first", "second"):
            receiver.expect(9, rid, [4, 5], WHOLE_MODEL, "grpc", KEY)
            sender.connect(9, layout_of([receiver.endpoint]), [4, 5], KEY, rid)
            sender.push(9, [1, 2], [4, 5], 8)
            sender.finish(9, 8)
            wait_terminal(lambda room: min(sender.poll(room), receiver.poll(room)), [9])
            outcomes.append((sender.poll(9), receiver.poll(9)))
            sender.forget(9)  # at once, as prefill_node/agent.py does at FINISH
            receiver.forget(9)
    finally:
        sender.close()
        receiver.close()
    assert outcomes == [(KVPoll.SUCCESS, KVPoll.SUCCESS)] * 2
