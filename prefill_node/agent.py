"""A prefill rank's part of the hand-off: connect to the decode ranks a request's KV goes
to, push the pages each prefill chunk wrote, and report to consensus.

A request's first chunk may start past the prompt's first pages (found in the prefix cache; a
REUSE entry of the log names them): those pages are pushed with it, as if it had computed them.
The decode node may hold the prompt's first pages already (its own prefix cache: the route's
`held` pages): those are never pushed.

Prefill does not wait for the route (the decode node's registration, a ROUTE decision):
chunks computed before it are remembered (`Unrouted`) and pushed the moment it arrives, the
last rank's first token with them. Consensus stream it feeds: PREFILL_TRANSFERRED (PENDING
from the route on; READY once every push and notice of the request landed; FAILED when a
connection, push or notice failed). Its sender reports state changes from its own thread.

A routed request that ends early (ABORT) has its room revoked: the sender drops it and reports,
once no write into it is under way, READY under the room's own key in PREFILL_TRANSFERRED
(`revocation_key`); rank 0 answers the decode node's Bootstrap.Revoke once every rank did.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvbridge.common.limits import room_tag
from kvbridge.common.logs import log_event
from kvbridge.consensus import LocalStatus, Stream
from kvbridge.engine import faults
from kvbridge.engine.batch import ForwardBatch
from kvbridge.engine.faults import INJECTED
from kvbridge.engine.kv_pool import KVPool
from kvbridge.engine.logits import logprob_to_proto
from kvbridge.kv_transfer import KVPoll, StatusChange, make_sender
from kvbridge.pipeline.agent import KVAgent
from kvbridge.pipeline.control import ControlChannel
from kvbridge.pipeline.log import ABORT, FINISH, REUSE, ROUTE, LogEntry
from kvbridge.pipeline.metrics import RankRecorder

log = logging.getLogger("kvbridge.transfer")


def revocation_key(room: int) -> str:
    """The consensus key (PREFILL_TRANSFERRED) under which every rank reports `room` revoked: never a
    request's rid (a space is not one of a rid's characters, common/limits.py RID_CHARS)."""
    return f"revoked {room}"


@dataclass
class Route:
    """Where one request's KV goes, as the decode node registered it."""

    rid: str
    room: int  # pairing key
    backend: str  # the transfer backend the decode node chose
    page_ids: list[int]  # destination pages, in token order (page_ids[i] holds prompt page held + i)
    held: int = 0  # the prompt's first pages, which the decode node holds already: not pushed
    finishing: bool = False  # every push is queued: waiting for TransferDone acknowledgements
    routed_s: float = field(default_factory=time.perf_counter)  # when this rank learned the route
    doomed: bool = False  # fault injection: this rank fails the request's transfer


@dataclass
class Unrouted:
    """What this rank computed of a request whose route is not known yet."""

    table: list[int]  # its page table as of the last chunk
    end: int  # prompt tokens in those pages
    done: bool = False  # the prompt is computed (the first token sampled, on the last rank)
    first_token: int | None = None  # the last rank: sampled, sent with the first pushes
    first_logprob: object = None  # and its kvbridge.v1.TokenLogprob (the request asked for logprobs)


class PrefillAgent(KVAgent):
    def __init__(self, rank: int, is_last: bool, pool: KVPool, chan: ControlChannel, recorder: RankRecorder):
        self.rank, self.is_last, self.pool, self.chan = rank, is_last, pool, chan
        self.page_size = pool.page_size
        self.routes: dict[str, Route] = {}  # rid -> route, while the request transfers
        self.unrouted: dict[str, Unrouted] = {}  # rid -> what was computed before its route
        self.senders: dict[str, object] = {}  # backend name -> its Sender, made on first use
        self.reused: set[str] = set()  # rids whose next chunk starts past cached pages (REUSE): pushed from page 0
        self.recorder = recorder
        self.faults = faults.current()
        # bytes of one page of this rank's layers
        self.page_bytes = pool.buffer[0].numel() * pool.buffer.element_size()

    def _sender(self, backend: str):
        if backend not in self.senders:
            self.senders[backend] = make_sender(backend, self.pool, self.rank, on_change=self._on_change)
        return self.senders[backend]

    # ---------------------------------------------------------------- decisions

    def on_decision(self, d: LogEntry) -> None:
        if d.kind == ROUTE:
            r = d.info
            route = Route(d.rid, r.room, r.backend, list(r.page_ids), r.held_pages)
            route.doomed = self.faults.fail_transfer()
            self.routes[d.rid] = route
            self.chan.set_local(Stream.PREFILL_TRANSFERRED, d.rid, LocalStatus.PENDING)
            trace = self.recorder.trace_of(d.rid)
            self._sender(route.backend).connect(route.room, r.decode, route.page_ids, r.secret, d.rid, trace)
            done = self.unrouted.pop(d.rid, None)
            if done is not None and self._push(route, done.table, 0, done.end, done.done) and done.done:
                if self.is_last:
                    sender = self._sender(route.backend)
                    sender.send_first_token(route.room, done.first_token, done.end, done.first_logprob)
                self._finish(route, done.end)
        elif d.kind == REUSE:
            self.reused.add(d.rid)
        elif d.kind in (FINISH, ABORT):
            self.unrouted.pop(d.rid, None)
            self.reused.discard(d.rid)
            route = self.routes.pop(d.rid, None)
            if route is None:
                return
            sender = self._sender(route.backend)
            if d.kind == FINISH:  # (every rank's pushes landed: nothing of the room is left to write)
                sender.forget(route.room)
                return
            room = route.room
            sender.abort(room, "aborted by the prefill node")
            sender.revoke(room, then=lambda: self._revoked(room))

    # ---------------------------------------------------------------- compute

    def after_forward(self, batch: ForwardBatch) -> None:
        for rid, start, q_len, table, sample in zip(
            batch.rids, batch.starts, batch.q_lens, batch.page_tables, batch.sample
        ):
            end = start + q_len
            if rid in self.reused:  # its first chunk: the cached pages before it go too
                self.reused.discard(rid)
                start = 0
            route = self.routes.get(rid)
            if route is None:  # pushed once the route is known
                self.unrouted[rid] = Unrouted(list(table), end, done=sample)
            elif self._push(route, table, start, end, sample) and sample and not self.is_last:
                self._finish(route, end)  # (the last rank finishes after sending the first token)

    def _push(self, route: Route, table, start: int, end: int, final: bool) -> bool:
        """Queue the pages holding prompt tokens [start, end), but those the decode node holds and,
        unless the prompt ends here (`final`), a last page the next chunk still writes to (it goes
        with that chunk: no page is pushed twice); False when the room failed instead."""
        ps = self.page_size
        first, last = max(start // ps, route.held), (end - 1) // ps + 1 if final else end // ps
        sender = self._sender(route.backend)
        if route.doomed:
            sender.abort(route.room, INJECTED)
            return False
        if first >= last:
            return True
        try:
            if last - route.held > len(route.page_ids):
                raise ValueError(f"the prompt needs {last} pages; {route.held} held + {len(route.page_ids)} registered")
            sender.push(route.room, table[first:last], route.page_ids[first - route.held : last - route.held], end)
        except (ValueError, KeyError) as e:  # a registration that does not fit the prompt
            sender.abort(route.room, str(e))
            return False
        self.recorder.pushed(self.rank, (last - first) * self.page_bytes)
        return True

    def on_sampled(self, batch: ForwardBatch, tokens: list[int], logprobs: list) -> None:
        sampled = [(rid, s + q) for rid, s, q, smp in zip(batch.rids, batch.starts, batch.q_lens, batch.sample) if smp]
        for (rid, num_tokens), token, lp in zip(sampled, tokens, logprobs):
            lp = None if lp is None else logprob_to_proto(lp)
            route = self.routes.get(rid)
            if route is not None:
                self._sender(route.backend).send_first_token(route.room, token, num_tokens, lp)
                self._finish(route, num_tokens)
            elif rid in self.unrouted:
                self.unrouted[rid].first_token, self.unrouted[rid].first_logprob = token, lp

    def _finish(self, route: Route, num_tokens: int) -> None:
        route.finishing = True
        if self.faults.lose_notice():
            log_event(
                log, "fault", logging.WARNING, rid=route.rid, room=route.room, rank=self.rank, fault="drop_notice"
            )
            return
        self._sender(route.backend).finish(route.room, num_tokens)

    # ---------------------------------------------------------------- sender thread

    def _on_change(self, change: StatusChange) -> None:
        rid = change.rid
        if change.state == KVPoll.SUCCESS:
            route = self.routes.get(rid)
            if route is not None:
                pushed = self._sender(route.backend).push_seconds(route.room)
                self.recorder.transfer_done(self.rank, time.perf_counter() - route.routed_s, pushed)
                self._log_push(route, pushed)
            self.faults.report_done(lambda: self.chan.set_local(Stream.PREFILL_TRANSFERRED, rid, LocalStatus.READY))
        elif change.state == KVPoll.FAILED:
            self._log_failure(rid, change.room, change.reason)
            self.recorder.transfer_failed(self.rank, change.reason)
            self.chan.set_local(Stream.PREFILL_TRANSFERRED, rid, LocalStatus.FAILED)

    def _revoked(self, room: int) -> None:
        """No write into `room` is under way on this rank, nor will start (the loop's or the sender's thread)."""
        self.recorder.room_revoked(self.rank)
        self.chan.set_local(Stream.PREFILL_TRANSFERRED, revocation_key(room), LocalStatus.READY)

    def holding(self) -> int:
        return len(self.routes) + len(self.unrouted)

    def close(self) -> None:
        """Every room dropped first: a rank whose front died writes nothing more while it exits."""
        for route in list(self.routes.values()):  # (the rank's loop may still run: see pipeline/group.py)
            self._sender(route.backend).revoke(route.room)
        for sender in self.senders.values():
            sender.close()

    def _log_push(self, route: Route, seconds: float) -> None:
        """One line per rank and request: what this rank pushed, and how fast the push itself went."""
        nbytes = len(route.page_ids) * self.page_bytes
        fields = {"rank": self.rank, "backend": route.backend, "pages": len(route.page_ids), "bytes": nbytes}
        fields |= {"push_s": round(seconds, 6), "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds else 0.0}
        log_event(log, "kv_push", rid=route.rid, room=room_tag(route.room), **fields)

    def _log_failure(self, rid: str, room: int, reason: str) -> None:
        log_event(log, "transfer_failed", logging.WARNING, rid=rid, room=room_tag(room), rank=self.rank, reason=reason)
