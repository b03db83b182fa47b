"""bench serve's interference mode (see kvbridge/bench/serve.py): decode streams running while long prompts
arrive, on a colocated node pinned to all of --cores against a prefill node and a decode node
pinned to one core each; ITL of the streams before and while the long prompts arrive, and the
long prompts' TTFT."""

from __future__ import annotations

import argparse
import json
import os

from kvbridge.bench import serve_client, serve_data, serve_metrics
from kvbridge.bench.serve import (
    ENGINE_FLAGS,
    STACKS,
    StackBroken,
    check_context,
    log,
    probe_min_tokens,
    ratio,
    row_head,
)
from kvbridge.bench.serve_client import HttpTarget
from kvbridge.bench.serve_data import RandomSpec


def interference(args: argparse.Namespace, pool, tokenizer, vocab: int, max_context: int) -> int:
    from kvbridge.bench.serve_stacks import start_pinned, wait_healthy

    chat = args.endpoint == "chat"
    per_stream = 4  # samples each stream cycles through
    stream_spec = RandomSpec(args.itf_stream_input_len, args.itf_stream_output_len, 0.0)
    long_spec = RandomSpec(args.itf_long_input_len, args.itf_long_output_len, 0.0)
    n_streams = args.itf_streams * per_stream
    flat = serve_data.random_dataset(stream_spec, n_streams, args.seed, chat, tokenizer, vocab)
    streams = [flat[i * per_stream : (i + 1) * per_stream] for i in range(args.itf_streams)]
    longs = serve_data.random_dataset(long_spec, args.itf_long_prompts, args.seed + 1, chat, tokenizer, vocab)
    check_context(flat + longs, max_context)
    arrivals = serve_data.arrival_times(len(longs), args.itf_long_rate, args.burstiness, args.seed)
    engine_flags = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in ENGINE_FLAGS] + ["--model", args.model]
    workload = {
        "streams": args.itf_streams,
        "stream_input_len": args.itf_stream_input_len,
        "stream_output_len": args.itf_stream_output_len,
        "long_prompts": args.itf_long_prompts,
        "long_input_len": args.itf_long_input_len,
        "long_output_len": args.itf_long_output_len,
        "long_rate": args.itf_long_rate,
        "burstiness": args.burstiness,
        "quiet_s": args.itf_quiet_s,
    }
    rows = []
    for name in args.stacks:
        log(f"starting the pinned {name} stack (cores {args.cores}, model {args.model}) ...")
        try:
            stack = start_pinned(
                name, engine_flags, args.cores, args.pp, args.prefill_pp, args.decode_pp, args.request_timeout_s
            )
            wait_healthy(stack)
        except Exception as e:
            log(f"error: the {name} stack failed to start: {type(e).__name__}: {e}")
            return 1
        try:
            try:
                min_tokens = probe_min_tokens(pool, args, stack.url, longs[0])
            except StackBroken as e:
                log(f"error: {e}")
                return 1
            target = HttpTarget(stack.url, args.endpoint, args.model, min_tokens, args.request_timeout_s)
            label = f"{name} interference"
            log(f"{label}: {args.itf_streams} decode streams, {len(longs)} long prompts ...")
            job = (target, streams, longs, arrivals, args.itf_quiet_s, args.warmups, label)
            load_before = os.getloadavg()[0]
            res = pool.submit(serve_client.run_interference, *job).result()
            load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        finally:
            stack.stop()
        row = row_head(args, stack, min_tokens) | {"workload": workload, "loadavg_1m": load} | interference_figures(res)
        rows.append(row)
        print(json.dumps(row), flush=True)
        log(
            f"{label}: stream ITL p99 quiet {row['quiet_itl_ms']['p99']} ms, loaded {row['loaded_itl_ms']['p99']} ms; "
            f"long TTFT p50 {row['long_ttft_ms']['median']} ms"
        )
    print(json.dumps(interference_summary(args, rows)), flush=True)
    return 0


def _stats(values: list[float]) -> dict:
    s = serve_metrics.latency_summary("x", values)
    top = round(max(values) * 1000, 3) if values else None
    return {"mean": s["mean_x_ms"], "median": s["median_x_ms"], "p99": s["p99_x_ms"], "max": top, "n": len(values)}


def interference_figures(res) -> dict:
    longs_ok = [r for r in res.longs if r.ok]
    streams_ok = [r for r in res.streams if r.ok]
    failed = [r.error for r in res.streams + res.longs if not r.ok]
    return {
        "stream_requests": sum(r.ok for r in res.streams),
        "long_completed": len(longs_ok),
        "failed": len(failed),
        "failed_by_reason": {e: failed.count(e) for e in sorted(set(failed))},
        "quiet_window_s": round(res.quiet[1] - res.quiet[0], 3),
        "loaded_window_s": round(res.loaded[1] - res.loaded[0], 3),
        "quiet_itl_ms": _stats(serve_client.gaps_in(res.streams, res.quiet)),
        "loaded_itl_ms": _stats(serve_client.gaps_in(res.streams, res.loaded)),
        "long_ttft_ms": _stats([r.ttft for r in longs_ok]),
        "long_e2el_ms": _stats([r.latency for r in longs_ok]),
        "output_len_mismatches": sum(r.output_len != r.expected_output_len for r in res.streams + res.longs if r.ok),
        "stream_tokens_per_chunk": ratio(
            sum(r.output_len for r in streams_ok), sum(len(r.chunk_times) for r in streams_ok)
        ),
    }


def interference_summary(args: argparse.Namespace, rows: list[dict]) -> dict:
    by = {r["stack"]: r for r in rows}
    ratios = {}
    if all(s in by for s in STACKS):
        d, c = by["disaggregated"], by["colocated"]
        for key in ("quiet_itl_ms", "loaded_itl_ms", "long_ttft_ms"):
            for stat in ("median", "p99"):
                ratios[f"{key[:-3]}_{stat}"] = ratio(d[key][stat], c[key][stat])
    return {
        "bench": "serve",
        "mode": "interference",
        "summary": True,
        "stacks": list(args.stacks),
        "cores": args.cores,
        "ratio_of": "disaggregated/colocated",
        "ratios": ratios,
        "loaded_over_quiet_itl_p99": {
            r["stack"]: ratio(r["loaded_itl_ms"]["p99"], r["quiet_itl_ms"]["p99"]) for r in rows
        },
    }
