"""bench serve's shift mode (see kvbridge/bench/serve.py): goodput at the SLO while traffic moves from
prefill-heavy to decode-heavy and back, for every static P:D split of one fleet and for the planner.

The fleet: --shift-nodes elastic nodes (`kvbridge prefill|decode --elastic`, child processes), started
once. Each run sets their roles (Admin.SetRole) and starts a router in this process: a static split
(--planner off), or an even split under `--planner slo` with the same SLOs. Every run sends the same
schedule: --shift-phase-s of prefill-heavy traffic (--shift-prefill-heavy IN,OUT,RATE), as long of
decode-heavy (--shift-decode-heavy), and prefill-heavy again, Poisson arrivals.

Capacity is made comparable across nodes, on a host of two cores shared by every node: tiny-random
with every forward step made --shift-step-delay-ms longer (the step's wait, not its compute, sets a
node's speed), --shift-chunk-tokens prompt tokens per prefill step, and a KV pool of
--shift-kv-tokens per node, which bounds how many streams a decode node holds at once. A prefill
node then takes about ceil(IN / chunk) steps per prompt; a decode node holds kv_tokens / (IN + OUT)
streams for OUT steps each. With the defaults (steps of ~0.1 s): a prefill node serves ~2.4
prefill-heavy prompts/s (256 tokens, 4 steps), a decode node ~3.3 decode-heavy streams/s (21 at
once, 64 steps each). So 4.5/s prefill-heavy wants 3 prefill nodes (2 fall behind, TTFT over
the SLO), and 6/s decode-heavy 2 decode nodes: 3P:1D serves the first phase and swamps in the
second, 2P:2D the reverse, and 1P:3D swamps in the first.

One JSON line per run (goodput: requests per second meeting both SLOs, TTFT <= --slo-ttft-ms and
time per output token <= --slo-itl-ms; per phase too), then a summary: the planner's goodput over the
best and the worst static split (chosen in hindsight), and its moves with the figures behind them
and each switch's time."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

from kvbridge.bench import serve_client, serve_data, serve_metrics
from kvbridge.bench.serve import StackBroken, log, probe_min_tokens, served_model
from kvbridge.bench.serve_client import HttpTarget
from kvbridge.bench.serve_data import RandomSpec, Sample

PHASES = ("prefill_heavy", "decode_heavy", "prefill_heavy")
IDLE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Mix:
    input_len: int
    output_len: int
    rate: float  # requests/s


def parse_mix(text: str) -> Mix:
    parts = text.split(",")
    try:
        mix = Mix(int(parts[0]), int(parts[1]), float(parts[2])) if len(parts) == 3 else None
    except ValueError:
        mix = None
    if mix is None or mix.input_len < 1 or mix.output_len < 1 or not 0 < mix.rate < float("inf"):
        raise argparse.ArgumentTypeError(f"expected IN,OUT,RATE (tokens, tokens, requests/s), got {text!r}")
    return mix


def schedule(args, tokenizer, vocab: int) -> tuple[list[Sample], list[float], list[int]]:
    """Every request of a run, its send time, and its phase (an index of PHASES)."""
    samples, arrivals, phases = [], [], []
    chat = args.endpoint == "chat"
    for i, name in enumerate(PHASES):
        mix = args.shift_prefill_heavy if name == "prefill_heavy" else args.shift_decode_heavy
        n = max(1, round(mix.rate * args.shift_phase_s))
        spec = RandomSpec(mix.input_len, mix.output_len, 0.0)
        samples += serve_data.random_dataset(spec, n, args.seed + i, chat, tokenizer, vocab)
        arrivals += [i * args.shift_phase_s + t for t in serve_data.arrival_times(n, mix.rate, 1.0, args.seed + i)]
        phases += [i] * n
    return samples, arrivals, phases


def shift(args: argparse.Namespace, pool, tokenizer, vocab: int) -> int:
    from kvbridge.bench.serve_stacks import PinnedNode

    n = args.shift_nodes
    flags = [
        "--elastic", "--model", args.model, "--threads", "1", "--log-level", "error", "--quiet",
        "--page-size", str(args.page_size), "--chunked-prefill-size", str(args.shift_chunk_tokens),
        "--kv-cache-tokens", str(args.shift_kv_tokens), "--max-pending-requests", "4096",
        "--fault-inject", f"step_delay_ms={args.shift_step_delay_ms}",
    ]  # fmt: skip
    samples, arrivals, phases = schedule(args, tokenizer, vocab)
    log(f"starting {n} elastic nodes (model {args.model}, step delay {args.shift_step_delay_ms} ms) ...")
    cores = set(os.sched_getaffinity(0))
    nodes = [PinnedNode("prefill" if i < n // 2 else "decode", cores, flags) for i in range(n)]
    rows: list[dict] = []
    try:
        for node in nodes:
            node.wait_ready()
        addresses = [node.address for node in nodes]
        splits = [("static", p) for p in range(1, n)] + [("planner", n // 2)]
        for kind, prefills in splits:
            label = f"{kind} {prefills}P:{n - prefills}D" + (" at the start" if kind == "planner" else "")
            rows.append(run(args, pool, addresses, kind, prefills, samples, arrivals, phases, label))
            print(json.dumps(rows[-1]), flush=True)
    except (StackBroken, RuntimeError, TimeoutError) as e:
        log(f"error: {e}")
        return 1
    finally:
        for node in nodes:
            node.stop()
    out = summary(rows)
    print(json.dumps(out), flush=True)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def run(args, pool, addresses, kind, prefills, samples, arrivals, phases, label) -> dict:
    from kvbridge.router.config import RouterConfig
    from kvbridge.router.server import start_router

    roles = {a: ("prefill" if i < prefills else "decode") for i, a in enumerate(addresses)}
    set_roles(roles)
    config = RouterConfig(
        port=0, http_port=0, request_timeout_s=args.request_timeout_s, health_retry_s=0.2, startup_wait_s=30,
        prefill=tuple(a for a, r in roles.items() if r == "prefill"),
        decode=tuple(a for a, r in roles.items() if r == "decode"),
        planner="slo" if kind == "planner" else "off", slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
        planner_interval_s=args.planner_interval_s, planner_patience=args.planner_patience,
        planner_min_dwell_s=args.planner_min_dwell_s, planner_migrate=args.planner_migrate,
    )  # fmt: skip
    router = start_router(config)
    try:
        url = f"http://127.0.0.1:{router.http_port}"
        min_tokens = probe_min_tokens(pool, args, url, samples[0])
        target = HttpTarget(url, args.endpoint, served_model(args), min_tokens, args.request_timeout_s)
        log(f"{label}: {len(samples)} requests over {len(PHASES) * args.shift_phase_s:g} s ...")
        job = (target, samples, arrivals, None, args.warmups, label)
        records, duration = pool.submit(serve_client.run_load, *job).result()
        moves = list(router.dispatcher.planner.moves) if router.dispatcher.planner is not None else []
    finally:
        router.stop(grace_s=0)
    wait_idle(addresses)
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_itl_ms}
    row = {
        "bench": "serve",
        "mode": "shift",
        "run": kind,
        "split": f"{prefills}P:{len(addresses) - prefills}D",
        "slo_ms": slo,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    row |= serve_metrics.compute_metrics(records, duration, slo)
    row["phases"] = []
    for i, name in enumerate(PHASES):
        part = [r for r, p in zip(records, phases) if p == i]
        good = sum(r.ok and serve_metrics.is_good(r, slo) for r in part)
        row["phases"].append({"phase": name, "requests": len(part), "goodput": round(good / args.shift_phase_s, 3)})
    row["moves"] = moves
    log(f"{label}: goodput {row['request_goodput']} req/s, {row['failed']} failed, {len(moves)} moves")
    return row


def set_roles(roles: dict[str, str]) -> None:
    """Every node to its role (Admin.SetRole: each waits for its requests to end)."""
    from kvbridge.common import rpc
    from kvbridge.v1 import admin_pb2, admin_pb2_grpc

    for address, role in roles.items():
        stub = admin_pb2_grpc.AdminStub(rpc.make_channel(address))
        stub.SetRole(admin_pb2.SetRoleRequest(role=role, wait_s=IDLE_TIMEOUT_S), timeout=IDLE_TIMEOUT_S + 30)


def wait_idle(addresses: list[str]) -> None:
    """Until no node holds a request (a run's last streams end before the next run's roles are set)."""
    from kvbridge.common import rpc
    from kvbridge.v1 import admin_pb2, admin_pb2_grpc

    deadline = time.monotonic() + IDLE_TIMEOUT_S
    for address in addresses:
        stub = admin_pb2_grpc.AdminStub(rpc.make_channel(address))
        while stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10).requests_in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} still holds requests {IDLE_TIMEOUT_S:g} s after its run")
            time.sleep(0.1)


def summary(rows: list[dict]) -> dict:
    static = [r for r in rows if r["run"] == "static"]
    planned = next(r for r in rows if r["run"] == "planner")
    best = max(static, key=lambda r: r["request_goodput"])
    worst = min(static, key=lambda r: r["request_goodput"])
    goodput = planned["request_goodput"]

    def over(r: dict) -> float | None:
        return round(goodput / r["request_goodput"], 3) if r["request_goodput"] else None

    return {
        "bench": "serve",
        "mode": "shift",
        "summary": True,
        "goodput": {r["split"]: r["request_goodput"] for r in static} | {"planner": goodput},
        "best_static": best["split"],
        "worst_static": worst["split"],
        "planner_over_best": over(best),
        "planner_over_worst": over(worst),
        "at_least_0_95_of_best": (over(best) or 0) >= 0.95,
        "at_least_1_3_of_worst": worst["request_goodput"] == 0 or (over(worst) or 0) >= 1.3,
        "planner_moves": planned["moves"],
    }
