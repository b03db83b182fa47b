"""Rank 0 of a decode node: the colocated loop plus two queues in front of it.

    prealloc queue --(pages for the prompt + a reserve; every rank expects the room:
    consensus PREALLOCATED)--> registered with the prefill node (by the front)
    --(every rank holds its layers' pages and the first token arrived: consensus
    TRANSFERRED)--> decoding, as a prebuilt request (no prefill recomputation)

A failure on any rank (consensus FAILED), a failed registration, or an abort ends the
request on every rank and frees its pages.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from consensus import Stream as S
from consensus import Verdict
from engine.request import Request
from engine.scheduler import Scheduler
from pipeline.control import ControlChannel
from pipeline.log import ABORT, ADMIT, FINISH, RESUME, RETRACT
from pipeline.messages import Abort, Add, Fail, PeerDown, Preallocated, Shutdown, Token
from pipeline.rank0 import Rank0Loop

TIMEOUT_CHECK_S = 0.1  # how often timeouts are looked for
_AWAITING_KV = ("prealloc", "transferring")  # phases that still need the prefill node
QUARANTINE_S = 2.0  # pages of a hand-off that failed rest this long before reuse (late writes land harmlessly)


class DecodeScheduler(Scheduler):
    """Counts the pages of preallocated requests (outside the running list) as held, and retracts
    instead of preempting: out of pages, the newest running request's KV goes to host memory
    (every rank copies its layers out, in decision order) and its pages are freed at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.transfer: dict[str, Request] = {}  # preallocated: pages reserved, KV on its way
        self.resuming: dict[str, Request] = {}  # new pages given, KV being copied back on every rank
        self.on_retract: Callable[[Request, list[int]], None] = lambda req, pages: None
        self.quarantined: Callable[[], list[Request]] = list  # the leader's quarantined requests

    def reserved(self) -> list[Request]:
        return [*self.transfer.values(), *self.resuming.values(), *self.quarantined()]

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        pages, req.page_table.pages = req.page_table.pages, []
        self.allocator.free(req.rid, pages)
        self.on_retract(req, pages)


class DecodeLeader(Rank0Loop):
    role = "decode"

    def __init__(self, *args, chan: ControlChannel, receiver, reserve_tokens: int = 64, **kwargs):
        super().__init__(*args, **kwargs)
        self.chan = chan
        self.receiver = receiver  # rank 0's KV receiver: where the first token arrives
        self.reserve_tokens = reserve_tokens  # free room kept for decoding when preallocating
        self.prealloc: deque[Request] = deque()  # waiting for pages
        self.extras: dict[str, Add] = {}  # rid -> its request message (room, prefill layout ranges, backend)
        self.registered_at: dict[str, float] = {}  # rid -> when every rank expected its pages
        self.retracted: deque[Request] = deque()  # KV in host memory, waiting for pages (oldest first)
        self.admitted_at: dict[str, float] = {}  # rid -> when its pages were reserved (transfer timeout)
        self.quarantine: dict[str, tuple[float, Request]] = {}  # rid of a failed hand-off -> (free at, it)
        self._next_check = 0.0
        self.scheduler.on_retract = self._retract
        self.scheduler.quarantined = lambda: [req for _, req in self.quarantine.values()]

    # ---------------------------------------------------------------- inputs

    def _admit_new(self, req: Request, add: Add) -> None:
        room = add.room
        if any(r.room == room for r in self.requests.values() if r is not req):
            req.room, req.finish_reason = room, "error"
            super()._retire(req, ABORT, error=f"room {room} is in use by another request", code="ALREADY_EXISTS")
            return
        req.room = room
        req.peer = add.peer
        self.extras[req.rid] = add
        self.prealloc.append(req)

    def handle(self, msg) -> bool:
        match msg:
            case Fail(rid, code, error) if rid in self.requests:
                self._fail(self.requests[rid], error, code)
            case PeerDown(addr):  # the prefill node died: requests still waiting for its KV cannot get it
                waiting = [r for r in self.requests.values() if r.peer == addr and self.phase_of(r) in _AWAITING_KV]
                for req in waiting:
                    self._fail(req, f"the prefill node {addr} is unreachable", "UNAVAILABLE")
            case Abort(rid, reason) if rid in self.requests:
                self._fail(self.requests[rid], reason or "aborted", "CANCELLED", reason="abort")
            case Shutdown():
                for req in list(self.requests.values()):
                    self._fail(req, "the decode node is shutting down", "UNAVAILABLE", reason="abort")
                for _, req in self.quarantine.values():  # nothing is handed out again: no late write can matter
                    self.scheduler.release(req)
                self.quarantine.clear()
                self.stopping = True
            case Fail():
                pass  # the request ended already
            case _:
                return False
        return True

    def status(self) -> dict:
        st = super().status()
        st["queues"].update(
            prealloc=len(self.prealloc), transfer=len(self.scheduler.transfer), retracted=len(self.retracted)
        )
        return st

    def queues(self) -> dict[str, list[str]]:
        s = self.scheduler
        return {
            "prealloc": [r.rid for r in self.prealloc],
            "transfer": list(s.transfer),
            "retracted": [r.rid for r in self.retracted],
            "resuming": list(s.resuming),
            "waiting": [r.rid for r in s.waiting],
            "running": [r.rid for r in s.running],
        }

    def resting_owners(self) -> set[str]:
        return set(self.quarantine)

    def transfers_in_flight(self) -> int:
        return len(self.scheduler.transfer)

    def phase_of(self, req: Request) -> str:
        if req.rid in self.extras:
            return "prealloc"
        if req.rid in self.scheduler.transfer:
            return "transferring"
        if req in self.retracted or req.rid in self.scheduler.resuming:
            return "retracted"
        return "waiting" if req in self.scheduler.waiting else "decoding"

    # ---------------------------------------------------------------- queues

    def undecided(self) -> bool:
        return self.chan.has_changes

    def _tick(self) -> None:
        for d in self.chan.take_decisions():
            req = self.requests.get(d.rid)
            if req is None:
                continue
            if d.verdict == Verdict.READY and d.stream == S.DECODE_PREALLOCATED:
                # every rank expects the room: the front may now register it with the prefill node
                self.registered_at[req.rid] = time.perf_counter()
                self.outbox.put(Preallocated(req.rid, tuple(req.page_table.pages)))
            elif d.verdict == Verdict.READY and d.stream == S.DECODE_TRANSFERRED:
                self._join(req)
            elif d.verdict == Verdict.READY and d.stream == S.DECODE_RETRACTED:
                del self.scheduler.resuming[req.rid]  # every rank has its KV back
                self.scheduler.running.append(req)
                self._set_phase(req, "decoding")
            elif d.verdict in (Verdict.FAILED, Verdict.ABORTED):
                self._fail(req, "the KV transfer failed on a decode rank", "UNAVAILABLE")
        self._release_quarantined()
        self._resume()
        self._preallocate()
        self._expire()

    def _release_quarantined(self) -> None:
        now = time.perf_counter()
        for rid, (at, req) in list(self.quarantine.items()):
            if now >= at:
                del self.quarantine[rid]
                self.scheduler.release(req)

    def _expire(self) -> None:
        """Timeouts, checked at most every TIMEOUT_CHECK_S: no pages in time, or a hand-off that hangs."""
        now = time.perf_counter()
        if now < self._next_check:
            return
        self._next_check = now + TIMEOUT_CHECK_S
        config = self.scheduler.config
        for req in [r for r in self.prealloc if now - r.arrival_s > config.prealloc_timeout_s]:
            why = f"no KV pages for the request within {config.prealloc_timeout_s:g} s"
            self._fail(req, why, "RESOURCE_EXHAUSTED", timeout="prealloc")
        for rid, since in list(self.admitted_at.items()):
            if now - since > config.transfer_timeout_s:
                why = f"the KV cache did not arrive within {config.transfer_timeout_s:g} s"
                self._fail(self.scheduler.transfer[rid], why, "DEADLINE_EXCEEDED", timeout="transfer")

    def _retract(self, req: Request, pages: list[int]) -> None:
        """The scheduler freed a running request's pages: every rank copies them out first (the
        decision reaches each rank before any step that could reuse them)."""
        self._decide(RETRACT, req.rid, info={"pages": pages})
        self.retracted.append(req)
        self.metrics.retractions.inc()
        self._set_phase(req, "retracted", pages=len(pages))

    def _resume(self) -> None:
        """Retracted requests get pages back before new ones are preallocated (they are older)."""
        alloc = self.scheduler.allocator
        while self.retracted:
            req = self.retracted[0]
            need = req.page_table.num_pages_needed(req.num_computed)
            if not alloc.can_allocate(need + 1):  # and room to grow, or it would be retracted again at once
                return
            self.retracted.popleft()
            req.page_table.pages = alloc.allocate(req.rid, need)
            self.scheduler.resuming[req.rid] = req
            self._decide(RESUME, req.rid, info={"pages": list(req.page_table.pages)})
            self._set_phase(req, "resuming")

    def _preallocate(self) -> None:
        alloc, ps = self.scheduler.allocator, self.pool.page_size
        while self.prealloc:
            req = self.prealloc[0]
            need = req.page_table.num_pages_needed(len(req.prompt_ids))
            reserve = -(-min(self.reserve_tokens, req.params.max_new_tokens) // ps)
            reserve = min(reserve, alloc.num_pages - need)  # never more than the pool: it would wait for ever
            if not alloc.can_allocate(need + reserve):
                return
            self.prealloc.popleft()
            req.page_table.pages = alloc.allocate(req.rid, need)
            self.scheduler.transfer[req.rid] = req
            self.admitted_at[req.rid] = time.perf_counter()
            extra = self.extras.pop(req.rid)
            req.announced = True
            info = {
                "room": req.room,
                "page_ids": list(req.page_table.pages),
                "sources": [list(s) for s in extra.sources],
                "backend": extra.backend,
                "secret": extra.secret,
                "first_sample_index": 1,  # the prefill node sampled token 0
            }
            self._decide(ADMIT, req.rid, replace(req.params, seed=req.seed), info)
            self._set_phase(req, "transferring")

    def _join(self, req: Request) -> None:
        """The request's KV is here on every rank: it starts decoding after its first token."""
        del self.scheduler.transfer[req.rid]
        del self.admitted_at[req.rid]
        token, _ = self.receiver.first_token(req.room)
        vocab = self.stage.config.vocab_size
        if not 0 <= token < vocab:  # from the network: a broken peer must not crash the model
            self._fail(
                req, f"the prefill node sent first token {token}, outside the vocabulary [0, {vocab})", "DATA_LOSS"
            )
            return
        req.num_computed = len(req.prompt_ids)
        req.num_sampled = 1
        req.output_ids.append(token)
        req.first_token_s = time.perf_counter()
        kv_seconds = req.first_token_s - self.registered_at.pop(req.rid, req.first_token_s)
        self.outbox.put(Token(req.rid, token, 0, kv_seconds))
        self.scheduler.add_prebuilt(req)
        self._set_phase(req, "decoding", kv_seconds=round(kv_seconds, 6))
        reason = self.scheduler.stop_reason(req, token)
        if reason:  # the first token already ends it (EOS, max_new_tokens == 1, a stop string)
            self.scheduler.conclude(req, reason, req.first_token_s)
            self._retire(req, FINISH)

    # ---------------------------------------------------------------- endings

    def _retire(self, req: Request, kind: str, **event) -> None:
        if req in self.retracted:  # its last token was in flight when it was retracted
            self.retracted.remove(req)
        if self.scheduler.resuming.pop(req.rid, None) is not None:
            self.scheduler.release(req)
        super()._retire(req, kind, **event)

    def fail_request(self, req: Request, error: str, code: str) -> None:
        self._fail(req, error, code)

    def _fail(self, req: Request, error: str, code: str, reason: str = "error", **event) -> None:
        if req in self.prealloc:
            self.prealloc.remove(req)
        if req in self.retracted:
            self.retracted.remove(req)
        self.scheduler.resuming.pop(req.rid, None)
        self.extras.pop(req.rid, None)
        receiving = self.scheduler.transfer.pop(req.rid, None) is not None
        self.admitted_at.pop(req.rid, None)
        self.registered_at.pop(req.rid, None)
        self.chan.abort(req.rid)
        self.scheduler.finish(req, "abort")
        if receiving and req.page_table.pages:
            # a prefill rank may be writing into these pages right now (shared memory, GPU IPC): they
            # are handed out again only after QUARANTINE_S, once every push that started has landed
            self.quarantine[req.rid] = (time.perf_counter() + QUARANTINE_S, req)
        else:
            self.scheduler.release(req)
        req.finish_reason = reason
        req.finish_s = time.perf_counter()
        self._retire(req, ABORT, error=error, code=code, **event)
