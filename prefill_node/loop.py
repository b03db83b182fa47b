"""Rank 0 of a prefill node: the colocated loop plus two queues around it.

    bootstrap queue --(D registered the room; consensus BOOTSTRAPPED)--> scheduler (chunked prefill)
    --(first token sampled)--> inflight queue --(consensus TRANSFERRED)--> pages freed, response

A failure on any rank (consensus FAILED) or an abort ends the request on every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from consensus import Stream as S
from consensus import Verdict
from engine.pp.control import ControlChannel
from engine.pp.leader import Leader
from engine.pp.wire import ABORT, ADMIT, FINISH, ROUTE
from engine.request import Request

log = logging.getLogger(__name__)

REGISTRATION_TTL_S = 120.0  # a registration whose Prefill call never came is dropped after this


class PrefillLeader(Leader):
    def __init__(self, *args, chan: ControlChannel, **kwargs):
        super().__init__(*args, **kwargs)
        self.chan = chan
        self.scheduler.hold_pages_on_finish = True  # pages live until every rank's pushes landed
        self.bootstrap: dict[str, Request] = {}  # waiting for the decode node's registration / consensus
        self.rooms: dict[int, str] = {}  # room -> rid of a request waiting in bootstrap
        self.registrations: dict[int, tuple[float, dict]] = {}  # room -> (arrival, registration) without a request
        self.inflight_kv: dict[str, Request] = {}  # first token sampled, KV pushes not yet agreed done
        # agreed done before rank 0 post-processed the first token (its pushes can land that fast)
        self.transferred_early: set[str] = set()

    # ---------------------------------------------------------------- inputs

    def _admit_new(self, req: Request, extra: dict) -> None:
        req.params = replace(req.params, max_new_tokens=1)  # a prefill node samples the first token only
        room = int(extra["room"])
        self.bootstrap[req.rid] = req
        self.rooms[room] = req.rid
        req.room = room
        if room in self.registrations:
            self._route(req, self.registrations.pop(room)[1])

    def _handle(self, msg: tuple) -> None:
        op = msg[0]
        if op == "register":
            _, room, registration = msg
            rid = self.rooms.get(room)
            if rid is None:
                self.registrations[room] = (time.monotonic(), registration)
            else:
                self._route(self.requests[rid], registration)
        elif op == "consensus":
            pass  # a wake-up: decisions are taken in _tick
        elif op == "abort" and msg[1] in self.requests:
            self._fail(self.requests[msg[1]], "abort", "aborted")
        elif op == "shutdown":
            for req in list(self.requests.values()):
                self._fail(req, "abort", "the prefill node is shutting down")
            self.stopping = True
        else:
            super()._handle(msg)

    def _route(self, req: Request, registration: dict) -> None:
        """Every rank learns where the KV goes (a ROUTE decision) and connects; consensus follows."""
        req.announced = True
        self._decide(ADMIT, req.rid, replace(req.params, seed=req.seed))
        self._decide(ROUTE, req.rid, info=registration)

    def status(self, token: int) -> dict:
        st = super().status(token)
        st["queues"].update(bootstrap=len(self.bootstrap), inflight=len(self.inflight_kv))
        return st

    # ---------------------------------------------------------------- consensus

    def _tick(self) -> None:
        for d in self.chan.take_decisions():
            req = self.requests.get(d.rid)
            if req is None:
                continue
            if d.verdict == Verdict.READY and d.stream == S.PREFILL_BOOTSTRAPPED and d.rid in self.bootstrap:
                del self.bootstrap[d.rid]
                self.rooms.pop(req.room, None)
                self.scheduler.add(req)
            elif d.verdict == Verdict.READY and d.stream == S.PREFILL_TRANSFERRED:
                if d.rid in self.inflight_kv:
                    self._transferred(self.inflight_kv.pop(d.rid))
                else:
                    self.transferred_early.add(d.rid)
            elif d.verdict in (Verdict.FAILED, Verdict.ABORTED):
                self._fail(req, "error", "the KV transfer failed on a prefill rank")
        now = time.monotonic()
        for room, (t, _) in list(self.registrations.items()):
            if now - t > REGISTRATION_TTL_S:
                del self.registrations[room]

    # ---------------------------------------------------------------- endings

    def _retire(self, req: Request, kind: str, **event) -> None:
        if kind == FINISH and req.finish_reason in ("length", "stop"):
            if req.rid in self.transferred_early:
                self.transferred_early.discard(req.rid)
                self._transferred(req)
            else:
                self.inflight_kv[req.rid] = req  # its first token is out; its pages wait for the pushes
            return
        super()._retire(req, kind, **event)

    def _transferred(self, req: Request) -> None:
        """Every rank's pushes landed: the pages are free again and the request is done here."""
        self.scheduler.release(req)
        super()._retire(req, FINISH)

    def _fail(self, req: Request, reason: str, error: str) -> None:
        self.bootstrap.pop(req.rid, None)
        self.rooms.pop(req.room, None)
        self.inflight_kv.pop(req.rid, None)
        self.transferred_early.discard(req.rid)
        self.chan.abort(req.rid)
        self.scheduler.finish(req, "abort")
        self.scheduler.release(req)
        req.finish_reason = reason
        req.finish_s = time.perf_counter()
        super()._retire(req, ABORT, error=error, code="UNAVAILABLE" if reason == "error" else "CANCELLED")
