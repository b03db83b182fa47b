"""Continuous batching for one node: which requests run next, with which tokens and pages.

Each step: every running request that is decoding gets one token; then prompt chunks fill
the chunked-prefill budget, first for requests already prefilling, then for new
admissions from the waiting queue (FCFS). Pages are allocated as tokens are scheduled;
when decode runs out of pages the newest running request is preempted: pages freed and
recomputed later from its prompt and output so far, so its tokens do not change
(`evict="recompute"`), or handed to the caller (`evict="retract"`: `take_evicted()`; a decode
node copies their KV to host memory instead of recomputing it).

With a prefix cache (engine/prefix_cache.py, on the allocator), admission starts a request at its
longest cached page-aligned prefix: those pages are shared, not computed, and at least the last
prompt token is always computed (its logits are sampled). Each page is indexed in the cache once
every token of it is scheduled: later microbatches run after it on every rank, so they may read it.

Choices i > 0 of an n > 1 request (`Request.parent`: choice 0) wait beside it (`forks`) until its
prompt is complete: its last chunk scheduled, or (a decode node) its KV arrived (`add_prebuilt`).
They then join the running requests at once (`_fork`), past FCFS and max_running_requests as their
choice 0 is already in, sharing its full prompt pages, cache or no cache, and compute only the rest
of the prompt (up to a page: its last, partial page is each choice's own, since each writes its own
tokens there); so choice 0 may end at its first token without taking its prompt along. A choice
whose choice 0 ends or is preempted before that is admitted as any request (its cached prefix).

While requests decode, `--decode-step-target-ms` bounds a step's prompt tokens (issue 41: a long
prompt's chunk batched with the decodes stalled each of them for the whole chunk): the chunks get only
what keeps the step's time within the target, priced by what this scheduler's steps measurably took
(`step_costs`, fed by `postprocess`; engine/chunking.py `DecodeBudget`), and at least
`--decode-step-min-prefill` tokens, so a prompt always progresses. With no request decoding, prompts
take the whole chunked-prefill budget. Chunking does not change a token: each row's attention is
computed alike however its prompt is cut.

A scheduled token counts as computed at once (`num_computed` advances when the batch is
built), so with pipeline parallelism the next chunk of a prompt can be scheduled while
the previous one is still in flight; a request whose next token is being sampled
(`awaiting_output`) is skipped until `postprocess` delivers it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvbridge.common import blocks
from kvbridge.common.text.detok import StopChecker
from kvbridge.common.text.tokenizer import Tokenizer
from kvbridge.engine.batch import ForwardBatch
from kvbridge.engine.chunking import DecodeBudget, StepAllowance, StepCosts
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.pages import PageAllocator
from kvbridge.engine.request import Phase, Request

logger = logging.getLogger(__name__)


class ChunkPolicy(Protocol):
    """How many prompt tokens to prefill next (engine/chunking.py `ChunkPlanner`)."""

    def next_chunk(self, history_len: int, remaining: int) -> int: ...


@dataclass
class ScheduledStep:
    batch: ForwardBatch
    requests: list[Request]  # in batch order
    sampled: list[Request]  # the requests whose logits come back, in row order
    decodes: int = 0  # rows that decode (one token each)
    prompt_tokens: int = 0  # the prompt chunks' tokens
    built_s: float = 0.0  # the scheduler's clock when it was built


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        allocator: PageAllocator,
        max_context: int,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: tuple[int, ...] = (),
        chunk_policy: ChunkPolicy | None = None,
        hold_finished: bool = False,
        evict: str = "recompute",
    ):
        """hold_finished: a request that finishes (stop, length) keeps its pages until release() (a
        prefill node's KV waits for its transfer). evict: what preemption does (module docstring)."""
        if evict not in ("recompute", "retract"):
            raise ValueError(f"evict must be recompute or retract, got {evict!r}")
        self.config = config
        self.allocator = allocator
        self.max_context = max_context
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.chunk_policy = chunk_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: holds pages, in admission order
        self.forks: dict[str, list[Request]] = {}  # choice 0's rid -> its choices waiting for its prompt
        # finished computing but still holding pages until release() (a prefill node's KV in transfer)
        self.held: dict[str, Request] = {}
        self.hold_finished, self.evict = hold_finished, evict
        self._evicted: list[tuple[Request, list[int]]] = []  # evict="retract": (request, the pages it had)
        # the role's say on a waiting request (None: every one may start): a prefill node keeps a
        # caller's unregistered requests within its share of the pool (prefill_node/role.py)
        self.admissible: Callable[[Request], bool] | None = None
        self.passes = 0  # schedule() calls so far
        # what steps took, from scheduling to tokens: prices a step for --decode-step-target-ms
        self.step_costs = StepCosts()
        self.clock: Callable[[], float] = time.perf_counter
        self._over_target_told = False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + sum(map(len, self.forks.values()))

    def add(self, req: Request) -> None:
        """Queue a new request: a choice whose choice 0 is live waits for its prompt (`forks`), or
        joins it at once when the prompt is in already."""
        parent = req.parent
        if parent is None or parent.finished:
            req.parent = None
            self.waiting.append(req)
        elif self._prompt_done(parent):
            self._fork(parent, [req])
        else:
            self.forks.setdefault(parent.rid, []).append(req)

    def forked(self) -> list[Request]:
        """Choices waiting for their choice 0's prompt."""
        return [r for rs in self.forks.values() for r in rs]

    def _prompt_done(self, parent: Request) -> bool:
        return parent in self.running and parent.num_computed >= len(parent.prompt_ids)

    def _fork(self, parent: Request, choices: list[Request]) -> None:
        """`parent`'s prompt is complete (scheduled, or here): these choices of it join the running
        requests, sharing its full prompt pages (those before its last prompt token), each with pages
        of its own for the rest; one that cannot get them waits as any request does."""
        ps = self.config.page_size
        for req in choices:
            shared = parent.page_table.pages[: (len(req.prompt_ids) - 1) // ps]
            need = req.page_table.num_pages_needed(req.num_tokens) - len(shared)
            if not self.allocator.can_take(need, shared):
                req.parent = None
                self.waiting.append(req)
                continue
            req.cached_tokens = self.reuse(req, shared, len(req.prompt_ids), lookup=False)
            self._grow(req, req.num_tokens)
            self.running.append(req)

    def _unfork(self, parent: Request) -> None:
        """`parent` ends or goes back to waiting before its prompt is in: its choices wait as any request."""
        for req in self.forks.pop(parent.rid, []):
            req.parent = None
            self.waiting.append(req)

    def schedule(self, max_decodes: int | None = None) -> ScheduledStep | None:
        self.passes += 1  # (lets `admissible` memoize what holds for one pass)
        decodes = self._schedule_decodes(max_decodes)
        budget = self.config.chunked_prefill_size or 1 << 62
        allowance = self.step_allowance(decodes)
        chunks: list[tuple[Request, int]] = []
        for req in self.running:
            if budget and req.has_prompt_left and not req.awaiting_output:
                n = self._chunk(req, budget, allowance)
                if not n:
                    break  # the step's time is spent (the decode budget): the others wait too
                if not self._grow(req, req.num_computed + n):
                    break
                chunks.append((req, n))
                budget -= n
                if allowance is not None:
                    allowance.spend(n)
        while budget and self.waiting and len(self.running) < self.config.max_running_requests:
            req = self._next_admissible()
            if req is None:
                break
            hit = self.cached_prefix(req)
            if allowance is not None and allowance.allowed() < 1:
                break  # the step's time is spent: it waits, in its place, for the next step
            # admit only when the whole known sequence fits, so admission never starves decodes
            if not self.allocator.can_take(req.page_table.num_pages_needed(req.num_tokens) - len(hit), hit):
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.cached_tokens = self.reuse(req, hit, len(req.prompt_ids))
            self._grow(req, req.num_tokens)
            n = self._chunk(req, budget, allowance)
            chunks.append((req, n))
            budget -= n
            if allowance is not None:
                allowance.spend(n)
        if not decodes and not chunks:
            return None
        return self._build(decodes, chunks)

    def _next_admissible(self) -> Request | None:
        """The first waiting request `admissible` lets in (the others keep their place); None when
        the first one waits for its token in flight (preempted meanwhile: it goes first)."""
        for req in self.waiting:
            if req.awaiting_output:
                return None
            if self.admissible is None or self.admissible(req):
                return req
        return None

    def cached_prefix(self, req: Request, full_hit: bool = False) -> list[int]:
        """The cached pages `req` may start from (none without a cache): its longest cached prefix
        of full blocks, leaving at least one token to compute unless `full_hit` (a decode node,
        which computes none of the prompt)."""
        cache = self.allocator.cache
        if cache is None or (req.params.prompt_logprobs is not None and not full_hit):
            return []  # (prompt logprobs need every prompt position computed)
        ps = self.config.page_size
        hashes = blocks.extend(req.block_hashes, req.all_ids, ps, req.cache_salt)
        limit = req.num_tokens // ps if full_hit else (req.num_tokens - 1) // ps
        return cache.match(hashes[:limit])

    def reuse(self, req: Request, pages: list[int], query_tokens: int, lookup: bool = True) -> int:
        """`req` (holding no pages) starts with these computed pages (cached, or its parent's): their
        tokens count as computed. Returns how many tokens that is. lookup: count it as the cache's."""
        self.allocator.share(req.rid, pages)
        req.page_table.pages = list(pages)
        req.indexed_pages = len(pages)
        req.num_computed = len(pages) * self.config.page_size
        if lookup and self.allocator.cache is not None:
            self.allocator.cache.lookup(query_tokens, req.num_computed)
        return req.num_computed

    def index(self, req: Request) -> None:
        """Index the pages of `req` whose every token is computed (or scheduled: see the docstring)."""
        cache = self.allocator.cache
        full = req.num_computed // self.config.page_size
        if cache is None or full <= req.indexed_pages:
            return
        hashes = blocks.extend(req.block_hashes, req.all_ids, self.config.page_size, req.cache_salt)
        cache.insert(hashes[req.indexed_pages : full], req.page_table.pages[req.indexed_pages : full])
        req.indexed_pages = full

    def _chunk(self, req: Request, budget: int, allowance: StepAllowance | None = None) -> int:
        n = min(req.num_pending, budget)
        if self.chunk_policy is not None:
            n = min(n, self.chunk_policy.next_chunk(req.num_computed, req.num_pending))
        if allowance is not None:
            n = min(n, allowance.allowed())
        return n

    @property
    def decode_budget(self) -> DecodeBudget | None:
        """The bound on prompt tokens beside decodes: --decode-step-target-ms priced by `step_costs`;
        None when the target is 0."""
        config = self.config
        if not config.decode_step_target_ms:
            return None
        return DecodeBudget(
            self.step_costs, config.decode_step_target_ms / 1000, config.decode_step_min_prefill, config.page_size
        )

    def step_allowance(self, decodes: list[Request]) -> StepAllowance | None:
        """What this step's prompt chunks may take: None (the whole chunked-prefill budget) unless a
        decode budget is set and some request decodes (in this step, or in flight in another
        microbatch, whose stages this step's chunks hold up as well)."""
        budget = self.decode_budget
        if budget is None or not (decodes or any(r.output_ids and not r.has_prompt_left for r in self.running)):
            return None
        allowance = budget.allowance(len(decodes))
        if allowance.left_s < 0 and not self._over_target_told:
            self._over_target_told = True  # (once: prompts get the floor for as long as it lasts)
            logger.warning(
                "a step of decodes alone takes %.1f ms, over --decode-step-target-ms %g: prompts get "
                "--decode-step-min-prefill %d tokens a step",
                1000 * (self.step_costs.decode_s or 0.0), 1000 * budget.target_s, budget.min_tokens,
            )  # fmt: skip
        return allowance

    def _schedule_decodes(self, max_decodes: int | None) -> list[Request]:
        decodes: list[Request] = []
        for req in list(self.running):
            if max_decodes is not None and len(decodes) >= max_decodes:
                break
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
        requests, starts, q_lens, input_ids, sample, scored = [], [], [], [], [], []
        for req, n in [(r, 1) for r in decodes] + chunks:
            # prompt logprobs: every row of a chunk holding a prompt position that predicts a prompt token
            scored.append(req.params.prompt_logprobs is not None and req.num_computed + 1 < req.num_prompt_tokens)
            requests.append(req)
            starts.append(req.num_computed)
            q_lens.append(n)
            input_ids += req.all_ids[req.num_computed : req.num_computed + n]
            req.num_computed += n
            sample.append(req.num_computed == req.num_tokens)
            req.awaiting_output = sample[-1]
            self.index(req)
            if req.rid in self.forks and req.num_computed >= len(req.prompt_ids):
                self._fork(req, self.forks.pop(req.rid))  # its choices compute their last page next step
        batch = ForwardBatch(
            rids=tuple(r.rid for r in requests),
            starts=tuple(starts),
            q_lens=tuple(q_lens),
            page_tables=tuple(tuple(r.page_table.pages) for r in requests),
            input_ids=tuple(input_ids),
            sample=tuple(sample),
            scored=tuple(scored) if any(scored) else (),
        )
        sampled = [r for r, s in zip(requests, sample) if s]
        return ScheduledStep(batch, requests, sampled, len(decodes), sum(n for _, n in chunks), self.clock())

    def postprocess(self, step: ScheduledStep, tokens: list[int]) -> list[Request]:
        """Append each sampled token; finish requests that hit a stop condition. Returns those."""
        self.step_costs.observe(step.decodes, step.prompt_tokens, self.clock() - step.built_s)
        now = time.perf_counter()
        finished = []
        for req, tok in zip(step.sampled, tokens):
            req.awaiting_output = False
            if req.finished:  # aborted while the token was in flight
                continue
            req.output_ids.append(tok)
            if req.first_token_s is None:
                req.first_token_s = now
            reason = self.stop_reason(req, tok)
            if reason:
                self.conclude(req, reason, now)
                finished.append(req)
        return finished

    def stop_reason(self, req: Request, tok: int) -> str | None:
        """Why `req` ends with its newest token `tok`, or None. Stop strings are looked for in the
        token's new text only (common/text/detok.py: O(1) per token), once min_tokens are out; EOS and
        stop_token_ids cannot be sampled before then (sampler.py). A stop token's text is searched
        only with include_stop_str_in_output (as vLLM: else the token leaves no text)."""
        p = req.params
        by_token = tok in p.stop_token_set or (tok in self.eos and not p.ignore_eos)
        if p.stop and self.tokenizer is not None and (p.include_stop_str_in_output or not by_token):
            if req.stop_checker is None:
                req.stop_checker = StopChecker.for_params(self.tokenizer, p)
                for t in req.resumed_ids:  # (no stop string ended among them: the earlier attempt went on)
                    req.stop_checker.push(t, match=False)
            req.stop_checker.push(tok, match=req.num_outputs >= p.min_tokens)
            if req.stop_checker.cut is not None:
                return "stop"
        if by_token:
            return "stop"
        if req.num_outputs >= p.max_new_tokens or req.num_tokens >= self.max_context:
            return "length"
        return None

    def conclude(self, req: Request, reason: str, now: float) -> None:
        """End `req` after its newest token: its text is set once (cut at the stop string that
        ended it, else the whole output decoded, less the stop token that ended it unless
        include_stop_str_in_output) and its pages go (or are held)."""
        req.finish_s = now
        p = req.params
        if req.stop_checker is not None and req.stop_checker.cut is not None:
            req.text = req.stop_checker.text()
        elif self.tokenizer is not None:
            ids = req.resumed_ids + req.output_ids
            if reason == "stop" and not p.include_stop_str_in_output:
                ids = ids[:-1]  # ended by a stop token (EOS or stop_token_ids), not a stop string
            req.text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        req.stop_checker = None
        self.finish(req, reason)

    def preempt(self, req: Request) -> None:
        """Free a running request's pages. recompute: requeue it first, recomputed on readmission;
        retract: hand it to take_evicted() (its pages are free at once: whoever takes it must copy
        their KV out before any later step can reuse them)."""
        self.running.remove(req)
        self._unfork(req)
        pages, req.page_table.pages = req.page_table.pages, []
        self.allocator.free(req.rid, pages)
        req.indexed_pages = 0
        if self.evict == "retract":
            self._evicted.append((req, pages))
            return
        req.num_computed = 0
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)

    def take_evicted(self) -> list[tuple[Request, list[int]]]:
        """evict="retract": the requests preempted since the last call, with the pages each had."""
        out, self._evicted = self._evicted, []
        return out

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self._unfork(req)
        siblings = self.forks.get(req.parent.rid, []) if req.parent is not None else []
        if req in siblings:  # (ended while it waited for its choice 0's prompt)
            siblings.remove(req)
            if not siblings:
                del self.forks[req.parent.rid]
        if req in self.running:
            self.running.remove(req)
            if self.hold_finished and reason != "abort":
                self.held[req.rid] = req
            else:
                self.allocator.free(req.rid, req.page_table.pages)
                req.page_table.pages = []
        elif req in self.waiting:
            self.waiting.remove(req)

    def release(self, req: Request) -> None:
        """Free the pages of a request (held after finishing, or never scheduled)."""
        self.held.pop(req.rid, None)
        if req.page_table.pages:
            self.allocator.free(req.rid, req.page_table.pages)
            req.page_table.pages = []

    def add_prebuilt(self, req: Request) -> None:
        """A request whose prompt K/V is already in its pages (a decode node's transferred request) and
        whose first token is known: it joins decoding directly."""
        assert req.output_ids and req.num_computed == len(req.prompt_ids), req.rid
        self.running.append(req)
        if req.rid in self.forks:
            self._fork(req, self.forks.pop(req.rid))

    def check_invariants(self, elsewhere: Iterable[Request] = ()) -> None:
        """`elsewhere`: requests holding pages outside the running list (a decode node's preallocated
        ones, say): with them, every page in use is accounted for."""
        self.allocator.check_invariants()
        holders = (*self.running, *self.held.values(), *elsewhere)
        held = sum(len(r.page_table.pages) for r in holders)
        if held != self.allocator.num_holds:
            raise AssertionError(f"pages in requests' tables ({held}) != pages held ({self.allocator.num_holds})")
        for r in holders:
            if len(set(r.page_table.pages)) != len(r.page_table.pages):
                raise AssertionError(f"request {r.rid} holds a page twice")
            if any(r.rid not in self.allocator.holders(p) for p in r.page_table.pages):
                raise AssertionError(f"request {r.rid}'s table names pages it does not hold")
        if any(r.page_table.pages for r in (*self.waiting, *self.forked())):
            raise AssertionError("a waiting request holds pages")
        rids = [r.rid for r in self.running] + [r.rid for r in self.waiting] + [r.rid for r in self.forked()]
        if len(rids) != len(set(rids)):
            raise AssertionError(f"a request is queued twice: {len(rids)} entries, {len(set(rids))} distinct")
