"""A prefill rank's part of the hand-off: connect to the decode ranks a request's KV goes
to, push the pages each prefill chunk wrote, and report to consensus.

Consensus streams it feeds: PREFILL_BOOTSTRAPPED (READY once this rank's connections to
the overlapping decode ranks are up) and PREFILL_TRANSFERRED (READY once every push and
notice of the request landed). Its sender reports state changes from its own thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from consensus import LocalStatus, Stream
from engine import faults
from engine.batch import ForwardBatch
from engine.faults import INJECTED
from engine.kv_pool import KVPool
from engine.pp.agent import KVAgent
from engine.pp.control import ControlChannel
from engine.pp.wire import ABORT, FINISH, ROUTE, Decision
from kv_transfer import KVPoll, StatusChange, make_sender
from kvbridge.convert import layout_from_dict
from kvbridge.logs import log_event
from kvbridge.metrics import failure_reason, rank_metrics

log = logging.getLogger("kvbridge.transfer")


@dataclass
class Route:
    """Where one request's KV goes, as the decode node registered it."""

    rid: str
    room: int  # pairing key
    backend: str  # the transfer engine the decode node chose
    page_ids: list[int]  # destination pages, in token order (page i holds tokens [i*ps, (i+1)*ps))
    finishing: bool = False  # every push is queued: waiting for TransferDone acknowledgements
    routed_s: float = field(default_factory=time.perf_counter)  # when this rank learned the route
    doomed: bool = False  # fault injection: this rank fails the request's transfer


class PrefillAgent(KVAgent):
    def __init__(self, rank: int, is_last: bool, pool: KVPool, chan: ControlChannel):
        self.rank, self.is_last, self.pool, self.chan = rank, is_last, pool, chan
        self.page_size = pool.page_size
        self.routes: dict[str, Route] = {}  # rid -> route, while the request transfers
        self.senders: dict[str, object] = {}  # backend name -> its Sender, made on first use
        self.metrics = rank_metrics()
        self.faults = faults.current()
        self.label = str(rank)
        # bytes of one page of this rank's layers
        self.page_bytes = pool.buffer[0].numel() * pool.buffer.element_size()

    def _sender(self, backend: str):
        if backend not in self.senders:
            self.senders[backend] = make_sender(backend, self.pool, self.rank, on_change=self._on_change)
        return self.senders[backend]

    # ---------------------------------------------------------------- decisions

    def on_decision(self, d: Decision) -> None:
        if d.kind == ROUTE:
            info = d.info
            route = Route(d.rid, info["room"], info["backend"], list(info["page_ids"]))
            route.doomed = self.faults.fail_transfer()
            self.routes[d.rid] = route
            self.chan.set_local(Stream.PREFILL_BOOTSTRAPPED, d.rid, LocalStatus.PENDING)
            self._sender(route.backend).connect(route.room, layout_from_dict(info["decode"]), route.page_ids, d.rid)
        elif d.kind in (FINISH, ABORT) and d.rid in self.routes:
            route = self.routes.pop(d.rid)
            sender = self._sender(route.backend)
            if d.kind == ABORT:
                sender.abort(route.room, "aborted by the prefill node")
            sender.forget(route.room)

    # ---------------------------------------------------------------- compute

    def after_forward(self, batch: ForwardBatch) -> None:
        for rid, start, q_len, table, sample in zip(
            batch.rids, batch.starts, batch.q_lens, batch.page_tables, batch.sample
        ):
            route = self.routes.get(rid)
            if route is None:
                continue
            end = start + q_len
            first, last = start // self.page_size, (end - 1) // self.page_size + 1
            sender = self._sender(route.backend)
            if route.doomed:
                sender.abort(route.room, INJECTED)
                continue
            try:
                sender.push(route.room, table[first:last], route.page_ids[first:last], end)
                self.metrics.transfer_bytes.labels(self.label).inc((last - first) * self.page_bytes)
                if sample and not self.is_last:  # the last rank finishes after sending the first token
                    self._finish(route, end)
            except (ValueError, KeyError) as e:  # a registration that does not fit the prompt
                sender.abort(route.room, str(e))

    def on_sampled(self, batch: ForwardBatch, tokens: list[int]) -> None:
        sampled = [(rid, s + q) for rid, s, q, smp in zip(batch.rids, batch.starts, batch.q_lens, batch.sample) if smp]
        for (rid, num_tokens), token in zip(sampled, tokens):
            route = self.routes.get(rid)
            if route is not None:
                self._sender(route.backend).send_first_token(route.room, token, num_tokens)
                self._finish(route, num_tokens)

    def _finish(self, route: Route, num_tokens: int) -> None:
        route.finishing = True
        self.chan.set_local(Stream.PREFILL_TRANSFERRED, route.rid, LocalStatus.PENDING)
        if self.faults.lose_notice():
            log_event(
                log, "fault", logging.WARNING, rid=route.rid, room=route.room, rank=self.rank, fault="drop_notice"
            )
            return
        self._sender(route.backend).finish(route.room, num_tokens)

    # ---------------------------------------------------------------- sender thread

    def _on_change(self, change: StatusChange) -> None:
        rid = change.rid
        if change.state == KVPoll.WAITING_FOR_INPUT:
            self.chan.set_local(Stream.PREFILL_BOOTSTRAPPED, rid, LocalStatus.READY)
        elif change.state == KVPoll.SUCCESS:
            route = self.routes.get(rid)
            if route is not None:
                self.metrics.transfer_duration.labels(self.label).observe(time.perf_counter() - route.routed_s)
            self.faults.report_done(lambda: self.chan.set_local(Stream.PREFILL_TRANSFERRED, rid, LocalStatus.READY))
        elif change.state == KVPoll.FAILED:
            self._log_failure(rid, change.room, change.reason)
            self.metrics.transfer_failures.labels(self.label, failure_reason(change.reason)).inc()
            route = self.routes.get(rid)
            stream = Stream.PREFILL_TRANSFERRED if route and route.finishing else Stream.PREFILL_BOOTSTRAPPED
            self.chan.set_local(stream, rid, LocalStatus.FAILED)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()

    def _log_failure(self, rid: str, room: int, reason: str) -> None:
        log_event(log, "transfer_failed", logging.WARNING, rid=rid, room=room, rank=self.rank, reason=reason)
