"""Ranks 1..P-1 of a pipeline: execute what rank 0 describes, in the order it was sent.

Every message's decisions are applied first (exactly once, in order: the decision log of
every rank is rank 0's). A middle rank forwards the description and its output hidden
states; the last rank samples and returns the tokens to rank 0. Which of the two a rank
does is bound once, at start-up.
"""

from __future__ import annotations

import time

import torch

from kvbridge.engine import faults
from kvbridge.engine.batch import AttentionMetadata, ForwardBatch
from kvbridge.engine.kv_pool import KVPool
from kvbridge.engine.logits import logprob_width, pack_logprobs, prompt_logprobs, prompt_spans, split_logits
from kvbridge.engine.model import ModelStage
from kvbridge.engine.request import Request
from kvbridge.engine.sampler import Sampler
from kvbridge.pipeline import cores
from kvbridge.pipeline.agent import KVAgent
from kvbridge.pipeline.dist import Link
from kvbridge.pipeline.log import ADMIT, APPEND, ENDS, REUSE, SHUTDOWN, STEP, LogEntry, Message, PipelineLog
from kvbridge.pipeline.metrics import RankRecorder


class StageLoop:
    def __init__(
        self,
        rank: int,
        pp_size: int,
        stage: ModelStage,
        pool: KVPool,
        link: Link,
        agent: KVAgent | None = None,
        tokenizer=None,
        recorder: RankRecorder | None = None,
    ):
        self.rank, self.stage, self.pool, self.link = rank, stage, pool, link
        self.agent = agent or KVAgent()
        self.recorder = recorder or RankRecorder()
        self.prev = rank - 1
        self.is_last = rank == pp_size - 1
        self.emit = self._return_tokens if self.is_last else self._forward
        self.live: dict[str, Request] = {}  # admitted requests: the last rank's sampler state
        self.sampler = None
        if self.is_last and stage is not None:
            self.sampler = Sampler(stage.config.eos_token_ids, tokenizer, stage.config.vocab_size)
        self.reused: dict[str, list[int]] = {}  # rid -> the cached pages its next chunk must start from (REUSE)
        self.log = PipelineLog()

    def run(self) -> PipelineLog:
        while True:
            raw = self.link.recv_bytes(self.prev)
            msg = Message.decode(raw)
            self._apply(msg.decisions)
            if msg.kind == STEP:
                cores.refresh()
                b = msg.batch
                if self.reused:
                    self._check_reuse(b)
                meta = AttentionMetadata.build(b, self.pool.page_size, self.stage.device)
                shape = (b.num_tokens, self.stage.config.hidden_size)
                hidden = self.link.recv_tensor(shape, self.stage.dtype, self.prev).to(self.stage.device)
                began = time.time_ns()
                out = self.stage.forward(meta, hidden, self.pool)
                self.recorder.forwarded(self.rank, b, began)
                faults.current().after_step()
                self.agent.after_forward(b)
                self.emit(raw, msg, meta, out)
            elif not self.is_last:
                self.link.send_bytes(raw, self.rank + 1)
            if msg.kind == SHUTDOWN:
                self.link.flush()
                return self.log

    def _apply(self, decisions: tuple[LogEntry, ...]) -> None:
        for d in decisions:
            self.log.append(d)  # raises on a gap or a repeat
            if d.kind == ADMIT:
                # (the prompt comes when the params need the request's tokens: penalties, grammars)
                self.live[d.rid] = req = Request(d.rid, list(d.info.prompt), d.params, None)
                req.resumed = d.info.resumed
                req.num_sampled = d.info.first_sample_index
                self.recorder.traced(d.rid, d.info.trace)
                if self.sampler is not None:
                    self.sampler.prepare(req)
            elif d.kind == APPEND:
                self.live[d.rid].output_ids.extend(d.info.ids)
            elif d.kind == REUSE:
                self.reused[d.rid] = list(d.info.pages)
            elif d.kind in ENDS:
                del self.live[d.rid]
                self.recorder.untraced(d.rid)
                self.reused.pop(d.rid, None)
            self.agent.on_decision(d)

    def _check_reuse(self, b: ForwardBatch) -> None:
        """A request's chunk after its REUSE starts right after those pages, at their place in its
        table: this rank reads the prefix rank 0 decided on, or stops (it would compute garbage)."""
        for rid, start, table in zip(b.rids, b.starts, b.page_tables):
            pages = self.reused.pop(rid, None)
            if pages is not None and (start != len(pages) * self.pool.page_size or list(table[: len(pages)]) != pages):
                raise AssertionError(f"rank {self.rank}: {rid} starts at {start} on pages {table[:8]}, not on {pages}")

    def _forward(self, raw: bytes, msg: Message, meta: AttentionMetadata, hidden: torch.Tensor) -> None:
        self.link.send_bytes(raw, self.rank + 1)
        self.link.send_tensor(hidden, self.rank + 1)

    def _return_tokens(self, raw: bytes, msg: Message, meta: AttentionMetadata, logits: torch.Tensor) -> None:
        """To rank 0: the tokens; their logprobs when asked for; the prompt logprobs of scored chunks."""
        b = msg.batch
        sampled = [self.live[rid] for rid, s in zip(b.rids, b.sample) if s]
        logits, scored = split_logits(b, logits)
        tokens, logprobs = self.sampler(logits, sampled)
        for req, token in zip(sampled, tokens):
            if req.params.needs_history:
                req.output_ids.append(token)
        self.agent.on_sampled(b, tokens, logprobs)
        self.link.send_tensor(torch.tensor([len(tokens), *tokens], dtype=torch.int64), 0)
        if width := logprob_width([req.params.logprobs for req in sampled]):
            self.link.send_tensor(pack_logprobs(logprobs, width), 0)
        if scored:
            requests = [self.live.get(rid) for rid in b.rids]
            if rows := prompt_logprobs(b, scored, requests):
                width = logprob_width([requests[i].params.prompt_logprobs for i, _, _ in prompt_spans(b, requests)])
                self.link.send_tensor(pack_logprobs(rows, width), 0)
