"""Rank 0 of a pipeline: the node's only scheduler.

The loop keeps up to `pp_loop_size` microbatches in flight. Each turn: take new work
from the inbox, schedule a microbatch if a slot is free, send its description and then
its hidden states to rank 1, and, when the slots are full (or there is nothing new to
launch), wait for the oldest microbatch's tokens from the last rank and post-process
them while later microbatches compute.
"""

from __future__ import annotations

import math
import queue
import time
from collections import deque
from dataclasses import replace

import torch

from engine.batch import AttentionMetadata
from engine.kv_pool import KVPool
from engine.model import ModelStage
from engine.pages import PageTable
from engine.pp.agent import KVAgent
from engine.pp.dist import Link
from engine.pp.wire import ABORT, ADMIT, CONTROL, FINISH, SHUTDOWN, STEP, Decision, DecisionLog, Message
from engine.request import Request, SamplingParams
from engine.sampler import sample
from engine.scheduler import ScheduledStep, Scheduler


class Leader:
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
    ):
        self.stage, self.pool, self.scheduler, self.link = stage, pool, scheduler, link
        self.agent = agent or KVAgent()  # rank 0 holds layers too: it moves their KV like any rank
        self.pp_size, self.loop_size = pp_size, pp_loop_size
        self.last_rank = pp_size - 1
        self.inbox, self.outbox = inbox, outbox
        self.inflight: deque[ScheduledStep] = deque()
        self.requests: dict[str, Request] = {}
        self.log = DecisionLog()  # every decision this node made, in order
        self._unsent: list[Decision] = []  # made but not yet sent down the pipeline
        self.stopping = False
        self.served = 0  # requests retired (any outcome) since start
        # the role, bound once: a pipeline of one rank samples here instead of on rank P-1
        if pp_size == 1:
            self._sampled: deque[list[int]] = deque()
            self._send, self._send_hidden, self._recv_tokens = _drop, self._sample_here, self._take_sampled
        else:
            self._send = self._send_down
            self._send_hidden = self._send_hidden_down
            self._recv_tokens = self._recv_from_last

    # ------------------------------------------------------------------ loop

    def run(self) -> DecisionLog:
        while not (self.stopping and not self.inflight):
            idle = not self.inflight and not self.scheduler.num_unfinished and not self._unsent
            self._drain_inbox(block=idle)
            self._tick()
            step = None
            if len(self.inflight) < self.loop_size and not self.stopping:
                step = self.scheduler.schedule(self._decode_cap())
            if step is not None:
                self._launch(step)
            elif self._unsent:
                self._send(Message(CONTROL, self._take_unsent()))
            if self.inflight and (len(self.inflight) >= self.loop_size or step is None):
                self._complete_oldest()
        self._send(Message(SHUTDOWN, self._take_unsent()))
        self.link.flush()
        return self.log

    def _decode_cap(self) -> int:
        """Spread decoding requests over the stages' microbatches instead of one full batch and idle stages."""
        return max(1, math.ceil(len(self.scheduler.running) / self.pp_size))

    def _launch(self, step: ScheduledStep) -> None:
        for req in step.requests:
            if not req.announced:
                req.announced = True
                self._decide(ADMIT, req.rid, replace(req.params, seed=req.seed))
        self._send(Message(STEP, self._take_unsent(), step.batch))
        meta = AttentionMetadata.build(step.batch, self.pool.page_size, self.stage.device)
        ids = torch.tensor(step.batch.input_ids, dtype=torch.long, device=self.stage.device)
        hidden = self.stage.forward(meta, ids, self.pool)
        self.agent.after_forward(step.batch)
        self._send_hidden(step, hidden)
        self.inflight.append(step)

    def _complete_oldest(self) -> None:
        step = self.inflight.popleft()
        out = self._recv_tokens(step)
        assert out[0] == len(step.sampled), f"last rank sampled {out[0]} rows, expected {len(step.sampled)}"
        live = [not req.finished for req in step.sampled]  # aborted ones drop their token
        finished = self.scheduler.postprocess(step, out[1:])
        for req, tok, was_live in zip(step.sampled, out[1:], live):
            if was_live:
                self.outbox.put(_token_event(req, tok))
        for req in finished:
            self._retire(req, FINISH)

    # ------------------------------------------------------------------ the pipeline

    def _send_down(self, msg: Message) -> None:
        self.link.send_bytes(msg.encode(), 1)

    def _send_hidden_down(self, step: ScheduledStep, hidden: torch.Tensor) -> None:
        self.link.send_tensor(hidden, 1)

    def _recv_from_last(self, step: ScheduledStep) -> list[int]:
        # [count, token...]: a header, so that a step that samples nothing still answers
        return self.link.recv_tensor((len(step.sampled) + 1,), torch.int64, self.last_rank).tolist()

    def _sample_here(self, step: ScheduledStep, logits: torch.Tensor) -> None:
        tokens = sample(logits, step.sampled)
        self.agent.on_sampled(step.batch, tokens)
        self._sampled.append([len(step.sampled), *tokens])

    def _take_sampled(self, step: ScheduledStep) -> list[int]:
        return self._sampled.popleft()

    # ------------------------------------------------------------------ inputs

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        op = msg[0]
        if op == "add":
            _, rid, prompt_ids, params, extra = msg
            req = Request(rid, list(prompt_ids), SamplingParams(**params), PageTable(self.pool.page_size))
            self.requests[rid] = req
            self._admit_new(req, extra)
        elif op == "abort":
            req = self.requests.get(msg[1])
            if req is not None:
                self.scheduler.finish(req, "abort")
                req.finish_s = time.perf_counter()
                self._retire(req, ABORT)
        elif op == "status":
            self.outbox.put(self.status(msg[1]))
        elif op == "shutdown":
            self.stopping = True
            for req in list(self.requests.values()):
                self.scheduler.finish(req, "abort")
                self._retire(req, ABORT)

    def _tick(self) -> None:
        """Once per turn, before scheduling: roles move their own queues here."""

    def _admit_new(self, req: Request, extra: dict) -> None:
        """A new request from the front; roles with queues before scheduling override this."""
        self.scheduler.add(req)

    def status(self, token: int) -> dict:
        alloc = self.scheduler.allocator
        return {
            "event": "status",
            "rid": "",
            "token": token,
            "pages_used": alloc.num_used,
            "pages_total": alloc.num_pages,
            "queues": {
                "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running),
                "inflight_microbatches": len(self.inflight),
            },
            "served": self.served,
        }

    def _retire(self, req: Request, kind: str, **event) -> None:
        """The request is over here: tell every rank (if they know it) and the front."""
        del self.requests[req.rid]
        self.served += 1
        if req.announced:
            self._decide(kind, req.rid)
        self.outbox.put(_finish_event(req, **event))

    def _decide(self, kind: str, rid: str, params: SamplingParams | None = None, info: dict | None = None) -> None:
        d = Decision(self.log.count, kind, rid, params, info)
        self.log.append(d)
        self._unsent.append(d)
        self.agent.on_decision(d)

    def _take_unsent(self) -> tuple[Decision, ...]:
        out, self._unsent = tuple(self._unsent), []
        return out


def _token_event(req: Request, tok: int) -> dict:
    return {"event": "token", "rid": req.rid, "token": tok, "index": len(req.output_ids) - 1}


def _finish_event(req: Request, **extra) -> dict:
    """extra: e.g. error="..." with code="UNAVAILABLE" when the request failed, kv_bytes=..."""
    return {
        "event": "finish",
        "rid": req.rid,
        "finish_reason": req.finish_reason,
        "output_ids": list(req.output_ids),
        "text": req.text,
        "prompt_tokens": len(req.prompt_ids),
        **extra,
    }


def _drop(msg: Message) -> None:
    """A pipeline of one rank has nobody to send to."""
