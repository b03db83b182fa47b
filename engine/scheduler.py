"""Continuous batching for one node: which requests run this step, with which tokens and pages.

Each step: every running request that is decoding gets one token; then prompt chunks fill
the chunked-prefill budget, first for requests already prefilling, then for new
admissions from the waiting queue (FCFS). Pages are allocated as tokens are scheduled;
when decode runs out of pages the newest running request is preempted (pages freed,
recomputed later from its prompt and output so far, so its tokens do not change).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.batch import ForwardBatch
from engine.config import EngineConfig
from engine.pages import PageAllocator
from engine.request import Request


@dataclass
class ScheduledStep:
    batch: ForwardBatch
    requests: list[Request]  # in batch order
    sampled: list[Request]  # the requests whose logits come back, in row order


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator, max_context: int):
        self.config = config
        self.allocator = allocator
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: holds pages, in admission order

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> ScheduledStep | None:
        decodes = self._schedule_decodes()
        budget = self.config.chunked_prefill_size or 1 << 62
        chunks: list[tuple[Request, int]] = []
        for req in self.running:
            if budget and not req.is_decoding and req not in decodes:
                n = min(req.num_pending, budget)
                if not self._grow(req, req.num_computed + n):
                    break
                chunks.append((req, n))
                budget -= n
        while budget and self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            # admit only when the whole known sequence fits, so admission never starves decodes
            if not self.allocator.can_allocate(req.page_table.num_pages_needed(req.num_tokens)):
                break
            self.waiting.popleft()
            self.running.append(req)
            n = min(req.num_pending, budget)
            self._grow(req, req.num_tokens)
            chunks.append((req, n))
            budget -= n
        if not decodes and not chunks:
            return None
        return self._build(decodes, chunks)

    def _schedule_decodes(self) -> list[Request]:
        decodes = []
        for req in list(self.running):
            if req not in self.running or not req.is_decoding:
                continue
            while not self._grow(req, req.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            if req in self.running:
                decodes.append(req)
        return [r for r in decodes if r in self.running]

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = req.page_table.num_pages_needed(num_tokens)
        if not self.allocator.can_allocate(need):
            return False
        req.page_table.pages += self.allocator.allocate(req.rid, need)
        return True

    def _build(self, decodes: list[Request], chunks: list[tuple[Request, int]]) -> ScheduledStep:
        requests, starts, q_lens, input_ids, sample = [], [], [], [], []
        for req, n in [(r, 1) for r in decodes] + chunks:
            requests.append(req)
            starts.append(req.num_computed)
            q_lens.append(n)
            input_ids += req.all_ids[req.num_computed : req.num_computed + n]
            sample.append(req.num_computed + n == req.num_tokens)
        batch = ForwardBatch(
            rids=tuple(r.rid for r in requests),
            starts=tuple(starts),
            q_lens=tuple(q_lens),
            page_tables=tuple(tuple(r.page_table.pages) for r in requests),
            input_ids=tuple(input_ids),
            sample=tuple(sample),
        )
        return ScheduledStep(batch, requests, [r for r, s in zip(requests, sample) if s])

    def preempt(self, req: Request) -> None:
        """Free a running request's pages and requeue it first; it is recomputed on readmission."""
        self.running.remove(req)
        self.allocator.free(req.rid, req.page_table.pages)
        req.page_table.pages = []
        req.num_computed = 0
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            self.allocator.free(req.rid, req.page_table.pages)
            req.page_table.pages = []
        elif req in self.waiting:
            self.waiting.remove(req)

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        held = sum(len(r.page_table.pages) for r in self.running)
        if held != self.allocator.num_used:
            raise AssertionError(f"pages held by running requests ({held}) != pages used ({self.allocator.num_used})")
        if any(r.page_table.pages for r in self.waiting):
            raise AssertionError("a waiting request holds pages")
        rids = [r.rid for r in self.running] + [r.rid for r in self.waiting]
        if len(rids) != len(set(rids)):
            raise AssertionError(f"a request is queued twice: {len(rids)} entries, {len(set(rids))} distinct")
