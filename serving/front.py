"""A running node seen from its services: submit a request, iterate its events.

The front lives on the node server's asyncio event loop (common.rpc.EventLoop): a request
costs an asyncio queue and the coroutine that reads it, never a thread. One dispatcher
thread reads rank 0's event queue (a multiprocessing queue, so a blocking read), takes every
event already there in one go, and hands the batch to the loop, which routes each event to
its request's stream or to a status waiter. Text is detokenized incrementally here
(common/text/detok.py: bounded work per token), holding back what might still turn out to be
the start of a stop string.

Callers on the loop use `submit`, `abort`, `astatus`, `arequests`, `acheck`; other threads
(the rank watcher, SIGTERM handling, /metrics scrapes, tests) use the blocking `status`,
`requests`, `check` and `fail_all`, which run on the loop and wait for it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from kvbridge.common import blocks, tracing
from kvbridge.common.limits import rid_problem
from kvbridge.common.metrics import outcome_of
from kvbridge.common.rpc import EventLoop, shown
from kvbridge.common.sampling import SamplingParams
from kvbridge.common.text.detok import TextStream
from kvbridge.common.text.prompts import tokenized
from kvbridge.engine.logits import Logprob, logprob_to_proto
from kvbridge.kv_transfer.handoff import Registration
from kvbridge.pipeline.group import RankGroup
from kvbridge.pipeline.messages import (
    Answer,
    Ask,
    CacheEvents,
    Finish,
    Pairing,
    PromptLogprobs,
    Register,
    Revoke,
    SetRole,
    Token,
)
from kvbridge.serving.kv_events import KVEventHub
from kvbridge.serving.metrics import NodeRecorder
from kvbridge.v1 import common_pb2, generation_pb2

MAX_BATCH = 4096  # events handed to the loop in one call, at most


class Overloaded(Exception):
    """The node takes no more requests now (RESOURCE_EXHAUSTED): a router tries another node."""


@dataclass
class Delta:
    token_ids: list[int]  # new tokens
    text: str  # their text, as far as it is final
    finish_reason: str = ""  # set on the last delta
    prompt_tokens: int = 0  # set on the last delta
    completion_tokens: int = 0  # set on the last delta
    error: str = ""  # the request failed (last delta): why
    code: str = ""  # and the gRPC status code name to report it with
    kv_bytes: int = 0  # disaggregated: KV bytes moved for it
    kv_seconds: float = 0.0  # disaggregated, first delta: from registration to the KV landing on every rank
    pages_skipped: int = 0  # decode node, first delta: prompt pages its prefix cache held (not moved)
    cached_tokens: int = 0  # last delta: prompt tokens found in the prefix cache (not computed here)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # params.logprobs set: one a token
    # params.prompt_logprobs set, first delta: one a prompt token (the first has no logprob)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    index: int = 0  # params.n > 1: the choice it belongs to

    def response(self, rid: str, cached_tokens: bool = True) -> generation_pb2.GenerateResponse:
        """As a GenerateResponse (finish_reason and usage on the last one); `cached_tokens`: whether
        this node's prefix-cache count is the request's (a decode node's is not: it computed no prompt)."""
        resp = generation_pb2.GenerateResponse(rid=rid, token_ids=self.token_ids, text=self.text, index=self.index)
        resp.logprobs.extend(self.logprobs)
        resp.prompt_logprobs.extend(self.prompt_logprobs)
        if self.finish_reason:
            resp.finish_reason = self.finish_reason
            resp.usage.prompt_tokens = self.prompt_tokens
            resp.usage.completion_tokens = self.completion_tokens
            if cached_tokens:
                resp.usage.cached_tokens = self.cached_tokens
        return resp


class NodeFront:
    def __init__(self, ranks: RankGroup):
        self.ranks = ranks
        self.tokenizer = ranks.model.tokenizer
        self.loop: EventLoop | None = None  # set by attach(): where streams are read
        self._streams: dict[str, asyncio.Queue] = {}
        self._status: dict[int, asyncio.Future] = {}  # token -> waiter of a status / requests answer
        self._timing: dict[str, list] = {}  # rid -> [submitted, first token seen] (perf_counter)
        self.recorder = NodeRecorder()  # the server sets its own; counted on the loop
        self.kv_events = KVEventHub(ranks.config.page_size, role="")  # the server names the role
        self._tokens = itertools.count()
        self._closed = False
        # rank 0's role-specific messages, by type (e.g. a decode node's Preallocated): called on the
        # loop, so they must not block (start a task for anything that waits)
        self.handlers: dict[type, Callable] = {}
        self._thread = threading.Thread(target=self._dispatch, name="kvbridge-dispatch", daemon=True)
        # a token's own text, as logprobs show it (special tokens too); bounded by the vocabulary
        self._token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda t: self.tokenizer.decode([t], skip_special_tokens=False)
        )

    def attach(self, loop: EventLoop) -> None:
        """Serve on `loop` from now on (the node server's); starts reading rank 0's events."""
        self.loop = loop
        self._thread.start()

    # ------------------------------------------------------------------ on the loop

    async def prompt_ids(self, prompt: common_pb2.Prompt) -> list[int]:
        """The prompt's token ids, tokenized off the loop (common/text/prompts.py `tokenized`); ValueError
        for one that cannot fit the context by its size, found before the template or the tokenizer
        runs on it (common/limits.py)."""
        return await tokenized(prompt, self.tokenizer, self.ranks.max_context)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        rid: str,
        pairing: Pairing | None = None,
        cache_salt: str = "",
        resumed: Sequence[int] = (),
    ) -> AsyncIterator[Delta]:
        """Start a request; iterate its deltas (the last has finish_reason; with params.n > 1, each
        choice's last, and the deltas of the n choices interleave: `_choices`). Raises ValueError on
        bad input, Overloaded when the node holds max_pending_requests already. `resumed`: a migrated
        request's outputs so far (an earlier attempt streamed them): computed after the prompt, counted
        as outputs, and not sent again (the text goes on from where theirs ended)."""
        limit = self.ranks.config.max_pending_requests
        problem = rid_problem(rid)
        if problem:
            raise ValueError(problem)
        if problem := blocks.salt_problem(cache_salt):
            raise ValueError(problem)
        params = self._checked(params)
        if params.n > limit:
            held = f"this node holds at most {limit} requests (--max-pending-requests)"
            raise ValueError(f"sampling.n is {params.n}; {held}")
        if params.n > 1 and resumed:
            raise ValueError(f"resume_ids continue one choice; sampling.n must be 1 with them, got {params.n}")
        if rid in self._streams:
            raise ValueError(f"duplicate request id {shown(rid)}")
        if len(self._streams) + params.n > limit:
            raise Overloaded(f"the node holds {len(self._streams)} requests, its limit (--max-pending-requests)")
        if params.n > 1:
            return self._choices(prompt_ids, params, rid, pairing, cache_salt)
        return self._start(prompt_ids, params, rid, pairing, cache_salt, resumed)

    def _choices(self, prompt_ids: list[int], params: SamplingParams, rid: str, pairing: Pairing | None, salt: str):
        """n choices of one prompt: choice 0 is the request as asked (its prefill, or its hand-off on a
        decode node); choice i > 0 (rid `RID:nI`) samples with seed + i and starts from choice 0's prompt
        pages at rank 0 (Add.fork_of; engine/scheduler.py), so the prompt is computed once."""
        rids = [rid] + [f"{rid}:n{i}" for i in range(1, params.n)]
        taken = [r for r in rids[1:] if r in self._streams]
        if taken:
            raise ValueError(f"request id {shown(taken[0])} (a choice of {shown(rid)}) is in use")
        streams = []
        try:
            for i, r in enumerate(rids):
                if i == 0:
                    streams.append(self._start(prompt_ids, params.choice(0), r, pairing, salt))
                else:
                    streams.append(self._start(prompt_ids, params.choice(i), r, None, salt, fork_of=rid))
        except BaseException:
            self._drop(rids)
            raise
        return self._merged(rids, streams)

    def _drop(self, rids: list[str]) -> None:
        """Abort the requests among `rids` still open and close their streams."""
        for r in rids:
            self.abort(r)
            self._streams.pop(r, None)

    async def _merged(self, rids: list[str], streams: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
        """The choices' deltas as they come, each with its index; a choice that fails ends them all (the
        others are aborted), and the usage of choice i > 0 counts no cached tokens (it shared choice 0's)."""
        out: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, deltas: AsyncIterator[Delta]) -> None:
            try:
                async for d in deltas:
                    d.index = i
                    if i:
                        d.cached_tokens = 0
                    out.put_nowait(d)
            except Exception as e:  # (the node stopped)
                out.put_nowait(e)

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                d = await out.get()
                if isinstance(d, Exception):
                    raise d
                if d.error:  # the others end now (the caller may never close this generator)
                    for t in tasks:
                        t.cancel()
                    self._drop(rids)
                    yield d
                    return
                yield d
                left -= bool(d.finish_reason)
        finally:
            for t in tasks:
                t.cancel()
            self._drop(rids)  # the choices still running (or never read) are aborted on every rank

    def _start(
        self,
        prompt_ids,
        params: SamplingParams,
        rid: str,
        pairing: Pairing | None,
        cache_salt: str,
        resumed: Sequence[int] = (),
        fork_of: str = "",
    ):
        """Queue one request at rank 0 and open its event stream."""
        ids = [*prompt_ids, *resumed]  # (add_request raises ValueError before anything is registered)
        trace = tracing.current()  # (the service's span: common/tracing.py served)
        self.ranks.add_request(ids, params, rid, pairing, cache_salt, len(resumed), fork_of, trace)
        events: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = events
        self._timing[rid] = [time.perf_counter(), None]
        text = TextStream.for_params(self.tokenizer, params, self.ranks.model.config.eos_token_ids)
        for token in resumed:  # the text the client has: what follows starts where it ends
            text.push(token)
        first = prompt_ids[0] if params.prompt_logprobs is not None else None
        return self._deltas(rid, events, text, len(prompt_ids), first)

    def _checked(self, params: SamplingParams) -> SamplingParams:
        """The sampling controls this node alone can check (token ids against its vocabulary, the
        schema against its grammar engine), and bad_words as its token sequences."""
        vocab = self.ranks.model.config.vocab_size
        biased = [t for t, _ in params.logit_bias]
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", biased)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"sampling.{name} holds token id {shown(bad[0])}, outside the vocabulary [0, {vocab})")
        if (params.bad_words or params.structured) and self.tokenizer is None:
            raise ValueError("bad_words and structured output need a tokenizer; this model has none")
        if params.bad_words:
            params = params.with_bad_words_ids(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        if params.json_schema:
            from kvbridge.common.text.schema import schema_problem

            if problem := schema_problem(params.json_schema):
                raise ValueError(f"sampling.structured.json_schema: {problem}")
        return params

    async def _deltas(self, rid: str, events: asyncio.Queue, text: TextStream, prompt_tokens: int, first=None):
        """The request's deltas. Closed before its last one (the client went away: its call's
        coroutine was cancelled, or the reader stopped), the request is aborted on every rank."""
        over = False
        # prompt logprobs (asked for: `first` is the prompt's first token) go out with the first token
        prompt = [] if first is None else [self._logprob(Logprob(first, 0.0), prompt=True)]
        try:
            while True:
                ev = await events.get()
                if ev is None:
                    over = True
                    raise RuntimeError("the node stopped")
                if isinstance(ev, PromptLogprobs):
                    prompt += [self._logprob(lp) for lp in ev.logprobs]
                    continue
                if isinstance(ev, Finish):
                    over = True
                    yield self._last_delta(ev, text, prompt_tokens)
                    return
                # tokens that queued up while the reader was busy go out as one delta
                ids, kv_seconds, skipped = [ev.token], ev.kv_seconds, ev.pages_skipped
                logprobs = [ev.logprob] if ev.logprob is not None else []
                last = None
                while not events.empty() and last is None:
                    more = events.get_nowait()
                    if isinstance(more, Token):
                        ids.append(more.token)
                        if more.logprob is not None:
                            logprobs.append(more.logprob)
                    else:
                        last = more
                text_delta = "".join(text.push(t) for t in ids)
                logprobs = [self._logprob(lp) for lp in logprobs]
                extra = {"logprobs": logprobs, "prompt_logprobs": prompt}
                yield Delta(ids, text_delta, kv_seconds=kv_seconds, pages_skipped=skipped, **extra)
                prompt = []
                if last is not None:
                    events.put_nowait(last)
        finally:
            if not over:
                self.abort(rid)
            self._streams.pop(rid, None)

    def _logprob(self, lp: Logprob, prompt: bool = False) -> common_pb2.TokenLogprob:
        """As the wire has it, with the tokens' texts; `prompt`: the prompt's first token (no logprob)."""
        msg = logprob_to_proto(lp)
        if prompt:
            msg.ClearField("logprob")
            msg.rank = 0
        if self.tokenizer is not None:
            msg.token = self._token_text(lp.token)
            msg.top_tokens.extend(self._token_text(t) for t, _ in lp.top)
        return msg

    @staticmethod
    def _last_delta(ev: Finish, text: TextStream, prompt_tokens: int) -> Delta:
        return Delta(
            [],
            text.finish(ev.text),
            ev.finish_reason,
            prompt_tokens,
            len(ev.output_ids),
            error=ev.error,
            code=ev.code,
            kv_bytes=ev.kv_bytes,
            cached_tokens=ev.cached_tokens,
        )

    def abort(self, rid: str, reason: str = "", source: str = "client") -> bool:
        """End a request in whatever phase; `reason` (when given) is the error its stream ends with.
        False when the request is not (or no longer) here."""
        live = rid in self._streams
        if live:
            self.ranks.abort(rid, reason)
            self.recorder.aborted(source)
        return live

    async def astatus(self, timeout: float = 5.0) -> dict:
        """Rank 0's counters and queues (see Leader.status); TimeoutError if it does not answer."""
        return await self._ask("status", timeout)

    async def arequests(self, timeout: float = 5.0) -> list[dict]:
        """Every request rank 0 holds (see Leader.list_requests)."""
        return (await self._ask("requests", timeout))["requests"]

    async def acheck(self, timeout: float = 5.0) -> dict:
        """Rank 0's invariant check: {"problems": [...], "log": decisions made so far}."""
        return await self._ask("check", timeout)

    async def clear_cache(self, timeout: float = 5.0) -> int:
        """Drop the prefix cache's index (idle pages are free again); how many pages that freed."""
        return (await self._ask("clear_cache", timeout))["pages_dropped"]

    async def register(self, registration: Registration, timeout: float = 10.0) -> dict:
        """Prefill node: hand a decode node's registration of a room to rank 0; its verdict
        {"code": gRPC status name or "", "error": why} (a room registered twice: ALREADY_EXISTS)."""
        return await self._ask("register", timeout, lambda token: Register(registration, token))

    async def revoke(self, room: int, timeout: float = 10.0) -> dict:
        """Prefill node: a decode node gave up on `room`; rank 0's answer once no rank writes into it
        {"code": "" or "NOT_FOUND" (no such room here), "error"}."""
        return await self._ask("revoke", timeout, lambda token: Revoke(room, token))

    async def set_role(self, role: str, wait_s: float, migrate: bool) -> dict:
        """An elastic node: switch every rank to `role` once nothing is live (elastic_node/role.py);
        {"code": gRPC status name or "", "error", "epoch", "waited_s"}."""
        return await self._ask("set_role", wait_s + 5, lambda token: SetRole(role, token, wait_s, migrate))

    async def _ask(self, op: str, timeout: float, message=None) -> dict:
        token = next(self._tokens)
        waiter = asyncio.get_running_loop().create_future()
        self._status[token] = waiter
        self.ranks.inbox.put(message(token) if message else Ask(op, token))
        try:
            return (await asyncio.wait_for(waiter, timeout)).body
        finally:
            self._status.pop(token, None)

    def _fail_all(self, error: str, code: str) -> int:
        streams = list(self._streams.items())
        for rid, q in streams:
            q.put_nowait(Finish(rid, "error", (), "", 0, error=error, code=code))
            self._count_finish(rid, "error", 0, 0)
        return len(streams)

    def _close(self) -> None:
        for q in self._streams.values():
            q.put_nowait(None)

    # ------------------------------------------------------------------ from other threads

    def status(self, timeout: float = 5.0) -> dict:
        return self.loop.run(self.astatus(timeout), timeout + 1)

    def requests(self, timeout: float = 5.0) -> list[dict]:
        return self.loop.run(self.arequests(timeout), timeout + 1)

    def check(self, timeout: float = 5.0) -> dict:
        return self.loop.run(self.acheck(timeout), timeout + 1)

    def fail_all(self, error: str, code: str = "UNAVAILABLE") -> int:
        """End every open stream with `error` (the node cannot finish them: a rank died). Returns how many."""
        return self.loop.invoke(self._fail_all, error, code)

    def close(self) -> None:
        self._closed = True
        if self.loop is not None:
            self.loop.call(self._close)

    # ------------------------------------------------------------------ events

    def _count_finish(self, rid: str, outcome: str, prompt_tokens: int, output_tokens: int) -> None:
        self.ranks.forget(rid)
        timing = self._timing.pop(rid, None)
        if timing is not None:
            self.recorder.finished(outcome, prompt_tokens, output_tokens, time.perf_counter() - timing[0])

    def _dispatch(self) -> None:
        """The dispatcher thread: rank 0's events, in batches, to the loop."""
        outbox = self.ranks.outbox
        while not self._closed:
            batch: list = []
            try:
                batch.append(outbox.get(timeout=0.5))
                while len(batch) < MAX_BATCH:
                    batch.append(outbox.get_nowait())
            except queue.Empty:
                pass
            except (EOFError, OSError, ValueError):  # the queue was closed: the node stopped
                return
            if batch:
                self.loop.call(self._deliver, batch)

    def _deliver(self, batch: list) -> None:
        """On the loop: each message to its request's stream, its waiter, or its role's handler."""
        for ev in batch:
            match ev:
                case Answer(token):
                    waiter = self._status.get(token)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(ev)
                    continue
                case Token(rid):
                    timing = self._timing.get(rid)
                    if timing is not None and timing[1] is None:
                        timing[1] = time.perf_counter()
                        self.recorder.first_token(timing[1] - timing[0])
                case CacheEvents():
                    self.kv_events.apply(ev)
                    continue
                case PromptLogprobs():
                    pass
                case Finish(rid):
                    if ev.timeout:
                        self.recorder.timed_out(ev.timeout)
                    outcome = outcome_of(ev.finish_reason, ev.error)
                    self._count_finish(rid, outcome, ev.prompt_tokens, len(ev.output_ids))
                case _:
                    self.handlers[type(ev)](ev)
                    continue
            target = self._streams.get(ev.rid)
            if target is not None:
                target.put_nowait(ev)
