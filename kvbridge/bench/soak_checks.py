"""bench soak's end-of-run checks (see kvbridge/bench/soak.py): the nodes' and router's state
(Admin GetStatus) and /metrics, the settling after the traffic, invariants, and the JSON row
that accounts for every request, transfer failure, leak and dead process."""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

import grpc

from kvbridge.bench.soak_fleet import cpu_s, dead_processes, rss_mb, shm_segments
from kvbridge.bench.soak_load import Traffic


@dataclass(frozen=True)
class Before:
    """The fleet before the traffic: RSS and CPU seconds of each process, each node's state."""

    rss_mb: dict[str, float | None]
    cpu_s: dict[str, float]
    state: dict


@dataclass(frozen=True)
class After:
    """The fleet once it had its time to settle, measured before anything is stopped."""

    state: dict  # node_state: what is left is a leak
    settle_s: float  # how long settling took
    violations: dict[str, list[str]]  # node -> invariant violations
    rss_mb: dict[str, float | None]
    cpu_s: dict[str, float]  # used since Before
    metrics: dict[str, dict]  # node -> scrape
    router_metrics: dict
    dead: list[str]
    segments: list[str]  # /dev/shm segments the nodes made


def scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    """The /metrics samples on `port`: name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError as e:  # counted as nothing; said on stderr
        print(f"bench soak: scraping 127.0.0.1:{port}/metrics: {e}", file=sys.stderr)
        return {}
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def admin_status(address: str):
    from kvbridge.common import rpc
    from kvbridge.v1 import admin_pb2, admin_pb2_grpc

    channel = rpc.make_channel(address)
    try:
        return admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    finally:
        channel.close()


def node_state(nodes: dict, router) -> dict:
    """Pages per rank, requests, queues and transfers of each node; the router's requests in flight."""
    out = {}
    for name, server in nodes.items():
        try:
            st = admin_status(server.address)
        except grpc.RpcError as e:  # rank 0 did not answer: nothing known, so nothing is assumed clean
            out[name] = {"error": f"{e.code().name}: {e.details()}", "pages": None, "requests_in_flight": None}
            continue
        out[name] = {
            "pages": [r.kv_pages_used for r in st.ranks],
            "requests_in_flight": st.requests_in_flight,
            "transfers_in_flight": st.transfers_in_flight,
            "queued": sum(st.queues.values()),
            "alive": all(r.alive for r in st.ranks),
        }
    out["router"] = {"requests_in_flight": admin_status(f"127.0.0.1:{router.port}").requests_in_flight}
    return out


def is_idle(state: dict) -> bool:
    nodes = [v for k, v in state.items() if k != "router"]
    return state["router"]["requests_in_flight"] == 0 and all(
        "error" not in n
        and not any(n["pages"])
        and n["requests_in_flight"] == 0
        and n["transfers_in_flight"] == 0
        and n["queued"] == 0
        for n in nodes
    )


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    s = sorted(values)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))], 4)

    return {"p50": q(0.50), "p99": q(0.99), "n": len(s)}


def before(nodes: dict, router, procs: dict[str, int]) -> Before:
    rss = {name: rss_mb(pid) for name, pid in procs.items()}
    cpu = {name: cpu_s(pid) for name, pid in procs.items()}
    return Before(rss_mb=rss, cpu_s=cpu, state=node_state(nodes, router))


def settle(nodes: dict, router, settle_s: float) -> tuple[dict, float]:
    """Waits up to settle_s for the nodes to drain (no state is asked of a fleet with a dead
    process); the last state seen and the seconds it took."""
    t_settle = time.monotonic()
    dead = dead_processes(nodes)
    state = node_state(nodes, router) if not dead else None
    while not dead and not is_idle(state) and time.monotonic() - t_settle < settle_s:
        time.sleep(0.2)
        dead = dead_processes(nodes)
        state = node_state(nodes, router) if not dead else state
    took = time.monotonic() - t_settle
    if state is None:
        state = node_state(nodes, router)
    return state, took


def invariants(nodes: dict) -> dict[str, list[str]]:
    violations = {}
    for name, server in nodes.items():
        if not server.dead:
            try:
                violations[name] = server.check_invariants()
            except Exception as e:  # rank 0 did not answer
                violations[name] = [f"no invariant check: {type(e).__name__}: {e}"]
    return violations


def after(nodes: dict, router, procs: dict[str, int], start: Before, settle_s: float) -> After:
    # settle: what the nodes still hold once they had settle_s to clean up is a leak
    state, took = settle(nodes, router, settle_s)
    violations = invariants(nodes)
    rss = {name: rss_mb(pid) for name, pid in procs.items()}
    cpu_used = {name: round(cpu_s(pid) - start.cpu_s[name], 1) for name, pid in procs.items()}
    metrics = {name: scrape(server.metrics_port) for name, server in nodes.items()}
    router_metrics = scrape(router.metrics_port)
    return After(
        state=state, settle_s=took, violations=violations, rss_mb=rss, cpu_s=cpu_used, metrics=metrics,
        router_metrics=router_metrics, dead=dead_processes(nodes), segments=shm_segments(nodes),
    )  # fmt: skip


def transfer_failures(metrics: dict[str, dict]) -> tuple[Counter, Counter]:
    """kvbridge_kv_transfer_failures_total summed by node and by reason."""
    failures = Counter()
    failure_reasons = Counter()
    for name, m in metrics.items():
        for labels, value in m.get("kvbridge_kv_transfer_failures_total", []):
            failures[name] += int(value)
            failure_reasons[labels.get("reason", "")] += int(value)
    return failures, failure_reasons


def rank_checks(reports: dict[str, list]) -> tuple[dict[str, str], bool]:
    """The errors ranks reported, and whether the ranks of each node agree on their decision log."""
    rank_errors = {
        f"{name}.rank{r.rank}": r.error for name, reps in reports.items() for r in reps if r.error
    }  # fmt: skip
    logs_agree = all(len({(r.log_count, r.log_digest) for r in reps}) <= 1 for reps in reports.values())
    return rank_errors, logs_agree


def summary(
    args: argparse.Namespace, specs: tuple[str, str], nodes: dict, t: Traffic, traffic_s: float,
    windows: list[float], start: Before, end: After, reports: dict[str, list],
) -> dict:  # fmt: skip
    """The JSON row, once everything is stopped (a /dev/shm segment left then is a leak)."""
    shm_left = [s for s in end.segments if os.path.exists(f"/dev/shm/{s.lstrip('/')}")]
    failures, failure_reasons = transfer_failures(end.metrics)
    retries = int(sum(v for _, v in end.router_metrics.get("kvbridge_router_retries_total", [])))
    router_outcomes = {
        labels["outcome"]: int(v) for labels, v in end.router_metrics.get("kvbridge_router_requests_total", [])
    }
    rank_errors, logs_agree = rank_checks(reports)
    state = end.state
    row = {
        "bench": "soak",
        "model": args.model,
        "prefill_pp": args.prefill_pp,
        "decode_pp": args.decode_pp,
        "concurrency": args.concurrency,
        "cancel_rate": args.cancel_rate,
        "faults": {"prefill": specs[0], "decode": specs[1]},
        "duration_s": round(traffic_s, 2),
        "requests": t.sent,
        "served": t.served,
        "failed_by_reason": dict(sorted(t.failed.items())),
        "cancelled": t.cancelled,
        "kinds": dict(sorted(t.kinds.items())),
        "ttft_s": percentiles(t.ttft),
        "itl_s": percentiles(t.itl),
        "e2e_s": percentiles(t.e2e),
        "failed_e2e_s": percentiles(t.failed_e2e),
        "tokens": t.tokens,
        "tokens_per_s": round(t.tokens / traffic_s, 1),
        "tokens_per_s_windows": windows,
        "retries": retries,
        "router_outcomes": router_outcomes,  # the router's view: stop + length ~ served, abort ~ cancelled
        "transfer_failures": sum(failures.values()),
        "transfer_failures_by_node": dict(failures),
        "transfer_failures_by_reason": dict(sorted(failure_reasons.items())),
        "replayed": t.replayed,
        "replay_mismatches": t.replay_mismatches,
        "pages_used_start": {name: start.state[name]["pages"] for name in nodes},
        "pages_used_end": {name: state[name]["pages"] for name in nodes},
        "requests_in_flight_end": {name: state[name]["requests_in_flight"] for name in (*nodes, "router")},
        "settle_s": round(end.settle_s, 2),
        "rss_mb_start": start.rss_mb,
        "rss_mb_end": end.rss_mb,
        "cpu_s": end.cpu_s,
        "dead_processes": end.dead,
        "invariant_violations": sum(len(v) for v in end.violations.values()),
        "status_errors": {name: state[name]["error"] for name in nodes if "error" in state[name]},
        "rank_errors": rank_errors,
        "logs_agree": logs_agree,
        "shm_left": shm_left,
        # pages, requests, queued requests or transfers left (or a node not answering)
        "leaks": not is_idle(state),
        "failure_examples": t.failure_examples,
    }
    if t.unexpected:
        row["unexpected"] = t.unexpected[:10]
    return row


def failed(row: dict) -> bool:
    """Whether the run failed: a leak, a dead process, a broken invariant, a rank error, ranks'
    decision logs differing, a /dev/shm segment left, or a replay that differed."""
    return bool(
        row["leaks"] or row["dead_processes"] or row["invariant_violations"] or row["rank_errors"]
        or not row["logs_agree"] or row["shm_left"] or row["replay_mismatches"]
    )  # fmt: skip
