"""Time to first token of one long prompt: one process vs a pipeline of ranks.

    python -m kvbridge.bench.pp [--prompt-tokens 4096] [--repeats 2] [--json]

For each setup (pp 1 and pp 2, fixed and dynamic chunks) it starts the engine, warms it
up, then times `repeats` runs of the prompt with max_new_tokens=1. One JSON line each;
the last line holds the ratios to pp 1 with fixed chunks. Progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.engine.llm import LLM
from kvbridge.pipeline.group import RankGroup

SETUPS = [  # (pp_size, dynamic chunking)
    (1, False),
    (1, True),
    (2, False),
    (2, True),
]


def time_to_first_token(engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    [c] = engine.generate([prompt], SamplingParams(max_new_tokens=1))
    assert len(c.output_ids) == 1
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench pp", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunked-prefill-size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.prompt_tokens < 2:
        print(f"bench pp: error: bad --repeats {args.repeats} or --prompt-tokens {args.prompt_tokens}", file=sys.stderr)
        return 2
    config = EngineConfig(
        model=args.model, chunked_prefill_size=args.chunked_prefill_size, kv_cache_tokens=args.prompt_tokens + 512
    )
    g = torch.Generator().manual_seed(0)
    rows = []
    for pp_size, dynamic in SETUPS:
        print(f"bench pp: pp={pp_size} dynamic={dynamic} ...", file=sys.stderr)
        if pp_size == 1:
            engine = LLM(config, progress=True)
            if dynamic:
                engine.enable_dynamic_chunking()
            vocab = engine.model.config.vocab_size
        else:
            engine = RankGroup(config, PPConfig(pp_size=pp_size, enable_dynamic_chunking=dynamic), progress=True)
            vocab = engine.model.config.vocab_size
        try:
            prompt = torch.randint(100, vocab, (args.prompt_tokens,), generator=g).tolist()
            time_to_first_token(engine, prompt[:64])  # warm-up
            times = [time_to_first_token(engine, prompt) for _ in range(args.repeats)]
        finally:
            if pp_size > 1:
                engine.shutdown()
        row = {
            "bench": "pp",
            "model": args.model,
            "pp": pp_size,
            "chunks": "dynamic" if dynamic else "fixed",
            "base_chunk": args.chunked_prefill_size,
            "prompt_tokens": args.prompt_tokens,
            "cpus": os.cpu_count(),
            "ttft_s": round(statistics.median(times), 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["ttft_s"]
    print(
        json.dumps(
            {
                "bench": "pp",
                "ttft_vs_pp1_fixed": {f"pp{r['pp']}-{r['chunks']}": round(r["ttft_s"] / base, 3) for r in rows},
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
