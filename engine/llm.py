"""The colocated engine: one process runs every stage; the reference for disaggregated serving.

    llm = LLM(EngineConfig(model="tiny-random"))
    [c] = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8))

`step()` is the whole loop: schedule, run the stages, sample, post-process.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine import kernels
from kvbridge.engine.batch import AttentionMetadata, ForwardBatch
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.logits import prompt_logprobs, prompt_spans, split_logits
from kvbridge.engine.model import ModelStage, stage_ranges
from kvbridge.engine.pages import PageAllocator, PageTable
from kvbridge.engine.prefix_cache import PrefixCache
from kvbridge.engine.request import Request
from kvbridge.engine.sampler import Sampler
from kvbridge.engine.scheduler import ChunkPolicy, Scheduler
from kvbridge.engine.weights import LoadedModel, load_model

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)  # EngineConfig checked the spelling
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, and on a CPU where engine/kernels run the bf16 matmuls and the
    attention (AVX-512, and AVX2 + FMA: faster than float32 at every batch measured, on AVX2 decode
    at batch 1 and 8 too; and each row computed the same whatever it is batched or chunked with);
    float32 on other CPUs."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or kernels.bf16_linear() else torch.float32
    return _DTYPES[dtype]


@dataclass
class Completion:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float  # arrival to first token
    e2e_s: float  # arrival to last token
    logprobs: list = field(default_factory=list)  # params.logprobs set: an engine.logits.Logprob per output
    prompt_logprobs: list = field(default_factory=list)  # params.prompt_logprobs set: prompt tokens 1, 2, ...

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first, over the time after the first."""
        decode_s = self.e2e_s - self.ttft_s
        return (len(self.output_ids) - 1) / decode_s if decode_s > 0 else 0.0


class LLM:
    def __init__(
        self,
        config: EngineConfig,
        model: LoadedModel | None = None,
        num_stages: int = 1,
        progress: bool = True,
        chunk_policy: ChunkPolicy | None = None,
    ):
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = model or load_model(config.model, progress=progress)
        mc = self.model.config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.max_context = min(config.max_context or mc.max_position_embeddings, mc.max_position_embeddings)
        self.stages = [
            ModelStage(mc, self.model.weights, r, self.device, self.dtype)
            for r in stage_ranges(mc.num_hidden_layers, num_stages)
        ]
        self.pools = [s.new_kv_pool(config.total_pages, config.page_size) for s in self.stages]
        self.allocator = PageAllocator(config.total_pages, None if config.disable_prefix_cache else PrefixCache())
        self.scheduler = Scheduler(
            config, self.allocator, self.max_context, self.model.tokenizer, mc.eos_token_ids, chunk_policy
        )
        self.sampler = Sampler(mc.eos_token_ids, self.model.tokenizer, mc.vocab_size)
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None, cache_salt: str = ""
    ) -> Request:
        vocab = self.model.config.vocab_size
        if params.n != 1:
            raise ValueError(f"n is {params.n}: the engine runs one choice a request (give each its own seed)")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_context}")
        params = params.resolved(len(prompt_ids), self.max_context, self.config.max_default_tokens)
        longest = min(len(prompt_ids) + params.max_new_tokens, self.max_context)
        pages = -(-longest // self.config.page_size)
        if pages > self.allocator.num_pages:
            raise ValueError(f"request needs {pages} KV pages; the pool has {self.allocator.num_pages}")
        rid = rid or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        req = Request(rid, list(prompt_ids), params, PageTable(self.config.page_size), cache_salt=cache_salt)
        self.sampler.prepare(req)
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def abort(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None:
            self.scheduler.finish(req, "abort")

    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished in it."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        logits, scored = split_logits(step.batch, self._forward(step.batch))
        tokens, logprobs = self.sampler(logits, step.sampled)
        for req, lp in zip(step.sampled, logprobs):
            if lp is not None:
                req.logprobs.append(lp)
        if scored:  # (a preempted request computes its prompt again: those it has are kept)
            rows = prompt_logprobs(step.batch, scored, step.requests)
            for i, first, n in prompt_spans(step.batch, step.requests):
                req, mine, rows = step.requests[i], rows[:n], rows[n:]
                req.prompt_logprobs += mine[len(req.prompt_logprobs) + 1 - first :]
        finished = self.scheduler.postprocess(step, tokens)
        for req in finished:
            del self.requests[req.rid]
        return finished

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion, batched; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.scheduler.num_unfinished:
            self.step()
        return [completion(r) for r in reqs]

    def score(self, ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(ids), vocab]: row t predicts token t + 1. Runs in
        chunks of chunked_prefill_size through the paged cache, beside any running requests."""
        table = PageTable(self.config.page_size)
        owner = f"score-{next(self._ids)}"
        table.pages = self.allocator.allocate(owner, table.num_pages_needed(len(ids)))
        chunk = self.config.chunked_prefill_size or len(ids)
        rows = []
        try:
            for start in range(0, len(ids), chunk):
                piece = ids[start : start + chunk]
                batch = ForwardBatch(
                    rids=(owner,),
                    starts=(start,),
                    q_lens=(len(piece),),
                    page_tables=(tuple(table.pages),),
                    input_ids=tuple(piece),
                    sample=(True,),
                    all_logits=True,
                )
                rows.append(self._forward(batch))
        finally:
            self.allocator.free(owner, table.pages)
        return torch.cat(rows)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        meta = AttentionMetadata.build(batch, self.config.page_size, self.device)
        h = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        for stage, pool in zip(self.stages, self.pools):
            h = stage.forward(meta, h, pool)
        return h

    def enable_dynamic_chunking(self, progress: bool = True) -> None:
        """Profile prefill latency now (the engine must be idle) and size prompt chunks from it."""
        from kvbridge.engine.profile import plan_chunks, prefill_timer

        run = prefill_timer(self.stages, self.pools)
        self.scheduler.chunk_policy = plan_chunks(self.config, run, self.max_context, progress)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()


def completion(req: Request) -> Completion:
    return Completion(
        rid=req.rid,
        prompt_tokens=len(req.prompt_ids),
        output_ids=list(req.output_ids),
        text=req.text,
        finish_reason=req.finish_reason or "",
        ttft_s=(req.first_token_s or req.arrival_s) - req.arrival_s,
        e2e_s=(req.finish_s or req.arrival_s) - req.arrival_s,
        logprobs=list(req.logprobs),
        prompt_logprobs=list(req.prompt_logprobs),
    )
