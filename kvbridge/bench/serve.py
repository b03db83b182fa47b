"""Serving benchmark: colocated vs disaggregated through the router's OpenAI HTTP endpoint, with
the metric definitions of `vllm bench serve`.

    kvbridge bench serve [--stacks colocated,disaggregated] [--model tiny-random]
        [--pp 1 | --prefill-pp 1 --decode-pp 1] [--endpoint chat|completions]
        [--dataset random|conversation] [--num-prompts 100] [--random-input-len 1024]
        [--random-output-len 128] [--random-range-ratio 0.0]
        [--request-rate inf | --request-rates 1,2,4,8,inf] [--burstiness 1.0] [--max-concurrency N]
        [--goodput ttft:MS tpot:MS e2el:MS] [--seed 0] [--json]
    kvbridge bench serve --base-url http://HOST:PORT [--served-model NAME] [--label vllm] [the load flags]
    kvbridge bench serve --mode interference [--cores 0,1] [--itf-streams 4] [--itf-long-prompts 8] ...
    kvbridge bench serve --mode handoff [--num-prompts 100] [--random-input-len 32] [--random-output-len 4] ...
    kvbridge bench serve --mode tracing [--num-prompts 100] [--max-concurrency 16] ...
    kvbridge bench serve --mode shift [--shift-nodes 4] [--shift-phase-s 30] [--slo-ttft-ms 1000] ...

Sweep mode (default): every stack of `--stacks` is started in this process (the nodes' fronts and
the router here, their ranks in child processes), then for each rate in turn each stack gets the
same dataset (kvbridge/bench/serve_data.py) at that rate: Poisson arrivals (gamma with --burstiness),
behind a semaphore of --max-concurrency when given, after --warmups uncounted requests. The load
generator (kvbridge/bench/serve_client.py) runs in a child process of its own. One JSON line per (stack,
rate) run with vLLM's figures (kvbridge/bench/serve_metrics.py), then a summary line: disaggregated /
colocated ratios at each rate and the low-load TTFT overhead (disaggregated median TTFT minus
colocated median TTFT at the lowest rate, ms).

With --base-url, a sweep drives a server it did not start (vLLM, llama.cpp's llama-server, a
kvbridge router started by hand) with the same load and metrics, its rows labelled --label; --model
names the tokenizer the prompts are built with, --served-model the model name the requests carry.

Interference mode: the disaggregated stack with its prefill node pinned to --cores[0] and its
decode node to --cores[1], against a colocated node pinned to all of --cores (each a
`kvbridge serve|prefill|decode` child process; the router and the load generator unpinned). The
workload: --itf-streams decode streams (closed loops of short prompts with long outputs); once
all are decoding, --itf-quiet-s of streams alone, then --itf-long-prompts long prompts arriving
as a Poisson process at --itf-long-rate. Reported per stack ({mean, median, p99, max, n} in ms):
`quiet_itl_ms` and `loaded_itl_ms`, the decode streams' inter-chunk gaps that ended in the quiet
window and while long prompts arrived (from the first long prompt's send to the last one's end);
`long_ttft_ms` and `long_e2el_ms` of the long prompts; `stream_tokens_per_chunk` (above 1 where
the detokenizer held text back, so a gap spans several tokens). The summary holds the
disaggregated/colocated ratios and each stack's loaded/quiet ITL p99.

Handoff mode (kvbridge/bench/serve_handoff.py): the disaggregation TTFT overhead at low load. Both stacks
as unpinned `kvbridge` child processes; each prompt of the dataset goes to the colocated stack,
then to the disaggregated one, one request at a time. One JSON line per stack (TTFT mean,
median, p99) and a summary with the median of the paired differences (`ttft_overhead_ms`).

Tracing mode (kvbridge/bench/serve_tracing.py): the disaggregated stack as child processes, the
same load four times (tracing off, on, on, off; on = every span exported over OTLP to a receiver in
this process); one JSON line per run and a summary of output tokens/s on over off.

Shift mode (kvbridge/bench/serve_shift.py): a fleet of elastic nodes under traffic that moves from
prefill-heavy to decode-heavy and back; goodput at the SLO of every static P:D split and of the SLO
planner, in one run, and the planner's moves.

Every request is streamed with ignore_eos and max_tokens (and min_tokens, with --min-tokens on,
or auto when a probe request carrying it is accepted), so output lengths are the dataset's.
Progress on stderr. Exit status 2 on a bad flag (one line naming the value), 1 if a stack
failed to start or failed its probe request.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kvbridge.bench import serve_client, serve_data, serve_metrics
from kvbridge.bench.serve_client import HttpTarget
from kvbridge.bench.serve_data import ConversationSpec, RandomSpec, Sample
from kvbridge.engine.config import EngineConfig

STACKS = ("colocated", "disaggregated")
RATIO_KEYS = (
    "request_throughput", "output_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
)  # fmt: skip
ENGINE_FLAGS = ("kv_cache_tokens", "chunked_prefill_size", "max_running_requests", "page_size")


class BenchUsageError(Exception):
    """A bad flag: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BenchUsageError(message)


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = float("nan")
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be a number > 0 or inf, got {text!r}")
    return rate


def _rates(text: str) -> list[float]:
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"--request-rates must be comma-separated rates, got {text!r}")
    return [_rate(t) for t in items]


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    bad = [n for n in names if n not in STACKS]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--stacks takes distinct names from {','.join(STACKS)}, got {text!r}")
    return names


def _mix(text: str):
    from kvbridge.bench.serve_shift import parse_mix

    return parse_mix(text)


def _cores(text: str) -> list[int]:
    try:
        cores = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cores must be comma-separated core numbers, got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if len(set(cores)) != len(cores) or len(cores) < 2 or not set(cores) <= allowed:
        raise argparse.ArgumentTypeError(f"--cores needs >= 2 distinct cores of {sorted(allowed)}, got {text!r}")
    return cores


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kvbridge bench serve", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="sweep", choices=["sweep", "interference", "handoff", "tracing", "shift"])
    ap.add_argument("--stacks", type=_names, default=list(STACKS), help="default: colocated,disaggregated")
    ap.add_argument("--model", default="tiny-random", help="tiny-random (default) | smollm2-135m-instruct | ...")
    ap.add_argument("--pp", type=int, default=1, help="pipeline ranks of the colocated node")
    ap.add_argument("--prefill-pp", type=int, default=1)
    ap.add_argument("--decode-pp", type=int, default=1)
    d = EngineConfig()
    for name in ENGINE_FLAGS:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help="of every node")
    ap.add_argument(
        "--threads", type=int, default=d.threads, help="sweep: torch threads per rank (0: the engine's default)"
    )
    ap.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    ap.add_argument("--dataset", default="random", choices=["random", "conversation"])
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0, help="in [0, 1)")
    ap.add_argument("--conv-system-len", type=int, default=256, help="tokens of the shared system prompt")
    ap.add_argument("--conv-max-turns", type=int, default=4)
    ap.add_argument("--conv-user-len", type=int, default=64)
    ap.add_argument("--conv-output-len", type=int, default=128)
    ap.add_argument("--conv-range-ratio", type=float, default=0.5, help="in [0, 1)")
    ap.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests/s, or inf (default)")
    ap.add_argument("--request-rates", type=_rates, default=None, help="a sweep, e.g. 1,2,4,8,inf")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the intervals; 1 = Poisson")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft, tpot, e2el in ms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmups", type=int, default=2, help="uncounted requests before each run")
    ap.add_argument("--min-tokens", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--cores", type=_cores, default=None, help="interference: P on the first, D on the second")
    ap.add_argument("--itf-streams", type=int, default=4, help="interference: concurrent decode streams")
    ap.add_argument("--itf-stream-input-len", type=int, default=32)
    ap.add_argument("--itf-stream-output-len", type=int, default=256)
    ap.add_argument("--itf-long-prompts", type=int, default=8)
    ap.add_argument("--itf-long-input-len", type=int, default=2048)
    ap.add_argument("--itf-long-output-len", type=int, default=4)
    ap.add_argument("--itf-long-rate", type=float, default=0.5, help="long prompts per second (Poisson)")
    ap.add_argument("--itf-quiet-s", type=float, default=3.0, help="streams alone before the long prompts")
    ap.add_argument("--shift-nodes", type=int, default=4, help="shift: elastic nodes in the fleet")
    ap.add_argument("--shift-phase-s", type=float, default=60.0, help="shift: seconds of each of the 3 phases")
    ap.add_argument("--shift-prefill-heavy", type=_mix, default=_mix("256,8,4.5"), help="shift: IN,OUT,RATE")
    ap.add_argument("--shift-decode-heavy", type=_mix, default=_mix("32,64,6"), help="shift: IN,OUT,RATE")
    ap.add_argument("--shift-step-delay-ms", type=float, default=100.0, help="shift: added to every node's step")
    ap.add_argument("--shift-kv-tokens", type=int, default=2048, help="shift: KV pool of each node, tokens")
    ap.add_argument("--shift-chunk-tokens", type=int, default=64, help="shift: prompt tokens per prefill step")
    ap.add_argument("--slo-ttft-ms", type=float, default=1500.0, help="shift: the TTFT SLO (goodput, planner)")
    ap.add_argument("--slo-itl-ms", type=float, default=150.0, help="shift: the time-per-token SLO (goodput, planner)")
    ap.add_argument("--planner-interval-s", type=float, default=2.0, help="shift: the planner's interval")
    ap.add_argument("--planner-patience", type=int, default=2, help="shift: intervals an SLO miss must hold")
    ap.add_argument("--planner-min-dwell-s", type=float, default=10.0, help="shift: least time a node keeps a role")
    ap.add_argument("--planner-migrate", action="store_true", help="shift: a moved decode node hands its streams on")
    ap.add_argument("--base-url", default=None, help="drive this OpenAI-compatible server instead of starting stacks")
    ap.add_argument("--served-model", default=None, help="with --base-url: the model name its requests carry")
    ap.add_argument("--label", default="external", help="with --base-url: the stack name in the JSON rows")
    ap.add_argument("--log-level", default="error", help="node and router logs on stderr (default: error)")
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    return ap


def check(args: argparse.Namespace) -> None:
    at_least_1 = (
        "num_prompts", "pp", "prefill_pp", "decode_pp", "random_input_len", "random_output_len", "conv_system_len",
        "conv_max_turns", "conv_user_len", "conv_output_len", "itf_streams", "itf_stream_input_len",
        "itf_stream_output_len", "itf_long_prompts", "itf_long_input_len", "itf_long_output_len", "shift_chunk_tokens",
        "shift_kv_tokens", *ENGINE_FLAGS,
    )  # fmt: skip
    for name in at_least_1:
        if getattr(args, name) < 1:
            raise BenchUsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchUsageError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    for name in ("warmups", "threads"):
        if getattr(args, name) < 0:
            raise BenchUsageError(f"--{name} must be >= 0, got {getattr(args, name)}")
    for name in ("random_range_ratio", "conv_range_ratio"):
        if not 0 <= getattr(args, name) < 1:
            raise BenchUsageError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if not args.burstiness > 0:
        raise BenchUsageError(f"--burstiness must be > 0, got {args.burstiness}")
    if not (args.request_timeout_s > 0 and args.itf_quiet_s >= 0):
        raise BenchUsageError(f"--request-timeout-s must be > 0 and --itf-quiet-s >= 0, got {args.request_timeout_s}")
    if not 0 < args.itf_long_rate < float("inf"):
        raise BenchUsageError(f"--itf-long-rate must be a finite number > 0, got {args.itf_long_rate}")
    try:
        args.slo_ms = serve_metrics.parse_goodput(args.goodput)
    except ValueError as e:
        raise BenchUsageError(str(e)) from None
    if args.base_url is not None and args.mode != "sweep":
        raise BenchUsageError(f"--base-url drives a sweep; --mode {args.mode} starts its own stacks")
    if args.base_url is not None and not args.base_url.startswith(("http://", "https://")):
        raise BenchUsageError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    if args.mode == "shift" and args.shift_nodes < 2:
        raise BenchUsageError(f"--shift-nodes must be >= 2 (a prefill and a decode node), got {args.shift_nodes}")
    if args.mode == "shift" and not 0 < args.shift_phase_s < float("inf"):
        raise BenchUsageError(f"--shift-phase-s must be > 0, got {args.shift_phase_s}")
    if args.mode == "interference" and args.cores is None:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 2:
            raise BenchUsageError(f"--mode interference needs 2 cores, this process may use {allowed}")
        args.cores = allowed[:2]


def rate_of(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def log(line: str) -> None:
    print(f"bench serve: {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- datasets


def load_tokenizer(args: argparse.Namespace):
    """(tokenizer, vocab size, context cap) of the model the nodes will serve."""
    from kvbridge.engine.weights import load_model

    try:
        model = load_model(args.model, progress=False)
    except (ValueError, FileNotFoundError) as e:
        raise BenchUsageError(str(e)) from None
    if model.tokenizer is None:
        raise BenchUsageError(f"model {args.model!r} has no tokenizer; bench serve needs one to build prompts")
    return model.tokenizer, model.config.vocab_size, model.config.max_position_embeddings


def build_dataset(args: argparse.Namespace, tokenizer, vocab: int) -> tuple[list[Sample], dict]:
    chat = args.endpoint == "chat"
    if args.dataset == "random":
        spec = RandomSpec(args.random_input_len, args.random_output_len, args.random_range_ratio)
        return serve_data.random_dataset(spec, args.num_prompts, args.seed, chat, tokenizer, vocab), spec.describe()
    spec = ConversationSpec(
        args.conv_system_len, args.conv_max_turns, args.conv_user_len, args.conv_output_len, args.conv_range_ratio
    )
    return serve_data.conversation_dataset(spec, args.num_prompts, args.seed, chat, tokenizer), spec.describe()


def check_context(samples: list[Sample], max_context: int) -> None:
    worst = max(samples, key=lambda s: s.prompt_len + s.output_len)
    if worst.prompt_len + worst.output_len > max_context:
        raise BenchUsageError(
            f"a request of {worst.prompt_len} prompt + {worst.output_len} output tokens exceeds the model's "
            f"context of {max_context}; shorten the lengths"
        )


# ---------------------------------------------------------------------------- runs


class StackBroken(Exception):
    """A started stack that cannot serve one request: exit status 1."""


def probe_min_tokens(pool, args: argparse.Namespace, base_url: str, sample: Sample) -> bool:
    """One short request before any run; says whether requests carry min_tokens: --min-tokens on/off,
    or auto: the probe with it succeeded (else one without it must). StackBroken if none succeeds."""
    tries = [True, False] if args.min_tokens == "auto" else [args.min_tokens == "on"]
    short = Sample(sample.prompt, sample.prompt_len, min(4, sample.output_len))
    errors = []
    for min_tokens in tries:
        target = HttpTarget(base_url, args.endpoint, served_model(args), min_tokens, args.request_timeout_s)
        [rec], _ = pool.submit(serve_client.run_load, target, [short], [0.0], None, 0, "probe").result()
        if rec.ok:
            if errors:
                log(f"a probe with min_tokens failed ({errors[0]}); sending requests without it")
            return min_tokens
        errors.append(rec.error)
    raise StackBroken(f"the probe request to {base_url} failed: {' / '.join(errors)}")


def served_model(args: argparse.Namespace) -> str:
    """The model name requests carry: --served-model, else --model (kvbridge serves it by that name)."""
    return args.served_model or args.model


def row_head(args: argparse.Namespace, stack, min_tokens: bool) -> dict:
    return {
        "bench": "serve",
        "mode": args.mode,
        "stack": stack.name,
        "model": args.model,
        "layout": stack.layout,
        "endpoint": args.endpoint,
        "seed": args.seed,
        "min_tokens": min_tokens,
    }


def ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


@dataclass
class ExternalStack:
    """A server this bench did not start (--base-url): a peer such as vLLM or llama.cpp, or a
    kvbridge fleet started by hand."""

    name: str
    url: str

    @property
    def layout(self) -> dict:
        return {"base_url": self.url}

    def stop(self) -> None:
        pass


def sweep(args: argparse.Namespace, pool, samples: list[Sample], dataset: dict) -> int:
    from kvbridge.bench.serve_stacks import start_in_process, wait_healthy

    config = EngineConfig(
        model=args.model, threads=args.threads, **{name: getattr(args, name) for name in ENGINE_FLAGS}
    )
    rates = args.request_rates or [args.request_rate]
    stacks = []
    if args.base_url is not None:
        args.stacks = [args.label]
        stacks.append(ExternalStack(args.label, args.base_url.rstrip("/")))
    try:
        for name in args.stacks if args.base_url is None else ():
            log(f"starting the {name} stack (model {args.model}) ...")
            stacks.append(
                start_in_process(name, config, args.pp, args.prefill_pp, args.decode_pp, args.request_timeout_s)
            )
            wait_healthy(stacks[-1])
    except Exception as e:
        log(f"error: a stack failed to start: {type(e).__name__}: {e}")
        for s in stacks:
            s.stop()
        return 1
    rows = []
    try:
        min_tokens = all([probe_min_tokens(pool, args, s.url, samples[0]) for s in stacks])
    except StackBroken as e:
        log(f"error: {e}")
        for s in stacks:
            s.stop()
        return 1
    try:
        for rate in rates:
            for stack in stacks:
                label = f"{stack.name} rate {rate_of(rate)}"
                log(f"{label}: {len(samples)} requests ...")
                arrivals = serve_data.arrival_times(len(samples), rate, args.burstiness, args.seed)
                target = HttpTarget(stack.url, args.endpoint, served_model(args), min_tokens, args.request_timeout_s)
                job = (target, samples, arrivals, args.max_concurrency, args.warmups, label)
                load_before = os.getloadavg()[0]
                records, duration = pool.submit(serve_client.run_load, *job).result()
                row = row_head(args, stack, min_tokens) | {
                    "layout": stack.layout | ({"threads": args.threads} if args.base_url is None else {}),
                    "dataset": dataset,
                    "num_prompts": len(samples),
                    "request_rate": rate_of(rate),
                    "burstiness": args.burstiness,
                    "max_concurrency": args.max_concurrency,
                    "goodput_slo_ms": args.slo_ms or None,
                    "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # the host's, before and after
                }
                row |= serve_metrics.compute_metrics(records, duration, args.slo_ms)
                rows.append(row)
                print(json.dumps(row), flush=True)
                log(
                    f"{label}: {row['completed']} done, {row['failed']} failed in {row['duration']:.1f}s, "
                    f"{row['output_throughput']:.0f} tok/s, TTFT p50 {row['median_ttft_ms']} ms"
                )
    finally:
        for s in stacks:
            s.stop()
    print(json.dumps(sweep_summary(args, rows, rates)), flush=True)
    return 0


def sweep_summary(args: argparse.Namespace, rows: list[dict], rates: list[float]) -> dict:
    by = {(r["stack"], r["request_rate"]): r for r in rows}
    both = all(s in args.stacks for s in STACKS)
    ratios = []
    if both:
        for rate in rates:
            d, c = by[("disaggregated", rate_of(rate))], by[("colocated", rate_of(rate))]
            ratios.append({"request_rate": rate_of(rate)} | {k: ratio(d[k], c[k]) for k in RATIO_KEYS})
    low = rate_of(min(rates))
    overhead = None
    if both and by[("disaggregated", low)]["median_ttft_ms"] is not None and by[("colocated", low)]["median_ttft_ms"]:
        overhead = round(by[("disaggregated", low)]["median_ttft_ms"] - by[("colocated", low)]["median_ttft_ms"], 3)
    return {
        "bench": "serve",
        "mode": "sweep",
        "summary": True,
        "stacks": list(args.stacks),
        "request_rates": [rate_of(r) for r in rates],
        "max_concurrency": args.max_concurrency,
        "ratio_of": "disaggregated/colocated",
        "ratios": ratios,
        "low_load_request_rate": low,
        "low_load_ttft_overhead_ms": overhead,
    }


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check(args)
        tokenizer, vocab, max_context = load_tokenizer(args)
        own_data = args.mode in ("interference", "shift")  # (each builds its own requests)
        samples, dataset = build_dataset(args, tokenizer, vocab) if not own_data else (None, None)
        if samples is not None:
            check_context(samples, max_context)
    except BenchUsageError as e:
        print(f"kvbridge bench serve: error: {e}", file=sys.stderr)
        return 2
    from kvbridge.common import logs

    logs.setup(args.log_level)
    # the load generator: a process of its own, so the router's and the fronts' threads here do not
    # share its interpreter lock
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        if args.mode == "sweep":
            return sweep(args, pool, samples, dataset)
        if args.mode == "handoff":
            from kvbridge.bench.serve_handoff import handoff

            return handoff(args, pool, samples, dataset)
        if args.mode == "tracing":
            from kvbridge.bench.serve_tracing import tracing_runs

            return tracing_runs(args, pool, samples, dataset)
        if args.mode == "shift":
            from kvbridge.bench.serve_shift import shift

            return shift(args, pool, tokenizer, vocab)
        from kvbridge.bench.serve_interference import interference

        try:
            return interference(args, pool, tokenizer, vocab, max_context)
        except BenchUsageError as e:
            print(f"kvbridge bench serve: error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
