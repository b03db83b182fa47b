"""bench serve's handoff mode (see kvbridge/bench/serve.py): the disaggregation TTFT overhead at low load.

Both stacks run at once as `kvbridge serve|prefill|decode` child processes (as deployed: no
front shares this process's interpreter lock; the router runs here). The load generator sends
the samples one at a time, each to the colocated stack and then to the disaggregated one, so
the two see the same prompts under the same host load; the overhead is the median of the
paired differences (disaggregated TTFT minus colocated TTFT of the same prompt)."""

from __future__ import annotations

import argparse
import json
import statistics

from kvbridge.bench import serve_client, serve_metrics
from kvbridge.bench.serve import ENGINE_FLAGS, STACKS, StackBroken, log, probe_min_tokens, row_head
from kvbridge.bench.serve_client import HttpTarget
from kvbridge.bench.serve_data import Sample


def handoff(args: argparse.Namespace, pool, samples: list[Sample], dataset: dict) -> int:
    from kvbridge.bench.serve_stacks import start_unpinned, wait_healthy

    engine_flags = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in ENGINE_FLAGS] + ["--model", args.model]
    if args.threads:
        engine_flags += ["--threads", str(args.threads)]
    stacks = []
    try:
        for name in STACKS:
            log(f"starting the {name} stack (model {args.model}, child processes) ...")
            stack = start_unpinned(name, engine_flags, args.pp, args.prefill_pp, args.decode_pp, args.request_timeout_s)
            stacks.append(stack)
            wait_healthy(stack)
        min_tokens = all([probe_min_tokens(pool, args, s.url, samples[0]) for s in stacks])
    except (StackBroken, RuntimeError) as e:
        log(f"error: {e}")
        for s in stacks:
            s.stop()
        return 1
    try:
        targets = [HttpTarget(s.url, args.endpoint, args.model, min_tokens, args.request_timeout_s) for s in stacks]
        log(f"{len(samples)} prompts, one at a time, each to both stacks ...")
        by_stack = pool.submit(serve_client.run_pairs, targets, samples, args.warmups).result()
    finally:
        for s in stacks:
            s.stop()
    rows = []
    for stack, records in zip(stacks, by_stack):
        ttfts = [r.ttft for r in records if r.ok]
        row = row_head(args, stack, min_tokens) | {
            "layout": stack.layout | {"threads": args.threads},
            "dataset": dataset,
            "num_prompts": len(records),
            "failed": sum(not r.ok for r in records),
        }
        row |= serve_metrics.latency_summary("ttft", ttfts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    colocated, disaggregated = by_stack
    paired = [(d.ttft - c.ttft) * 1e3 for c, d in zip(colocated, disaggregated) if c.ok and d.ok]
    summary = {
        "bench": "serve",
        "mode": "handoff",
        "summary": True,
        "pairs": len(paired),
        "ttft_overhead_ms": {
            "median": round(statistics.median(paired), 3) if paired else None,
            "mean": round(statistics.fmean(paired), 3) if paired else None,
        },
        "median_ttft_ms": {r["stack"]: r["median_ttft_ms"] for r in rows},
    }
    print(json.dumps(summary), flush=True)
    log(f"TTFT overhead of disaggregation (median of {len(paired)} pairs): {summary['ttft_overhead_ms']['median']} ms")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
