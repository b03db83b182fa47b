"""A decode rank's part of the hand-off: expect a request's pages from the prefill ranks
that overlap this rank's layers, and report to consensus.

Consensus streams it feeds: DECODE_PREALLOCATED (READY as soon as this rank expects the
room: its pages are reserved and its receiver knows them) and DECODE_TRANSFERRED (READY
once every overlapping prefill rank's pages and notice arrived; on rank 0 the first token
too). Its receiver reports state changes from its own threads.
"""

from __future__ import annotations

import logging

from consensus import LocalStatus, Stream
from engine.pp.agent import KVAgent
from engine.pp.control import ControlChannel
from engine.pp.wire import ABORT, ADMIT, FINISH, Decision
from kv_transfer import KVPoll, KVReceiverEndpoint, Source, StatusChange

log = logging.getLogger(__name__)


class DecodeAgent(KVAgent):
    def __init__(self, rank: int, receiver: KVReceiverEndpoint | None, chan: ControlChannel):
        self.rank, self.receiver, self.chan = rank, receiver, chan
        self.rooms: dict[str, int] = {}  # rid -> room, while its pages may still be written

    def on_decision(self, d: Decision) -> None:
        pd = (d.info or {}).get("room")
        if d.kind == ADMIT and pd is not None:
            info = d.info
            self.rooms[d.rid] = room = int(info["room"])
            self.chan.set_local(Stream.DECODE_TRANSFERRED, d.rid, LocalStatus.PENDING)
            sources = [Source(*s) for s in info["sources"]]
            try:
                self.receiver.expect(room, d.rid, info["page_ids"], sources, info["backend"])
            except ValueError as e:
                log.warning("rid=%s room=%s rank=%d cannot expect its pages: %s", d.rid, room, self.rank, e)
                self.chan.set_local(Stream.DECODE_PREALLOCATED, d.rid, LocalStatus.FAILED)
                return
            self.chan.set_local(Stream.DECODE_PREALLOCATED, d.rid, LocalStatus.READY)
        elif d.kind in (FINISH, ABORT) and d.rid in self.rooms:
            room = self.rooms.pop(d.rid)
            if d.kind == ABORT:
                self.receiver.fail(room, "aborted by the decode node")
            self.receiver.forget(room)

    def on_change(self, change: StatusChange) -> None:
        """The receiver's callback (its threads): a room's state changed on this rank."""
        if change.state == KVPoll.SUCCESS:
            self.chan.set_local(Stream.DECODE_TRANSFERRED, change.rid, LocalStatus.READY)
        elif change.state == KVPoll.FAILED:
            log.warning("rid=%s room=%s rank=%d transfer failed: %s", change.rid, change.room, self.rank, change.reason)
            self.chan.set_local(Stream.DECODE_TRANSFERRED, change.rid, LocalStatus.FAILED)
