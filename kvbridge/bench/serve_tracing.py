"""bench serve's tracing mode (see kvbridge/bench/serve.py): what OpenTelemetry tracing costs.

The disaggregated stack (the router here, its prefill and decode nodes as `kvbridge` child
processes) serves the same dataset four times, started afresh each time: tracing off, on, on, off
(ABBA, so that a drift of the host's speed weighs on both settings alike). "On" is every process
exporting every span (sample ratio 1.0) over OTLP/gRPC to a receiver in a child process of its own
(kvbridge/bench/otlp_sink.py; as a collector, it shares no interpreter with the router), which keeps
them as a collector would receive them. One JSON line per
run (vLLM's figures, and the spans received for it), then a summary: output tokens/s with tracing
on over off (the means of the two runs of each), and the spans per request."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time

from kvbridge.bench import serve_client, serve_data, serve_metrics
from kvbridge.bench.otlp_sink import OTLPSink
from kvbridge.bench.serve import ENGINE_FLAGS, StackBroken, log, probe_min_tokens, rate_of, row_head, served_model
from kvbridge.bench.serve_client import HttpTarget
from kvbridge.bench.serve_data import Sample

ORDER = ("off", "on", "on", "off")
SETTLE_S = 2.0  # after a stack stopped: its processes' last spans reach the receiver


def tracing_runs(args: argparse.Namespace, pool, samples: list[Sample], dataset: dict) -> int:
    from kvbridge.bench.serve_stacks import start_unpinned, wait_healthy
    from kvbridge.common import tracing

    sink = _SinkProcess()
    url = sink.url
    engine_flags = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in ENGINE_FLAGS] + ["--model", args.model]
    if args.threads:
        engine_flags += ["--threads", str(args.threads)]
    rate = args.request_rate
    rows: list[dict] = []
    try:
        for i, setting in enumerate(ORDER):
            label = f"tracing {setting} (run {i + 1} of {len(ORDER)})"
            flags = engine_flags + (
                ["--otlp-traces-endpoint", url, "--otlp-traces-sample-ratio", "1"] * (setting == "on")
            )
            if setting == "on":
                tracing.setup("kvbridge-router", url, 1.0)  # (the router runs in this process)
            log(f"{label}: starting the disaggregated stack (model {args.model}, child processes) ...")
            stack = start_unpinned(
                "disaggregated", flags, args.pp, args.prefill_pp, args.decode_pp, args.request_timeout_s
            )
            try:
                wait_healthy(stack)
                min_tokens = probe_min_tokens(pool, args, stack.url, samples[0])
                target = HttpTarget(stack.url, args.endpoint, served_model(args), min_tokens, args.request_timeout_s)
                arrivals = serve_data.arrival_times(len(samples), rate, args.burstiness, args.seed)
                job = (target, samples, arrivals, args.max_concurrency, args.warmups, label)
                log(f"{label}: {len(samples)} requests ...")
                sink.clear()
                records, duration = pool.submit(serve_client.run_load, *job).result()
            finally:
                stack.stop()
                tracing.shutdown()
            time.sleep(SETTLE_S if setting == "on" else 0)
            row = row_head(args, stack, min_tokens) | {
                "mode": "tracing",
                "tracing": setting,
                "run": i + 1,
                "layout": stack.layout | {"threads": args.threads},
                "dataset": dataset,
                "num_prompts": len(samples),
                "request_rate": rate_of(rate),
                "max_concurrency": args.max_concurrency,
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
            row |= serve_metrics.compute_metrics(records, duration, args.slo_ms)
            row["spans_received"], row["traces_received"] = sink.count()
            rows.append(row)
            print(json.dumps(row), flush=True)
            log(f"{label}: {row['output_throughput']:.0f} tok/s, {row['spans_received']} spans")
    except (StackBroken, RuntimeError) as e:
        log(f"error: {e}")
        return 1
    finally:
        sink.stop()
    print(json.dumps(summary(rows)), flush=True)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


class _SinkProcess:
    """An OTLPSink in a child process: the spans stay there, the counts come back over a pipe."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_sink, args=(child,), name="otlp-sink", daemon=True)
        self._proc.start()
        self.url = self._conn.recv()

    def _ask(self, what: str):
        self._conn.send(what)
        return self._conn.recv()

    def clear(self) -> None:
        self._ask("clear")

    def count(self) -> tuple[int, int]:
        """(spans, distinct traces) received since the last clear."""
        return self._ask("count")

    def stop(self) -> None:
        self._ask("stop")
        self._proc.join(timeout=10)


def _serve_sink(conn) -> None:
    sink = OTLPSink()
    conn.send(sink.start())
    while True:
        what = conn.recv()
        if what == "count":
            spans = sink.spans
            conn.send((len(spans), len({s.trace_id for s in spans})))
        elif what == "clear":
            sink.clear()
            conn.send(None)
        else:
            sink.stop()
            conn.send(None)
            return


def summary(rows: list[dict]) -> dict:
    def mean(setting: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rows if r["tracing"] == setting)

    on, off = mean("on", "output_throughput"), mean("off", "output_throughput")
    ratio = on / off if off else None
    traced = [r for r in rows if r["tracing"] == "on"]
    return {
        "bench": "serve",
        "mode": "tracing",
        "summary": True,
        "output_throughput": {"on": round(on, 2), "off": round(off, 2)},
        "on_over_off": round(ratio, 4) if ratio is not None else None,
        "within_5_percent": ratio is not None and ratio >= 0.95,
        "median_ttft_ms": {
            "on": round(mean("on", "median_ttft_ms"), 3),
            "off": round(mean("off", "median_ttft_ms"), 3),
        },
        "spans_per_request": round(statistics.fmean(r["spans_received"] / max(r["completed"], 1) for r in traced), 2),
        "every_request_traced": all(r["traces_received"] >= r["completed"] for r in traced),
    }
