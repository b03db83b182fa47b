"""Soak: minutes of mixed, partly cancelled traffic through a router over a prefill node and a
decode node with faults injected; then checks that nothing leaked and no process died.

    python -m kvbridge.bench.soak [--minutes 5 | --seconds 30] [--concurrency 8] [--model tiny-random]
                         [--prefill-pp 2] [--decode-pp 2] [--cancel-rate 0.1]
                         [--fault-inject "transfer_fail=0.02,transfer_delay_ms=20"]
                         [--prefill-faults SPEC] [--decode-faults SPEC]

The fleet (a prefill node, a decode node, a router; every process serves /metrics on a free
port) runs in this process and its rank processes. The faults of a node are `--fault-inject`
followed by its own `--prefill-faults` / `--decode-faults` (engine/faults.py; a later item
overrides an earlier one, e.g. --decode-faults rank1:transfer_fail=0.05); each node draws
from its own random stream unless a spec names a seed. Node timeouts are short
(`--node-timeout-s`), so a request whose hand-off failed ends within seconds.

`--concurrency` clients loop until the time is up, each sending one request at a time, drawn
at random: gRPC streams (through the router's Generation) and OpenAI HTTP requests, streamed
(server-sent events) or not; prompts of token ids, text or chat, short to long; max_new_tokens
1 to 128; greedy, seeded or unseeded sampling; some with ignore_eos. A `--cancel-rate`
fraction is cancelled by the client at a random moment (the gRPC call cancelled, the HTTP
socket shut). Some seeded or greedy gRPC requests repeat an earlier one exactly: their tokens
must be the same (`replay_mismatches`). Progress on stderr every 10 s.

Once the clients are done the nodes get `--settle-s` to drain (pages back, no request, queue or
transfer left); what remains then is a leak. Then everything is stopped. One JSON line:

    requests = served + sum(failed_by_reason) + cancelled   (client-side outcomes)
    ttft_s / itl_s: streamed requests only; e2e_s: served requests; failed_e2e_s: failed ones
                    (how soon a failure reached the client); seconds, client-side
    tokens_per_s: tokens received by clients per second of traffic (gRPC: any outcome; HTTP:
                  the usage of finished requests); _windows: the same over each 10 s (a trend)
    retries: the router's kvbridge_router_retries_total
    transfer_failures: kvbridge_kv_transfer_failures_total summed over both nodes' ranks
    pages_used_start / _end, requests_in_flight_end: Admin GetStatus of each node (and router)
    rss_mb_start / _end: VmRSS of this process (front: the nodes' fronts, router, clients) and
                         of every rank process; cpu_s: CPU seconds each used from start to end
    leaks, dead_processes, invariant_violations, status_errors, rank_errors, logs_agree, shm_left

Exit status 1 if anything leaked, a process died, an invariant broke, a rank reported an error,
ranks' decision logs differ, a /dev/shm segment was left, or a replay differed; 2 on bad flags.

Here: the flags, main() and the traffic phase. The clients are in soak_load.py, the fleet's
start and stop in soak_fleet.py, the end-of-run checks and the JSON row in soak_checks.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from kvbridge.bench import soak_checks, soak_fleet
from kvbridge.bench.soak_fleet import dead_processes, rss_mb
from kvbridge.bench.soak_load import Traffic

DEFAULT_FAULTS = "transfer_fail=0.02,transfer_delay_ms=20"
REPORT_EVERY_S = 10.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvbridge bench soak", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="traffic duration (default: 5)")
    ap.add_argument("--seconds", type=float, default=None, help="traffic duration in seconds (overrides --minutes)")
    ap.add_argument("--model", default="tiny-random", help="tiny-random (default) | smollm2-135m-instruct | ...")
    ap.add_argument("--prefill-pp", type=int, default=2)
    ap.add_argument("--decode-pp", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8, help="clients, each with one request at a time")
    ap.add_argument("--cancel-rate", type=float, default=0.1, help="fraction of requests the client cancels")
    ap.add_argument("--fault-inject", default=DEFAULT_FAULTS, help=f"faults of both nodes (default: {DEFAULT_FAULTS})")
    ap.add_argument("--prefill-faults", default="", help="more faults for the prefill node (after --fault-inject)")
    ap.add_argument("--decode-faults", default="", help="more faults for the decode node (after --fault-inject)")
    ap.add_argument("--node-timeout-s", type=float, default=5.0, help="bootstrap, prealloc and transfer timeouts")
    ap.add_argument("--request-timeout-s", type=float, default=60.0, help="router and client deadline per request")
    ap.add_argument("--settle-s", type=float, default=20.0, help="after traffic: wait this long for nodes to drain")
    ap.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV pool of each node, tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=768, help="longest prompt drawn")
    ap.add_argument("--seed", type=int, default=0, help="traffic and fault random streams")
    ap.add_argument("--transfer-backend", default="auto", choices=["auto", "shm", "torch", "grpc"])
    ap.add_argument("--log-level", default="error", help="node and router logs on stderr (default: error)")
    ap.add_argument("--json", action="store_true", help="JSON line (the only output format)")
    return ap.parse_args(argv)


def flag_problems(args: argparse.Namespace, duration: float) -> list[str]:
    problems = []
    if not duration > 0:
        problems.append(f"the duration must be > 0, got {duration}")
    if args.concurrency < 1 or args.prefill_pp < 1 or args.decode_pp < 1:
        problems.append("--concurrency, --prefill-pp and --decode-pp must be >= 1")
    if not 0 <= args.cancel_rate <= 1:
        problems.append(f"--cancel-rate must be in [0, 1], got {args.cancel_rate}")
    if not (args.node_timeout_s > 0 and args.request_timeout_s > 0 and args.settle_s >= 0):
        problems.append("--node-timeout-s and --request-timeout-s must be > 0, --settle-s >= 0")
    if args.max_prompt_tokens < 257:
        problems.append(f"--max-prompt-tokens must be >= 257, got {args.max_prompt_tokens}")
    from kvbridge.engine import faults

    for flag, spec in (("--fault-inject", args.fault_inject), ("--prefill-faults", args.prefill_faults),
                       ("--decode-faults", args.decode_faults)):  # fmt: skip
        try:
            faults.parse(spec, 0)
        except ValueError as e:
            problems.append(f"{flag}: {e}")
    return problems


def drive(traffic: Traffic, args: argparse.Namespace, duration: float, nodes: dict, procs: dict[str, int]):
    """Runs the clients until `duration` is up, with progress on stderr every REPORT_EVERY_S;
    the seconds of traffic and the tokens per second of each window."""
    t0 = time.monotonic()
    deadline = t0 + duration
    workers = [
        threading.Thread(target=traffic.client, args=(i, deadline), name=f"soak-client{i}", daemon=True)
        for i in range(args.concurrency)
    ]
    for w in workers:
        w.start()
    next_report = t0 + REPORT_EVERY_S
    windows: list[float] = []  # tokens per second over each REPORT_EVERY_S of traffic
    last_tokens = 0
    while any(w.is_alive() for w in workers):
        time.sleep(min(0.2, max(0.0, next_report - time.monotonic())))
        if time.monotonic() >= next_report:
            next_report += REPORT_EVERY_S
            with traffic.lock:
                rate = (traffic.tokens - last_tokens) / REPORT_EVERY_S
                last_tokens = traffic.tokens
                line = (
                    f"bench soak: {time.monotonic() - t0:5.0f}s/{duration:g}s sent={traffic.sent} "
                    f"served={traffic.served} failed={sum(traffic.failed.values())} "
                    f"cancelled={traffic.cancelled} tokens/s={rate:.0f}"
                )
            if time.monotonic() <= deadline + 1:  # the ramp-down after the deadline says nothing
                windows.append(round(rate, 1))
            rss = {name: rss_mb(pid) or 0.0 for name, pid in procs.items()}
            ranks_max = max(v for k, v in rss.items() if k != "front")
            line += f" rss_mb front={rss['front']:.0f} ranks_max={ranks_max:.0f}"
            dead = dead_processes(nodes)
            print(line + (f" DEAD={','.join(dead)}" if dead else ""), file=sys.stderr, flush=True)
    traffic_s = time.monotonic() - t0
    for w in workers:
        w.join()
    return traffic_s, windows


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    problems = flag_problems(args, duration)
    if problems:
        for p in problems:
            print(f"bench soak: error: {p}", file=sys.stderr)
        return 2

    from kvbridge.common import logs

    logs.setup(args.log_level)
    print(
        f"bench soak: starting a prefill node (pp {args.prefill_pp}) and a decode node (pp {args.decode_pp}), "
        f"model {args.model} ...",
        file=sys.stderr,
        flush=True,
    )
    t_start = time.perf_counter()
    nodes, router, specs = soak_fleet.start(args)
    try:
        procs = soak_fleet.processes(nodes)
        start = soak_checks.before(nodes, router, procs)
        model = nodes["prefill"].node.ranks.model
        max_context = nodes["prefill"].node.ranks.max_context
        traffic = Traffic(args, router.port, router.http_port, model.config.vocab_size, max_context)
        print(
            f"bench soak: fleet up in {time.perf_counter() - t_start:.1f}s; {duration:g}s of traffic, "
            f"{args.concurrency} clients, faults prefill {specs[0]!r} decode {specs[1]!r}",
            file=sys.stderr,
            flush=True,
        )
        traffic_s, windows = drive(traffic, args, duration, nodes, procs)
        traffic.close()
        end = soak_checks.after(nodes, router, procs, start, args.settle_s)
    finally:
        reports = soak_fleet.stop(nodes, router)

    row = soak_checks.summary(args, specs, nodes, traffic, traffic_s, windows, start, end, reports)
    print(json.dumps(row), flush=True)
    bad = soak_checks.failed(row)
    if bad:
        print("bench soak: FAILED (see leaks, dead_processes, invariant_violations, rank_errors, logs_agree, "
              "shm_left, replay_mismatches)", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
