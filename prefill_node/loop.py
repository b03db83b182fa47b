"""Rank 0 of a prefill node: the colocated loop plus two queues after it.

    scheduler (chunked prefill, at once) --(first token sampled)--> bootstrap queue, until the
    decode node's registration arrived (a ROUTE decision) --> inflight queue --(consensus
    TRANSFERRED)--> pages freed, response

Registration overlaps prefill: a request is scheduled as soon as it arrives, and the decode
node's registration (where its KV goes) may come at any point. Each rank pushes what it
computed before the route as soon as it learns it, and every later chunk right after its
forward; the last rank holds the first token until then. A failure on any rank (consensus
FAILED) or an abort ends the request on every rank.
"""

from __future__ import annotations

import time
from dataclasses import replace

from consensus import Stream as S
from consensus import Verdict
from engine.request import Request
from pipeline.control import ControlChannel
from pipeline.log import ABORT, ADMIT, FINISH, ROUTE
from pipeline.messages import Abort, Add, Answer, Register, Shutdown
from pipeline.rank0 import Rank0Loop

TIMEOUT_CHECK_S = 0.1  # how often timeouts are looked for


class PrefillLeader(Rank0Loop):
    role = "prefill"

    def __init__(self, *args, chan: ControlChannel, **kwargs):
        super().__init__(*args, **kwargs)
        self.chan = chan
        self.scheduler.hold_pages_on_finish = True  # pages live until every rank's pushes landed
        self.unrouted: set[str] = set()  # rids whose registration has not arrived (any phase)
        self.bootstrap: dict[str, Request] = {}  # prefilled (first token out) and still unrouted
        self.rooms: dict[int, str] = {}  # room -> rid of every live request (one request per room)
        self.registrations: dict[int, tuple[float, dict]] = {}  # room -> (arrival, registration) without a request
        self.inflight_kv: dict[str, Request] = {}  # first token sampled, KV pushes not yet agreed done
        # agreed done before rank 0 post-processed the first token (its pushes can land that fast)
        self.transferred_early: set[str] = set()
        self.inflight_since: dict[str, float] = {}  # rid -> when it entered inflight_kv
        self._next_check = 0.0

    # ---------------------------------------------------------------- inputs

    def _admit_new(self, req: Request, add: Add) -> None:
        # a prefill node samples the first token only (index 0: held back from EOS when min_tokens > 0)
        req.params = replace(req.params, max_new_tokens=1, min_tokens=min(req.params.min_tokens, 1))
        room = add.room
        if room in self.rooms:  # the registration for it would route this request's KV to another's pages
            req.room, req.finish_reason = room, "error"
            super()._retire(req, ABORT, error=f"room {room} is in use by another request", code="ALREADY_EXISTS")
            return
        self.unrouted.add(req.rid)
        self.rooms[room] = req.rid
        req.room = room
        if room in self.registrations:
            self._route(req, self.registrations.pop(room)[1])
        self.scheduler.add(req)

    def phase_of(self, req: Request) -> str:
        if req.rid in self.bootstrap:
            return "bootstrap"
        return "transferring" if req.rid in self.inflight_kv else super().phase_of(req)

    def queues(self) -> dict[str, list[str]]:
        s = self.scheduler
        return {
            "bootstrap": list(self.bootstrap),
            "waiting": [r.rid for r in s.waiting],
            "running": [r.rid for r in s.running],
            "inflight": list(self.inflight_kv),
        }

    def transfers_in_flight(self) -> int:
        return len(self.inflight_kv)

    def handle(self, msg) -> bool:
        match msg:
            case Register(room, registration, token):
                self.outbox.put(Answer(token, self._register(room, registration)))
            case Abort(rid, reason) if rid in self.requests:
                self._fail(self.requests[rid], "abort", reason or "aborted")
            case Shutdown():
                for req in list(self.requests.values()):
                    self._fail(req, "abort", "the prefill node is shutting down")
                self.stopping = True
            case _:
                return False
        return True

    def _register(self, room: int, registration: dict) -> dict:
        """A decode node's registration of `room`: routes its request, or waits for it; the verdict."""
        rid = self.rooms.get(room)
        if rid in self.unrouted:
            self._route(self.requests[rid], registration)
        elif rid is not None or room in self.registrations:  # a second registration would redirect its KV
            return {"code": "ALREADY_EXISTS", "error": f"room {room} is registered already"}
        elif len(self.registrations) >= self.scheduler.config.max_pending_requests:
            return {"code": "RESOURCE_EXHAUSTED", "error": f"{len(self.registrations)} rooms wait for their requests"}
        else:
            self.registrations[room] = (time.perf_counter(), registration)
        return {"code": "", "error": ""}

    def _route(self, req: Request, registration: dict) -> None:
        """Every rank learns where the KV goes (a ROUTE decision), connects and pushes what it has."""
        req.peer = registration.get("decode_addr", "")
        self.unrouted.discard(req.rid)
        if not req.announced:  # registered before its first chunk ran
            req.announced = True
            self._decide(ADMIT, req.rid, replace(req.params, seed=req.seed))
        self._decide(ROUTE, req.rid, info=registration)
        if self.bootstrap.pop(req.rid, None) is not None:  # prefilled already: its pushes start now
            self._await_transfer(req)

    def status(self) -> dict:
        st = super().status()
        st["queues"].update(bootstrap=len(self.bootstrap), inflight=len(self.inflight_kv))
        return st

    # ---------------------------------------------------------------- consensus

    def undecided(self) -> bool:
        return self.chan.has_changes

    def _tick(self) -> None:
        for d in self.chan.take_decisions():
            req = self.requests.get(d.rid)
            if req is None:
                continue
            if d.verdict == Verdict.READY and d.stream == S.PREFILL_TRANSFERRED:
                if d.rid in self.inflight_kv:
                    del self.inflight_since[d.rid]
                    self._transferred(self.inflight_kv.pop(d.rid))
                else:
                    self.transferred_early.add(d.rid)
            elif d.verdict in (Verdict.FAILED, Verdict.ABORTED):
                self._fail(req, "error", "the KV transfer failed on a prefill rank")
        self._expire()

    def _expire(self) -> None:
        """Timeouts, checked at most every TIMEOUT_CHECK_S: no registration, or a hand-off that hangs."""
        now = time.perf_counter()
        if now < self._next_check:
            return
        self._next_check = now + TIMEOUT_CHECK_S
        config = self.scheduler.config
        for room, (t, _) in list(self.registrations.items()):  # a registration whose Prefill call never came
            if now - t > config.bootstrap_timeout_s:
                del self.registrations[room]
        unrouted = [self.requests[rid] for rid in self.unrouted]
        for req in [r for r in unrouted if now - r.arrival_s > config.bootstrap_timeout_s]:
            why = f"the decode node did not register room {req.room} within {config.bootstrap_timeout_s:g} s"
            self._fail(req, "error", why, code="DEADLINE_EXCEEDED", timeout="bootstrap")
        for rid, since in list(self.inflight_since.items()):
            if now - since > config.transfer_timeout_s:
                why = f"the KV transfer did not finish within {config.transfer_timeout_s:g} s of the first token"
                self._fail(self.inflight_kv[rid], "error", why, code="DEADLINE_EXCEEDED", timeout="transfer")

    # ---------------------------------------------------------------- endings

    def _retire(self, req: Request, kind: str, **event) -> None:
        if kind == FINISH and req.finish_reason in ("length", "stop"):
            if req.rid in self.unrouted:  # its first token is out; where its KV goes is not known yet
                self.bootstrap[req.rid] = req
                self._set_phase(req, "bootstrap")
            elif req.rid in self.transferred_early:
                self.transferred_early.discard(req.rid)
                self._transferred(req)
            else:
                self._await_transfer(req)
            return
        self._release_room(req)
        super()._retire(req, kind, **event)

    def _await_transfer(self, req: Request) -> None:
        """Its first token is out and its route known: its pages wait for every rank's pushes."""
        self.inflight_kv[req.rid] = req
        self.inflight_since[req.rid] = time.perf_counter()
        self._set_phase(req, "transferring")

    def _transferred(self, req: Request) -> None:
        """Every rank's pushes landed: the pages are free again and the request is done here."""
        self._release_room(req)
        pages = len(req.page_table.pages)
        self.scheduler.release(req)
        super()._retire(req, FINISH, kv_bytes=pages * self._page_bytes_all_layers())

    def _page_bytes_all_layers(self) -> int:
        """Bytes of one KV page over every layer of the model (all ranks together)."""
        pool = self.pool
        per_layer = pool.buffer[0].numel() * pool.buffer.element_size() // (pool.layer_end - pool.layer_start)
        return per_layer * self.stage.config.num_hidden_layers

    def _release_room(self, req: Request) -> None:
        if self.rooms.get(req.room) == req.rid:  # (a request refused for another's room never held it)
            del self.rooms[req.room]

    def fail_request(self, req: Request, error: str, code: str) -> None:
        self._fail(req, "error", error, code)

    def _fail(self, req: Request, reason: str, error: str, code: str = "", **event) -> None:
        self.unrouted.discard(req.rid)
        self.bootstrap.pop(req.rid, None)
        self._release_room(req)
        self.inflight_kv.pop(req.rid, None)
        self.inflight_since.pop(req.rid, None)
        self.transferred_early.discard(req.rid)
        self.chan.abort(req.rid)
        self.scheduler.finish(req, "abort")
        self.scheduler.release(req)
        req.finish_reason = reason
        req.finish_s = time.perf_counter()
        code = code or ("UNAVAILABLE" if reason == "error" else "CANCELLED")
        super()._retire(req, ABORT, error=error, code=code, **event)
