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
from dataclasses import replace

from consensus import Stream as S
from consensus import Verdict
from engine.pp.control import ControlChannel
from engine.pp.leader import Leader
from engine.pp.wire import ABORT, ADMIT, FINISH
from engine.request import Request
from engine.scheduler import Scheduler


class DecodeScheduler(Scheduler):
    """Counts the pages of preallocated requests (outside the running list) as held."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.transfer: dict[str, Request] = {}  # preallocated: pages reserved, KV on its way

    def reserved(self) -> list[Request]:
        return list(self.transfer.values())


class DecodeLeader(Leader):
    def __init__(self, *args, chan: ControlChannel, receiver, reserve_tokens: int = 64, **kwargs):
        super().__init__(*args, **kwargs)
        self.chan = chan
        self.receiver = receiver  # rank 0's KV receiver: where the first token arrives
        self.reserve_tokens = reserve_tokens  # free room kept for decoding when preallocating
        self.prealloc: deque[Request] = deque()  # waiting for pages
        self.extras: dict[str, dict] = {}  # rid -> its room, prefill layout ranges, backend
        self.registered_at: dict[str, float] = {}  # rid -> when every rank expected its pages

    # ---------------------------------------------------------------- inputs

    def _admit_new(self, req: Request, extra: dict) -> None:
        req.room = int(extra["room"])
        self.extras[req.rid] = extra
        self.prealloc.append(req)

    def _handle(self, msg: tuple) -> None:
        op = msg[0]
        if op == "consensus":
            pass  # a wake-up: decisions are taken in _tick
        elif op == "fail" and msg[1] in self.requests:
            _, rid, code, error = msg
            self._fail(self.requests[rid], error, code)
        elif op == "abort" and msg[1] in self.requests:
            self._fail(self.requests[msg[1]], "aborted", "CANCELLED", reason="abort")
        elif op == "shutdown":
            for req in list(self.requests.values()):
                self._fail(req, "the decode node is shutting down", "UNAVAILABLE", reason="abort")
            self.stopping = True
        elif op != "fail":
            super()._handle(msg)

    def status(self, token: int) -> dict:
        st = super().status(token)
        st["queues"].update(prealloc=len(self.prealloc), transfer=len(self.scheduler.transfer))
        return st

    # ---------------------------------------------------------------- queues

    def _tick(self) -> None:
        for d in self.chan.take_decisions():
            req = self.requests.get(d.rid)
            if req is None:
                continue
            if d.verdict == Verdict.READY and d.stream == S.DECODE_PREALLOCATED:
                # every rank expects the room: the front may now register it with the prefill node
                self.registered_at[req.rid] = time.perf_counter()
                self.outbox.put({"event": "preallocated", "rid": req.rid, "page_ids": list(req.page_table.pages)})
            elif d.verdict == Verdict.READY and d.stream == S.DECODE_TRANSFERRED:
                self._join(req)
            elif d.verdict in (Verdict.FAILED, Verdict.ABORTED):
                self._fail(req, "the KV transfer failed on a decode rank", "UNAVAILABLE")
        self._preallocate()

    def _preallocate(self) -> None:
        alloc, ps = self.scheduler.allocator, self.pool.page_size
        while self.prealloc:
            req = self.prealloc[0]
            need = req.page_table.num_pages_needed(len(req.prompt_ids))
            reserve = -(-min(self.reserve_tokens, req.params.max_new_tokens) // ps)
            if not alloc.can_allocate(need + reserve):
                return
            self.prealloc.popleft()
            req.page_table.pages = alloc.allocate(req.rid, need)
            self.scheduler.transfer[req.rid] = req
            extra = self.extras.pop(req.rid)
            req.announced = True
            info = {
                "room": req.room,
                "page_ids": list(req.page_table.pages),
                "sources": extra["sources"],
                "backend": extra["backend"],
                "first_sample_index": 1,  # the prefill node sampled token 0
            }
            self._decide(ADMIT, req.rid, replace(req.params, seed=req.seed), info)

    def _join(self, req: Request) -> None:
        """The request's KV is here on every rank: it starts decoding after its first token."""
        del self.scheduler.transfer[req.rid]
        token, _ = self.receiver.first_token(req.room)
        req.num_computed = len(req.prompt_ids)
        req.num_sampled = 1
        req.output_ids.append(token)
        req.first_token_s = time.perf_counter()
        kv_seconds = req.first_token_s - self.registered_at.pop(req.rid, req.first_token_s)
        self.outbox.put({"event": "token", "rid": req.rid, "token": token, "index": 0, "kv_seconds": kv_seconds})
        self.scheduler.add_prebuilt(req)
        reason = self.scheduler.stop_reason(req, token)
        if reason:  # the first token already ends it (EOS, max_new_tokens == 1, a stop string)
            req.finish_s = req.first_token_s
            if self.scheduler.tokenizer is not None and not req.text:
                req.text = self.scheduler.tokenizer.decode(req.output_ids)
            self.scheduler.finish(req, reason)
            self._retire(req, FINISH)

    # ---------------------------------------------------------------- endings

    def _fail(self, req: Request, error: str, code: str, reason: str = "error") -> None:
        if req in self.prealloc:
            self.prealloc.remove(req)
        self.extras.pop(req.rid, None)
        self.scheduler.transfer.pop(req.rid, None)
        self.registered_at.pop(req.rid, None)
        self.chan.abort(req.rid)
        self.scheduler.finish(req, "abort")
        self.scheduler.release(req)
        req.finish_reason = reason
        req.finish_s = time.perf_counter()
        self._retire(req, ABORT, error=error, code=code)
