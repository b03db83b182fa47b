"""A decode rank's part of the hand-off: expect a request's pages from the prefill ranks
that overlap this rank's layers, and report to consensus.

Consensus streams it feeds: DECODE_PREALLOCATED (READY as soon as this rank expects the
room: its pages are reserved and its receiver knows them) and DECODE_TRANSFERRED (READY
once every overlapping prefill rank's pages and notice arrived; on rank 0 the first token
too). Its receiver reports state changes from its own threads.
"""

from __future__ import annotations

import logging
import time

import torch

from kvbridge.common.limits import room_tag
from kvbridge.common.logs import log_event
from kvbridge.consensus import LocalStatus, Stream
from kvbridge.engine import faults
from kvbridge.engine.faults import INJECTED
from kvbridge.kv_transfer import KVPoll, KVReceiverEndpoint, StatusChange
from kvbridge.pipeline.agent import KVAgent
from kvbridge.pipeline.control import ControlChannel
from kvbridge.pipeline.log import ABORT, ADMIT, FINISH, RESUME, RETRACT, LogEntry
from kvbridge.pipeline.metrics import RankRecorder

log = logging.getLogger("kvbridge.transfer")


class DecodeAgent(KVAgent):
    def __init__(self, rank: int, receiver: KVReceiverEndpoint | None, chan: ControlChannel, recorder: RankRecorder):
        self.rank, self.receiver, self.chan = rank, receiver, chan
        self.rooms: dict[str, int] = {}  # rid -> room, while its pages may still be written
        self.offloaded: dict[str, torch.Tensor] = {}  # retracted rid -> its pages of this rank, in host memory
        self.expected: dict[str, float] = {}  # rid -> when this rank started expecting its pages
        self.recorder = recorder
        self.faults = faults.current()
        self.doomed: set[str] = set()  # fault injection: rids whose transfer fails on this rank

    def on_decision(self, d: LogEntry) -> None:
        if d.kind == ADMIT and d.info.destination is not None:
            to = d.info.destination
            room = to.room
            self.chan.set_local(Stream.DECODE_TRANSFERRED, d.rid, LocalStatus.PENDING)
            try:
                self.receiver.expect(
                    room, d.rid, list(to.page_ids), list(to.sources), to.backend, to.secret, to.held_pages
                )
                self.rooms[d.rid] = room  # (only once it is ours: a room in use stays its owner's)
            except ValueError as e:
                self._log_failure(d.rid, room, str(e))
                self.chan.set_local(Stream.DECODE_PREALLOCATED, d.rid, LocalStatus.FAILED)
                return
            self.expected[d.rid] = time.perf_counter()
            if self.faults.fail_transfer():
                self.doomed.add(d.rid)
            self.chan.set_local(Stream.DECODE_PREALLOCATED, d.rid, LocalStatus.READY)
        elif d.kind == RETRACT:  # before any later step can reuse the pages: copy this rank's layers out
            self.offloaded[d.rid] = self.receiver.pool.buffer[list(d.info.pages)].to("cpu", copy=True)
        elif d.kind == RESUME:
            pages, buffer = list(d.info.pages), self.receiver.pool.buffer
            buffer[pages] = self.offloaded.pop(d.rid)[: len(pages)].to(buffer.device)
            self.chan.set_local(Stream.DECODE_RETRACTED, d.rid, LocalStatus.READY)
        elif d.kind in (FINISH, ABORT):
            self.offloaded.pop(d.rid, None)  # (retracted when it ended)
            if d.rid not in self.rooms:  # (done with its room already, or it never had one: a choice of n)
                return
            room = self.rooms.pop(d.rid)
            self.expected.pop(d.rid, None)
            self.doomed.discard(d.rid)
            if d.kind == ABORT:
                self.receiver.fail(room, "aborted by the decode node")
            self.receiver.forget(room)

    def holding(self) -> int:
        return len(self.rooms) + len(self.offloaded) + len(self.expected)

    def on_change(self, change: StatusChange) -> None:
        """The receiver's callback (its threads): a room's state changed on this rank."""
        if change.state == KVPoll.SUCCESS:
            if change.rid in self.doomed:  # the pages are here, but this rank says they are not
                self._log_failure(change.rid, change.room, INJECTED)
                self.recorder.transfer_failed(self.rank, "injected")
                self.chan.set_local(Stream.DECODE_TRANSFERRED, change.rid, LocalStatus.FAILED)
                return
            since = self.expected.get(change.rid)
            if since is not None:
                self.recorder.transfer_done(self.rank, time.perf_counter() - since)
            rid = change.rid
            self.faults.report_done(lambda: self.chan.set_local(Stream.DECODE_TRANSFERRED, rid, LocalStatus.READY))
        elif change.state == KVPoll.FAILED:
            self._log_failure(change.rid, change.room, change.reason)
            self.recorder.transfer_failed(self.rank, change.reason)
            self.chan.set_local(Stream.DECODE_TRANSFERRED, change.rid, LocalStatus.FAILED)

    def _log_failure(self, rid: str, room: int, reason: str) -> None:
        log_event(log, "transfer_failed", logging.WARNING, rid=rid, room=room_tag(room), rank=self.rank, reason=reason)
