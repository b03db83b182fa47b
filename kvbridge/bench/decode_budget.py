"""Inter-token latency of decode streams while long prompts arrive, the decode budget
(--decode-step-target-ms, issue 41) off and on, side by side in one run on one engine.

    python -m kvbridge.bench.decode_budget [--model smollm2-135m-instruct] [--streams 8,32]
        [--stream-prompt-tokens 32] [--stream-output-tokens 256] [--long-prompts 4]
        [--long-prompt-tokens 1024] [--long-output-tokens 4] [--long-interval-s 1.0]
        [--chunked-prefill-size 512] [--decode-step-target-ms 0] [--decode-step-min-prefill 64]
        [--quiet-steps 8] [--budgets off,on] [--threads 0] [--seed 0] [--json]

One colocated engine (engine/llm.py, in this process, no prefix cache, fixed chunks of
--chunked-prefill-size); with the budget on, its steps are priced by what they measurably took
(`Scheduler.step_costs`, engine/chunking.py). For each stream count, then each budget
setting: that many decode streams (closed loops: a stream that ends is replaced at once, so that
many decode all the time), --quiet-steps steps of streams alone, then --long-prompts long prompts
arriving every --long-interval-s seconds, until the last one ends; then the streams are aborted.
With the target 0 (auto), a budget-on run's target is twice the median step of its own quiet steps.

One JSON line per (streams, budget): the streams' gaps between tokens (`quiet_itl_ms`: in the
quiet steps; `loaded_itl_ms`: gaps that ended from the first long prompt's arrival to the last one's
end; {median, p99, max, n}), the long prompts' `long_ttft_ms`, the most prompt tokens a step beside
decodes held, the target used, and the step costs measured at the end (`decode_step_ms`, a step of
the decodes alone; `prompt_token_ms`, a prompt token beside them). Then a summary line
per stream count: on/off ratios, and whether the long prompts' greedy outputs were equal on and off
(they must be: chunking changes no token).
Progress on stderr. The host may be shared: `loadavg_1m` is the host's before and after each run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from kvbridge.common.progress import Progress
from kvbridge.common.sampling import SamplingParams

BUDGETS = ("off", "on")


def log(line: str) -> None:
    print(f"bench decode_budget: {line}", file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _budgets(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    if not names or any(n not in BUDGETS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--budgets takes distinct names of {','.join(BUDGETS)}, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvbridge bench decode_budget", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=_ints, default=[8, 32], help="decode stream counts, e.g. 8,32")
    ap.add_argument("--stream-prompt-tokens", type=int, default=32)
    ap.add_argument("--stream-output-tokens", type=int, default=256)
    ap.add_argument("--long-prompts", type=int, default=4)
    ap.add_argument("--long-prompt-tokens", type=int, default=1024)
    ap.add_argument("--long-output-tokens", type=int, default=4)
    ap.add_argument("--long-interval-s", type=float, default=1.0, help="seconds between long prompts")
    ap.add_argument("--chunked-prefill-size", type=int, default=512)
    ap.add_argument("--decode-step-target-ms", type=float, default=0.0, help="0: twice the quiet step (auto)")
    ap.add_argument("--decode-step-min-prefill", type=int, default=64)
    ap.add_argument("--quiet-steps", type=int, default=8)
    ap.add_argument("--budgets", type=_budgets, default=list(BUDGETS), help="default: off,on")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    return ap


def check(args: argparse.Namespace) -> str | None:
    """The first bad flag, as one line, or None."""
    for name in ("stream_prompt_tokens", "stream_output_tokens", "long_prompts", "long_prompt_tokens",
                 "long_output_tokens", "chunked_prefill_size", "decode_step_min_prefill", "quiet_steps"):  # fmt: skip
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if not args.streams or min(args.streams) < 1:
        return f"--streams must be counts >= 1, got {args.streams}"
    if not (args.long_interval_s >= 0 and args.decode_step_target_ms >= 0 and args.threads >= 0):
        return "--long-interval-s, --decode-step-target-ms and --threads must be >= 0"
    return None


def stats_ms(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p99": None, "max": None, "n": 0}
    ms = np.asarray(values) * 1000
    return {
        "median": round(float(np.median(ms)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
        "max": round(float(ms.max()), 3),
        "n": len(values),
    }


class BudgetRun:
    """One (streams, budget) run on `llm`: its steps, each stream's token times, the long prompts."""

    def __init__(self, llm, args: argparse.Namespace, streams: int, budget: str, prompts: dict):
        self.llm, self.args, self.budget, self.prompts = llm, args, budget, prompts
        self.n_streams = streams
        self.stream_params = SamplingParams(max_new_tokens=args.stream_output_tokens, ignore_eos=True)
        self.long_params = SamplingParams(max_new_tokens=args.long_output_tokens, ignore_eos=True)
        self.live: list = []  # the streams now running
        self.times: dict[str, list[float]] = {}  # stream rid -> when each of its tokens came
        self.made = 0
        self.step_s: list[float] = []
        self.max_prompt_beside_decodes = 0

    def _new_stream(self) -> None:
        p = self.prompts["streams"][self.made % len(self.prompts["streams"])]
        req = self.llm.add_request(p, self.stream_params, rid=f"s{self.n_streams}-{self.budget}-{self.made}")
        self.made += 1
        self.live.append(req)
        self.times[req.rid] = []

    def step(self) -> None:
        t0 = time.perf_counter()
        self.llm.step()
        now = time.perf_counter()
        self.step_s.append(now - t0)
        for req in self.live:
            while len(self.times[req.rid]) < len(req.output_ids):
                self.times[req.rid].append(now)
        ended = [r for r in self.live if r.finished]
        self.live = [r for r in self.live if not r.finished]
        for _ in ended:
            self._new_stream()

    def gaps(self, start: float, end: float) -> list[float]:
        return [
            b - a
            for ts in self.times.values()
            for a, b in itertools.pairwise(ts)
            if start <= b <= end and b > a  # (tokens of one step arrive together: no gap between them)
        ]

    def go(self, target_ms: float) -> dict:
        llm, args = self.llm, self.args
        sched = llm.scheduler
        config = sched.config
        schedule = sched.schedule

        def recording(max_decodes=None):  # the most prompt tokens a step beside decodes held
            st = schedule(max_decodes)
            if st is not None:
                decodes = sum(1 for n, s in zip(st.batch.q_lens, st.batch.sample) if n == 1 and s)
                prompt = sum(n for n in st.batch.q_lens if n > 1)
                if decodes:
                    self.max_prompt_beside_decodes = max(self.max_prompt_beside_decodes, prompt)
            return st

        sched.schedule = recording
        try:
            sched.config = replace(config, decode_step_target_ms=0.0)
            for _ in range(self.n_streams):
                self._new_stream()
            while any(not r.output_ids for r in self.live):  # every stream decoding
                self.step()
            quiet_start = time.perf_counter()
            first = len(self.step_s)
            for _ in range(args.quiet_steps):
                self.step()
            quiet = (quiet_start, time.perf_counter())
            quiet_step = statistics.median(self.step_s[first:])
            if self.budget == "on":
                target_ms = target_ms or round(2000 * quiet_step, 3)
                sched.config = replace(config, decode_step_target_ms=target_ms)
            self.max_prompt_beside_decodes = 0
            longs, arrived = [], []
            t_first = time.perf_counter()
            with Progress(f"{self.n_streams} streams, budget {self.budget}", args.long_prompts) as bar:
                while len(longs) < args.long_prompts or not all(r.finished for r in longs):
                    now = time.perf_counter()
                    while len(longs) < args.long_prompts and now >= t_first + len(longs) * args.long_interval_s:
                        i = len(longs)
                        longs.append(llm.add_request(self.prompts["longs"][i], self.long_params, rid=f"long-{i}"))
                        arrived.append(now)
                    done = sum(r.finished for r in longs)
                    self.step()
                    bar.advance(sum(r.finished for r in longs) - done)
            loaded = (t_first, max(r.finish_s for r in longs))
        finally:
            for req in self.live:
                llm.abort(req.rid)
            sched.schedule, sched.config = schedule, config
        assert llm.allocator.num_used == 0, llm.allocator.num_used
        return {
            "decode_step_target_ms": target_ms if self.budget == "on" else 0.0,
            "quiet_step_ms": round(1000 * quiet_step, 3),
            "decode_step_ms": _ms(sched.step_costs.decode_s),
            "prompt_token_ms": _ms(sched.step_costs.token_s),
            "quiet_itl_ms": stats_ms(self.gaps(*quiet)),
            "loaded_itl_ms": stats_ms(self.gaps(*loaded)),
            "loaded_window_s": round(loaded[1] - loaded[0], 3),
            "long_ttft_ms": stats_ms([r.first_token_s - a for r, a in zip(longs, arrived)]),
            "max_prompt_tokens_beside_decodes": self.max_prompt_beside_decodes,
            "steps": len(self.step_s),
            "long_outputs": [list(r.output_ids) for r in longs],
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 4)


def ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check(args)
    if problem:
        print(f"kvbridge bench decode_budget: error: {problem}", file=sys.stderr)
        return 2
    from kvbridge.engine.config import EngineConfig
    from kvbridge.engine.llm import LLM

    top = max(args.streams)
    need = top * (args.stream_prompt_tokens + args.stream_output_tokens + 16)
    need += args.long_prompts * (args.long_prompt_tokens + args.long_output_tokens + 16)
    config = EngineConfig(
        model=args.model,
        chunked_prefill_size=args.chunked_prefill_size,
        decode_step_min_prefill=args.decode_step_min_prefill,
        kv_cache_tokens=max(need, 4 * args.chunked_prefill_size + 64),
        max_running_requests=top + args.long_prompts,
        disable_prefix_cache=True,  # (the long prompts repeat in every run: each computes them)
        threads=args.threads,
    )
    log(f"loading {args.model} ...")
    llm = LLM(config, progress=True)
    longest = args.long_prompt_tokens + args.long_output_tokens
    if max(args.stream_prompt_tokens + args.stream_output_tokens, longest) > llm.max_context:
        print(
            f"kvbridge bench decode_budget: error: a request exceeds the context of {llm.max_context}", file=sys.stderr
        )
        return 2
    vocab = llm.model.config.vocab_size
    rng = random.Random(args.seed)
    prompts = {
        "streams": [[rng.randrange(100, vocab) for _ in range(args.stream_prompt_tokens)] for _ in range(64)],
        "longs": [
            [rng.randrange(100, vocab) for _ in range(args.long_prompt_tokens)] for _ in range(args.long_prompts)
        ],
    }
    head = {
        "bench": "decode_budget",
        "model": args.model,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "cpus": len(os.sched_getaffinity(0)),
        "chunked_prefill_size": args.chunked_prefill_size,
        "decode_step_min_prefill": args.decode_step_min_prefill,
        "stream_prompt_tokens": args.stream_prompt_tokens,
        "long_prompts": args.long_prompts,
        "long_prompt_tokens": args.long_prompt_tokens,
        "long_interval_s": args.long_interval_s,
    }
    llm.generate([prompts["streams"][0]], SamplingParams(max_new_tokens=4))  # warm-up
    for streams in args.streams:
        rows = {}
        for budget in args.budgets:
            log(f"{streams} streams, budget {budget} ...")
            load = os.getloadavg()[0]
            row = BudgetRun(llm, args, streams, budget, prompts).go(args.decode_step_target_ms)
            outputs = row.pop("long_outputs")
            row = head | {"streams": streams, "budget": budget} | row
            row["loadavg_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            rows[budget] = (row, outputs)
            print(json.dumps(row), flush=True)
            log(
                f"{streams} streams, budget {budget}: ITL p99 quiet {row['quiet_itl_ms']['p99']} ms, loaded "
                f"{row['loaded_itl_ms']['p99']} ms; long TTFT p50 {row['long_ttft_ms']['median']} ms"
            )
        if set(rows) == set(BUDGETS):
            on, off = rows["on"][0], rows["off"][0]
            summary = {"bench": "decode_budget", "summary": True, "streams": streams, "ratio_of": "on/off"}
            for key in ("loaded_itl_ms", "long_ttft_ms"):
                for stat in ("median", "p99"):
                    summary[f"{key[:-3]}_{stat}"] = ratio(on[key][stat], off[key][stat])
            summary["long_outputs_equal"] = rows["on"][1] == rows["off"][1]
            print(json.dumps(summary), flush=True)
            if not summary["long_outputs_equal"]:
                log("error: the long prompts' greedy outputs differ with the budget on and off")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
