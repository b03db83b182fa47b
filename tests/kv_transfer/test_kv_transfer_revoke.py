"""A prefill rank's Sender never writes into a revoked room: revoke() waits for the write under way
(it reports once that write ended) and every write of the room that had not started is dropped,
counted. A sender whose writes wait on a gate makes each interleaving happen on purpose."""

from __future__ import annotations

import threading

import pytest
import torch

from kvbridge.engine.kv_pool import KVPool
from kvbridge.kv_transfer import NodeLayout, PageGeometry, RankInfo, Sender

KEY = bytes(range(16))
GEOMETRY = PageGeometry(page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
NUM_LAYERS, NUM_PAGES = 6, 16
WAIT_S = 30.0  # a bound on waiting for an event that must come (a hang fails, it does not stall)


class GatedSender(Sender):
    """Writes nothing anywhere: each write is logged, and the first `gated` writes wait until the
    test opens the gate."""

    name = "gated"

    def __init__(self, pool: KVPool, gated: int = 1):
        self.log: list[tuple] = []  # ("began" | "ended", room, decode rank, dst) and ("revoked", room), in order
        self.entered = threading.Event()  # a gated write began
        self.gate = threading.Event()
        self.gated = gated
        super().__init__(pool, rank=0)

    def _open(self, info: RankInfo, decode: NodeLayout) -> object:
        return info.rank

    def _write(self, conn, r, target, src, dst) -> int:
        self.log.append(("began", r.room, conn, tuple(dst)))
        if self.gated:
            self.gated -= 1
            self.entered.set()
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.log.append(("ended", r.room, conn, tuple(dst)))
        return len(dst)

    def revoked(self, room: int):
        """A report for revoke(): logged where it lands among the writes."""
        done = threading.Event()

        def then() -> None:
            self.log.append(("revoked", room))
            done.set()

        return then, done


def make_sender(gated: int = 1) -> GatedSender:
    pool = KVPool(NUM_PAGES, (0, NUM_LAYERS), 4, 2, 8, torch.float32)
    return GatedSender(pool, gated)


# two decode ranks, each overlapping the sender's layers: every push is two writes, rank 0's first
DECODE = NodeLayout(
    GEOMETRY,
    NUM_LAYERS,
    NUM_PAGES,
    (RankInfo(0, 0, 3, receiver_addr="127.0.0.1:1"), RankInfo(1, 3, 6, receiver_addr="127.0.0.1:2")),
    "fp",
    ("gated",),
    "host",
)


def test_a_revoke_during_a_write_reports_once_that_write_ended_and_drops_the_rest():
    sender = make_sender(gated=1)
    try:
        sender.connect(9, DECODE, [4, 5, 6], KEY)
        sender.push(9, [1, 2], [4, 5], 8)  # two writes: decode rank 0's (gated), then rank 1's
        sender.push(9, [3], [6], 12)  # queued behind it: two writes more
        assert sender.entered.wait(WAIT_S)
        then, revoked = sender.revoked(9)
        sender.revoke(9, then)
        assert not revoked.is_set()  # the write into the room is still under way (the gate is shut)
        with pytest.raises(KeyError):  # and the room takes nothing more
            sender.push(9, [3], [6], 12)
        sender.gate.set()
        assert revoked.wait(WAIT_S)
    finally:
        sender.close()  # (the worker ran every job queued before it)
    assert sender.log == [("began", 9, 0, (4, 5)), ("ended", 9, 0, (4, 5)), ("revoked", 9)]
    assert (sender.writes, sender.writes_dropped) == (1, 3)  # rank 1's write of the first push, both of the second


def test_a_revoke_between_writes_reports_at_once_and_the_rooms_queued_pushes_write_nothing():
    sender = make_sender(gated=1)
    try:
        sender.connect(8, DECODE, [0, 1], KEY)
        sender.connect(9, DECODE, [4, 5, 6], KEY)
        sender.push(8, [1], [0], 4)  # another room's write holds the worker at the gate
        assert sender.entered.wait(WAIT_S)
        sender.push(9, [1, 2], [4, 5], 8)  # queued behind it
        then, revoked = sender.revoked(9)
        sender.revoke(9, then)
        assert revoked.is_set()  # nothing of room 9 was being written: reported before revoke() returned
        sender.gate.set()
    finally:
        sender.close()
    room_8 = [("ended", 8, 0, (0,)), ("began", 8, 1, (0,)), ("ended", 8, 1, (0,))]
    assert sender.log == [("began", 8, 0, (0,)), ("revoked", 9), *room_8]  # room 8 goes on; 9 is never written
    assert (sender.writes, sender.writes_dropped) == (2, 2)


def test_revoking_a_room_this_rank_never_connected_reports_at_once():
    sender = make_sender(gated=0)
    try:
        then, revoked = sender.revoked(7)
        sender.revoke(7, then)
        assert revoked.is_set()
        sender.revoke(7)  # (twice: the same)
    finally:
        sender.close()
    assert sender.log == [("revoked", 7)]
    assert (sender.writes, sender.writes_dropped) == (0, 0)
