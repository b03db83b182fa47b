"""Rank 0 of a pipeline: the node's only scheduler.

The loop keeps up to `pp_loop_size` microbatches in flight. Each turn: take new work
from the inbox, schedule a microbatch if a slot is free, send its description and then
its hidden states to rank 1, and, when the slots are full (or there is nothing new to
launch), wait for the oldest microbatch's tokens from the last rank and post-process
them while later microbatches compute.

What a role adds (prefill, decode: queues before or after the scheduler, its own messages, the
one way its requests fail) is an object passed in, `role=` (pipeline/roles.py); this loop calls it
at fixed points and is the same for every role.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import deque
from dataclasses import replace

import torch

from kvbridge.common.limits import room_tag
from kvbridge.common.logs import log_event
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine import faults
from kvbridge.engine.batch import AttentionMetadata
from kvbridge.engine.kv_pool import KVPool
from kvbridge.engine.logits import logprob_width, prompt_logprobs, prompt_spans, split_logits, unpack_logprobs
from kvbridge.engine.model import ModelStage
from kvbridge.engine.pages import PageTable
from kvbridge.engine.request import Handoff, Phase, Request
from kvbridge.engine.sampler import Sampler
from kvbridge.engine.scheduler import ScheduledStep, Scheduler
from kvbridge.kv_transfer.handoff import Destination
from kvbridge.pipeline import cores
from kvbridge.pipeline.agent import KVAgent
from kvbridge.pipeline.dist import Link
from kvbridge.pipeline.log import (
    ABORT,
    ADMIT,
    CONTROL,
    FINISH,
    REUSE,
    SHUTDOWN,
    STEP,
    Admitted,
    LogEntry,
    Message,
    Pages,
    PipelineLog,
    Record,
)
from kvbridge.pipeline.messages import (
    Abort,
    Add,
    Answer,
    Ask,
    CacheEvents,
    Finish,
    PromptLogprobs,
    Register,
    Shutdown,
    Token,
    Wake,
)
from kvbridge.pipeline.metrics import RankRecorder
from kvbridge.pipeline.roles import WAITS_FOR, ColocatedRole, Role

log = logging.getLogger("kvbridge.node")


class Rank0Loop:
    def __init__(
        self,
        stage: ModelStage,
        pool: KVPool,
        scheduler: Scheduler,
        link: Link,
        pp_size: int,
        pp_loop_size: int,
        inbox,
        outbox,
        agent: KVAgent | None = None,
        role: Role | None = None,
        recorder: RankRecorder | None = None,
    ):
        self.stage, self.pool, self.scheduler, self.link = stage, pool, scheduler, link
        self.agent = agent or KVAgent()  # rank 0 holds layers too: it moves their KV like any rank
        self.pp_size, self.loop_size = pp_size, pp_loop_size
        self.last_rank = pp_size - 1
        self.inbox, self.outbox = inbox, outbox
        self.inflight: deque[ScheduledStep] = deque()
        self.requests: dict[str, Request] = {}
        self.log = PipelineLog()  # every decision this node made, in order
        self._unsent: list[LogEntry] = []  # made but not yet sent down the pipeline
        self.stopping = False
        self.served = 0  # requests retired (any outcome) since start
        self.recorder = recorder or RankRecorder()
        self.faults = faults.current()
        self.role = role or ColocatedRole()
        self.role.bind(self)
        # the pipeline's shape, bound once: a pipeline of one rank samples here instead of on rank P-1
        mc = stage.config
        self.sampler = Sampler(mc.eos_token_ids, scheduler.tokenizer, mc.vocab_size) if pp_size == 1 else None
        if pp_size == 1:
            self._sampled: deque[tuple[list[int], list]] = deque()
            self._send, self._send_hidden, self._recv_tokens = _drop, self._sample_here, self._take_sampled
        else:
            self._send = self._send_down
            self._send_hidden = self._send_hidden_down
            self._recv_tokens = self._recv_from_last

    # ------------------------------------------------------------------ loop

    def run(self) -> PipelineLog:
        while not (self.stopping and not self.inflight):
            idle = not (self.inflight or self.scheduler.num_unfinished or self._unsent or self.role.undecided())
            self._drain_inbox(block=idle)
            self.role.tick(time.perf_counter())
            step = None
            if len(self.inflight) < self.loop_size and not self.stopping:
                step = self.scheduler.schedule(self._decode_cap())
                # (a retracting scheduler's victims: their RETRACT goes down before any step reuses their pages)
                for req, pages in self.scheduler.take_evicted():
                    self.role.evicted(req, pages)
            if step is not None:
                cores.refresh()
                self._launch(step)
            elif self._unsent:
                self._send(Message(CONTROL, self._take_unsent()))
            if self.inflight and (len(self.inflight) >= self.loop_size or step is None):
                self._complete_oldest()
            self._publish_cache_events()
        self._send(Message(SHUTDOWN, self._take_unsent()))
        self.link.flush()
        return self.log

    def _decode_cap(self) -> int:
        """Spread decoding requests over the stages' microbatches instead of one full batch and idle stages."""
        return max(1, math.ceil(len(self.scheduler.running) / self.pp_size))

    def _launch(self, step: ScheduledStep) -> None:
        for req, q_len in zip(step.requests, step.batch.q_lens):
            self.announce(req)
            start = req.num_computed - q_len
            if req.phase is Phase.WAITING and start:  # admitted past its cached prefix: every rank learns it
                self.decide(REUSE, req.rid, info=Pages(tuple(req.page_table.pages[: start // self.pool.page_size])))
            if req.num_computed <= len(req.prompt_ids):  # (num_computed already counts this step)
                self.recorder.chunk(q_len)
                self.move(req, Phase.PREFILLING)
            else:
                self.move(req, Phase.DECODING)
        self._send(Message(STEP, self._take_unsent(), step.batch))
        meta, began = AttentionMetadata.build(step.batch, self.pool.page_size, self.stage.device), time.time_ns()
        ids = torch.tensor(step.batch.input_ids, dtype=torch.long, device=self.stage.device)
        hidden = self.stage.forward(meta, ids, self.pool)
        self.recorder.forwarded(0, step.batch, began)
        self.faults.after_step()
        self.agent.after_forward(step.batch)
        self._send_hidden(step, hidden)
        self.inflight.append(step)

    def _publish_cache_events(self) -> None:
        """The prefix cache's changes since the last turn, to the front (the node's KV event stream)."""
        cache = self.scheduler.allocator.cache
        if cache is None:
            return
        if events := cache.take_events():
            self.outbox.put(CacheEvents(tuple((kind, tuple(hashes)) for kind, hashes in events)))
        self.recorder.cache_counts(cache.hit_tokens, cache.query_tokens, cache.evicted)

    def _complete_oldest(self) -> None:
        step = self.inflight.popleft()
        out, logprobs, prompt = self._recv_tokens(step)
        assert out[0] == len(step.sampled), f"last rank sampled {out[0]} rows, expected {len(step.sampled)}"
        if prompt:
            self._send_prompt_logprobs(step, prompt)
        live = [not req.finished for req in step.sampled]  # aborted ones drop their token
        finished = self.scheduler.postprocess(step, out[1:])
        for req, tok, lp, was_live in zip(step.sampled, out[1:], logprobs, live):
            if was_live:
                self.outbox.put(Token(req.rid, tok, req.num_outputs - 1, logprob=lp))
        for req in finished:
            if not self.role.finished(req):  # (a prefill node keeps it: its KV is still to move)
                self.retire(req, FINISH)

    # ------------------------------------------------------------------ the pipeline

    def _send_down(self, msg: Message) -> None:
        self.link.send_bytes(msg.encode(), 1)

    def _send_hidden_down(self, step: ScheduledStep, hidden: torch.Tensor) -> None:
        self.link.send_tensor(hidden, 1)

    def _recv_from_last(self, step: ScheduledStep) -> tuple[list[int], list, list]:
        # [count, token...]: a header, so that a step that samples nothing still answers; then the
        # logprobs when a sampled request asked for them, and the prompt logprobs of scored chunks
        # (both ends know which: the params and the batch)
        out = self.link.recv_tensor((len(step.sampled) + 1,), torch.int64, self.last_rank).tolist()
        ks = [req.params.logprobs for req in step.sampled]
        logprobs = [None] * len(step.sampled)
        if width := logprob_width(ks):
            rows = self.link.recv_tensor((len(step.sampled), width), torch.float64, self.last_rank)
            logprobs = unpack_logprobs(rows, out[1:], ks)
        prompt = []
        if spans := (prompt_spans(step.batch, step.requests) if step.batch.scored else []):
            targets, ks = [], []
            for i, first, n in spans:
                req = step.requests[i]
                targets += req.prompt_ids[first : first + n]
                ks += [req.params.prompt_logprobs] * n
            rows = self.link.recv_tensor((len(targets), logprob_width(ks)), torch.float64, self.last_rank)
            prompt = unpack_logprobs(rows, targets, ks)
        return out, logprobs, prompt

    def _sample_here(self, step: ScheduledStep, logits: torch.Tensor) -> None:
        logits, scored = split_logits(step.batch, logits)
        tokens, logprobs = self.sampler(logits, step.sampled)
        self.agent.on_sampled(step.batch, tokens, logprobs)
        prompt = prompt_logprobs(step.batch, scored, step.requests) if scored else []
        self._sampled.append(([len(step.sampled), *tokens], logprobs, prompt))

    def _take_sampled(self, step: ScheduledStep) -> tuple[list[int], list, list]:
        return self._sampled.popleft()

    def _send_prompt_logprobs(self, step: ScheduledStep, prompt: list) -> None:
        """Each scored request's prompt logprobs to the front, those it has not had yet (a preempted
        request computes its prompt again), before its first token."""
        for i, first, n in prompt_spans(step.batch, step.requests):
            req, rows, prompt = step.requests[i], prompt[:n], prompt[n:]
            fresh = [lp for j, lp in enumerate(rows) if first + j >= req.prompt_logprobs_next]
            if fresh and not req.finished:
                self.outbox.put(PromptLogprobs(req.rid, first + n - len(fresh), tuple(fresh)))
                req.prompt_logprobs_next = first + n

    # ------------------------------------------------------------------ inputs

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_one(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle_one(self, msg) -> None:
        """A message that breaks a rule no check caught fails its own request, not the rank."""
        try:
            self._handle(msg)
        except Exception as e:
            name = self.role.name
            error = f"rank 0 of the {name} node could not handle {type(msg).__name__}: {type(e).__name__}: {e}"
            log.exception("%s", error)
            rid = getattr(msg, "rid", None)
            if rid in self.requests:
                self.role.fail(self.requests[rid], error, "INTERNAL")
            elif isinstance(msg, Add):  # refused before it was registered: its stream still ends
                self.outbox.put(Finish(rid, "error", (), "", len(msg.prompt_ids), error=error, code="INTERNAL"))
            elif isinstance(msg, Register):
                self.outbox.put(Answer(msg.token, {"code": "INTERNAL", "error": error}))

    def _handle(self, msg) -> None:
        """A message from the front (pipeline/messages.py); the role's own go to the role."""
        match msg:
            case Add():
                table = PageTable(self.pool.page_size)
                ids, salt = list(msg.prompt_ids), msg.cache_salt
                req = Request(msg.rid, ids, msg.params, table, cache_salt=salt, resumed=msg.resumed)
                req.parent = self.requests.get(msg.fork_of) if msg.fork_of else None
                req.trace, req.phase_ns = msg.trace, time.time_ns()
                self.recorder.traced(msg.rid, msg.trace)
                self.requests[msg.rid] = req
                if self.sampler is not None:  # (it samples here: its grammar compiles while it waits)
                    self.sampler.prepare(req)
                self.role.admit(req, msg)
            case Abort(rid, reason) if rid in self.requests:
                # an operator's abort ends with its reason; a client's has nobody left to tell
                self.role.fail(self.requests[rid], reason or "aborted", "CANCELLED", reason="abort")
            case Ask("status", token):
                self.outbox.put(Answer(token, self.status()))
            case Ask("requests", token):
                self.outbox.put(Answer(token, {"requests": self.list_requests()}))
            case Ask("clear_cache", token):
                dropped = self.scheduler.allocator.clear_cache()
                self._publish_cache_events()
                self.outbox.put(Answer(token, {"pages_dropped": dropped}))
            case Ask("check", token):
                self.outbox.put(Answer(token, {"problems": self.check_invariants(), "log": self.log.count}))
            case Shutdown():
                self.stopping = True
                for req in list(self.requests.values()):
                    self.role.fail(req, f"the {self.role.name} node is shutting down", "UNAVAILABLE", reason="abort")
                # every request has ended and nothing is handed out again: a tick at the end of time
                # releases what rests (a decode node's quarantined pages; no late write can matter now)
                self.role.tick(math.inf)
            case Wake() | Abort():
                pass  # decisions are taken in the role's tick; an abort of a request that has ended already
            case _ if self.role.handle(msg):
                pass
            case _:
                raise AssertionError(f"rank 0 of a {self.role.name} node got {msg!r}")

    # ------------------------------------------------------------------ what roles call

    def move(self, req: Request, phase: Phase, **fields) -> None:
        """`req` is in `phase` now; a change is one log line."""
        if req.phase is not phase:
            self._phase_span(req)
            req.phase = phase
            self._log_phase(req, phase.value, **fields)

    def decide(self, kind: str, rid: str, params: SamplingParams | None = None, info: Record | None = None) -> None:
        """Append an entry to the node's log (info: the kind's record, pipeline/log.py RECORDS); it goes
        down the pipeline with the next message."""
        d = LogEntry(self.log.count, kind, rid, params, info)
        self.log.append(d)
        self._unsent.append(d)
        self.recorder.decided(kind)
        self.agent.on_decision(d)

    def announce(
        self, req: Request, destination: Destination | None = None, first_sample_index: int | None = None
    ) -> None:
        """Every rank learns the request, once: its ADMIT, with the seed it samples with and the output
        index its sampling starts at (a migrated request's continuation: its outputs so far, unless the
        role says), the prompt when the last rank's sampling needs it, and on a decode node where its
        KV lands."""
        if not req.announced:
            req.announced = True
            history = self.sampler is None and req.params.needs_history  # the last rank needs the prompt (and resumed)
            record = Admitted(
                first_sample_index=req.num_sampled if first_sample_index is None else first_sample_index,
                prompt=tuple(req.prompt_ids) if history else (),
                resumed=req.resumed if history else 0,
                destination=destination,
                trace=req.trace,
            )
            self.decide(ADMIT, req.rid, replace(req.params, seed=req.seed), record)

    def end(self, req: Request, error: str, code: str, reason: str = "error", release: bool = True, **event) -> None:
        """What every role's fail() ends with: out of the scheduler, its pages freed (unless the role
        keeps them: `release=False`), every rank and the front told."""
        self.scheduler.finish(req, "abort")
        if release:
            self.scheduler.release(req)
        req.finish_reason, req.finish_s = reason, time.perf_counter()
        self.retire(req, ABORT, error=error, code=code, **event)

    def retire(self, req: Request, kind: str, **event) -> None:
        """The request is over here: tell every rank (if they know it) and the front."""
        del self.requests[req.rid]
        self.served += 1
        if req.announced:
            self.decide(kind, req.rid)
        fields = {"reason": req.finish_reason, "output_tokens": req.num_outputs}
        if event.get("error"):
            fields |= {"code": event.get("code", ""), "error": event["error"]}
        self._log_phase(req, "finished", **fields)
        self._phase_span(req, **fields)
        self.recorder.untraced(req.rid)
        outputs = tuple(req.resumed_ids + req.output_ids)
        finish = Finish(req.rid, req.finish_reason, outputs, req.text, req.num_prompt_tokens, **event)
        self.outbox.put(replace(finish, cached_tokens=req.cached_tokens) if req.cached_tokens else finish)

    def _phase_span(self, req: Request, **fields) -> None:
        """The span of the phase `req` leaves (each queue it waits in, the consensus rulings it waits
        for: pipeline/roles.py WAITS_FOR), if it is traced."""
        now = time.time_ns()
        if req.phase is not None and req.trace:
            attributes = {"kvbridge.rid": req.rid, "kvbridge.role": self.role.name, **handoff_fields(req.handoff)}
            if waits := WAITS_FOR.get((self.role.name, req.phase)) or WAITS_FOR.get(("", req.phase)):
                attributes["kvbridge.waits_for"] = waits
            attributes |= {f"kvbridge.{k}": v for k, v in fields.items() if isinstance(v, (str, int, float))}
            self.recorder.span(req.rid, req.phase.value, req.phase_ns, attributes, now)
        req.phase_ns = now

    def page_bytes_all_layers(self) -> int:
        """Bytes of one KV page over every layer of the model (all ranks together)."""
        pool = self.pool
        per_layer = pool.buffer[0].numel() * pool.buffer.element_size() // (pool.layer_end - pool.layer_start)
        return per_layer * self.stage.config.num_hidden_layers

    def _log_phase(self, req: Request, phase: str, **fields) -> None:
        room = req.handoff.room if req.handoff else None
        log_event(log, "phase", role=self.role.name, rid=req.rid, room=room_tag(room), phase=phase, **fields)

    def _take_unsent(self) -> tuple[LogEntry, ...]:
        out, self._unsent = tuple(self._unsent), []
        return out

    # ------------------------------------------------------------------ what operators and checks see

    def status(self) -> dict:
        alloc = self.scheduler.allocator
        return {
            "pages_used": alloc.num_used,
            "pages_total": alloc.num_pages,
            "queues": {
                "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running),
                "forked": sum(map(len, self.scheduler.forks.values())),  # choices waiting for choice 0's prompt
                "inflight_microbatches": len(self.inflight),
                **self.role.sizes(),
            },
            "served": self.served,
            "requests_in_flight": len(self.requests),
            "transfers_in_flight": self.role.transfers_in_flight(),
            "prefix_cache": alloc.cache.stats() if alloc.cache else {"enabled": False},
        }

    def queues(self) -> dict[str, list[str]]:
        """Every queue a live request can be in, by name: each live request is in exactly one."""
        s = self.scheduler
        queues = {"waiting": [r.rid for r in s.waiting], "running": [r.rid for r in s.running]}
        return {**queues, "forked": [r.rid for r in s.forked()], **self.role.queues()}

    def check_invariants(self) -> list[str]:
        """What is wrong with rank 0's state ([] when nothing): pages owned = pages of live requests,
        every live request in exactly one queue, one of its phase, nothing queued that is not live."""
        problems = []
        try:
            self.scheduler.check_invariants(elsewhere=self.role.holders())
        except AssertionError as e:
            problems.append(f"pages: {e}")
        where: dict[str, list[str]] = {}
        for name, rids in self.queues().items():
            for rid in rids:
                where.setdefault(rid, []).append(name)
        for rid, req in self.requests.items():
            if len(where.get(rid, ())) != 1:
                problems.append(f"request {rid} is in {len(where.get(rid, ()))} queues: {where.get(rid, [])}")
            elif where[rid][0] in SCHEDULER_PHASES and req.phase not in SCHEDULER_PHASES[where[rid][0]]:
                problems.append(f"request {rid} is in the scheduler's {where[rid][0]} queue in phase {req.phase}")
        problems += [
            f"{rid} is queued ({names}) but not live" for rid, names in where.items() if rid not in self.requests
        ]
        problems += self.role.problems()
        stray = self.scheduler.allocator.owners() - self.requests.keys() - self.role.resting()
        problems += [f"pages owned by {owner!r}, which is not a live request" for owner in sorted(stray)]
        return problems

    def list_requests(self) -> list[dict]:
        now = time.perf_counter()
        return [
            {
                "rid": req.rid,
                "room": req.handoff.room if req.handoff else 0,
                "phase": req.phase.value,
                "age_s": now - req.arrival_s,
                "kv_pages": len(req.page_table.pages),
                "peer": req.handoff.peer if req.handoff else "",
                "prompt_tokens": req.num_prompt_tokens,
                "output_tokens": req.num_outputs,
                **(req.handoff.figures() if req.handoff else {}),
            }
            for req in self.requests.values()
        ]


# the phases a request in the scheduler's own queues may be in (the roles' queues check their own)
# (a choice of an n > 1 request joins the running ones still WAITING, before its first chunk goes out)
SCHEDULER_PHASES = {
    "waiting": {Phase.WAITING},
    "forked": {Phase.WAITING},
    "running": {Phase.WAITING, Phase.PREFILLING, Phase.DECODING},
}


def handoff_fields(h: Handoff | None) -> dict:
    """A hand-off's figures as span attributes."""
    if h is None:
        return {}
    return {f"kvbridge.{k}": v for k, v in ({"room": h.room, "peer": h.peer} | h.figures()).items()}


def _drop(msg: Message) -> None:
    """A pipeline of one rank has nobody to send to."""
