"""Start-up profiling of prefill latency, feeding the dynamic chunk planner (engine/chunking.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvbridge.engine.batch import AttentionMetadata, ForwardBatch
from kvbridge.engine.chunking import ChunkPlanner, default_profile_lengths, profile_prefill
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.kv_pool import KVPool
from kvbridge.engine.model import ModelStage


def prefill_timer(stages: list[ModelStage], pools: list[KVPool]) -> Callable[[int], float]:
    """run(length) -> seconds to prefill `length` tokens from an empty cache through the stages.

    Call only while the node is idle: it writes pages [0, length / page_size) of the pools."""
    page_size = pools[0].page_size

    def run(length: int) -> float:
        batch = ForwardBatch(
            rids=("profile",),
            starts=(0,),
            q_lens=(length,),
            page_tables=(tuple(range(-(-length // page_size))),),
            input_ids=(1,) * length,
            sample=(True,),
        )
        device = stages[0].device
        t0 = time.perf_counter()
        meta = AttentionMetadata.build(batch, page_size, device)
        h = torch.tensor(batch.input_ids, dtype=torch.long, device=device)
        for stage, pool in zip(stages, pools):
            h = stage.forward(meta, h, pool)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    return run


def plan_chunks(
    config: EngineConfig, run: Callable[[int], float], max_context: int, progress: bool = True
) -> ChunkPlanner:
    """Profile prefill latency and fit the dynamic planner (fixed chunks, with a warning, on a bad fit)."""
    base = config.chunked_prefill_size
    if base < 1:
        raise ValueError("dynamic chunking needs a base chunk: --chunked-prefill-size must be > 0")
    cap = min(max_context - 1, config.total_pages * config.page_size)
    lengths = default_profile_lengths(base, cap)
    latencies = profile_prefill(run, lengths, progress)
    return ChunkPlanner.from_profile(lengths, latencies, base, config.page_size, max_context)
