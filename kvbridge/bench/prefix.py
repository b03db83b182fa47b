"""Prefix-cache benchmark: a multi-turn chat workload through a router over 2 prefill and 2 decode
nodes, with the prefix cache and each routing policy, against the cache turned off.

    kvbridge bench prefix [--conversations 8] [--turns 6] [--system-tokens 480] [--user-tokens 45]
        [--turn-period-s 12]
        [--output-tokens 24] [--seed 0] [--model smollm2-135m-instruct]
        [--modes cache_aware,least_loaded,round_robin,cache_off] [--json]

The workload (kvbridge/bench/prefix_load.py): --conversations chats of --turns turns, all sharing one
system prompt of --system-tokens tokens; each user message --user-tokens tokens, +-1/3 (seeded by
--seed); every reply greedy, ignore_eos, --output-tokens long. Each turn's prompt is the whole
conversation so far (system, users, the replies as returned, the next user) as chat messages.
Every mode gets the same arrival schedule, drawn from the seed: a conversation's first turn within
the first --turn-period-s, each next one a think time of 0.5 to 1.5 periods later, as users who
read a reply before they answer (or as soon as its previous reply ended, if that is later). 0
sends each turn right after the previous reply (closed loop: a faster mode then also runs more
decodes at once, which on a shared CPU slows every token of them, so its inter-token latency
would not compare).

The modes, on the same workload: cache_aware, least_loaded, round_robin (the router's --routing,
prefix cache on) and cache_off (nodes started with --disable-prefix-cache, routing least_loaded).
The cache-on modes share one fleet, the router restarted per mode; cache_off gets a fleet of its
own. Before each mode: uncounted warm-up requests (2 per node, unrelated prompts of WARMUP_TOKENS
tokens), then every node's cache is cleared (Admin.ClearPrefixCache), so no mode profits from
another; counters are read before and after the mode (in-process, the nodes' Prometheus registries).
On a 2-core CPU machine the defaults take about 8 minutes with the default model.

Figures per mode (one JSON line each with --json; kvbridge/bench/prefix_report.py):
    requests, failed                turns that streamed to their end with usage / the others (by
                                    reason; a failed turn ends its conversation)
    prefix_cache_hit_rate           prefill nodes: hit / query tokens (kvbridge_prefix_cache_*_tokens_total)
    decode_hit_rate                 the same on the decode nodes (their lookups for pages to skip)
    prefill_tokens_computed         prefill nodes: query - hit tokens; where they looked nothing up
                                    (cache off), the prompt tokens of the turns' usage
    kv_bytes_moved                  prefill nodes' kvbridge_kv_transfer_bytes_total (sent pages)
    transfer_kv_bytes               the same from the turns' TransferStats.kv_bytes
    decode_pages_skipped            decode nodes' kvbridge_kv_transfer_pages_skipped_total
    evicted_pages                   every node's kvbridge_prefix_cache_evicted_pages_total
    prompt_tokens, cached_tokens    sums of the turns' usage
    ttft_p50_ms .. itl_p99_ms       client-side: send -> first streamed tokens; gaps between
                                    responses carrying tokens (numpy linear percentiles)
    output_throughput               completion tokens / the mode's duration (first send -> last end)
    later_turns_on_prefix_node      of turns >= 2 (after an ok turn): the share whose cached_tokens
                                    >= the previous turn's prompt tokens rounded down to full pages
                                    (reached the prefill node holding their prefix)
    routing_decisions               the router's kvbridge_router_routing_decisions_total over the
                                    mode (warm-ups not counted), by "role:reason"
The summary line: cache_aware vs cache_off, prefill_tokens_computed_reduction_pct, ttft_p50_reduction_pct,
itl_p99_change_pct, cache_aware's later_turns_on_prefix_node, and the issue's goals (>= 80, >= 60,
<= +10) each met or not. Progress on stderr. Exit status 2 on a bad flag, 1 if a fleet failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from kvbridge.bench import prefix_load
from kvbridge.bench.prefix_load import ChatWorkload
from kvbridge.bench.prefix_report import counter_delta, mode_row, summary, text_of
from kvbridge.bench.serve import BenchUsageError, _Parser, load_tokenizer
from kvbridge.bench.serve_data import Texts
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.weights import DEFAULT_MODEL

MODES = {  # name -> (router --routing, prefix cache on)
    "cache_aware": ("cache_aware", True),
    "least_loaded": ("least_loaded", True),
    "round_robin": ("round_robin", True),
    "cache_off": ("least_loaded", False),
}
COUNTERS = {
    "hit": "kvbridge_prefix_cache_hit_tokens_total",
    "query": "kvbridge_prefix_cache_query_tokens_total",
    "evicted": "kvbridge_prefix_cache_evicted_pages_total",
    "skipped": "kvbridge_kv_transfer_pages_skipped_total",
    "kv_bytes": "kvbridge_kv_transfer_bytes_total",
}
ROLES = ("prefill", "decode")
WARMUP_TOKENS = 64
TEMPLATE_TOKENS = 8  # per chat message, the template's own tokens (context check only)


def _modes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    if not names or any(n not in MODES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--modes takes distinct names from {','.join(MODES)}, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kvbridge bench prefix", description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=480, help="the shared system prompt's length")
    ap.add_argument("--user-tokens", type=int, default=45, help="each user message: this, +-1/3")
    ap.add_argument("--output-tokens", type=int, default=24, help="every reply's length")
    ap.add_argument(
        "--turn-period-s", type=float, default=12.0, help="seconds between a conversation's turns (0: closed loop)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--modes", type=_modes, default=list(MODES), help=f"default: {','.join(MODES)}")
    ap.add_argument("--prefill-nodes", type=int, default=2)
    ap.add_argument("--decode-nodes", type=int, default=2)
    d = EngineConfig()
    ap.add_argument("--page-size", type=int, default=d.page_size, help="of every node")
    ap.add_argument("--kv-cache-tokens", type=int, default=16384, help="of every node")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per node (0: torch's default)")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--log-level", default="error", help="node and router logs on stderr (default: error)")
    ap.add_argument("--json", action="store_true", help="JSON lines: one per mode, then the summary")
    return ap


def check(args: argparse.Namespace) -> None:
    names = ("conversations", "turns", "system_tokens", "user_tokens", "output_tokens", "prefill_nodes")
    for name in (*names, "decode_nodes", "page_size", "kv_cache_tokens"):
        if getattr(args, name) < 1:
            raise BenchUsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads < 0 or not args.request_timeout_s > 0:
        raise BenchUsageError("--threads must be >= 0 and --request-timeout-s > 0")
    if not 0 <= args.turn_period_s < float("inf"):
        raise BenchUsageError(f"--turn-period-s must be >= 0, got {args.turn_period_s}")


def check_context(w: ChatWorkload, max_context: int) -> None:
    longest = max(sum(u) for u in w.user_tokens)
    turns = len(w.users[0])
    need = w.system_tokens + longest + turns * w.output_tokens + TEMPLATE_TOKENS * (2 * turns + 1)
    if need > max_context:
        raise BenchUsageError(f"a conversation needs ~{need} tokens, over the model's context of {max_context}")


def log(line: str) -> None:
    print(f"bench prefix: {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the fleet


class PrefixFleet:
    """Prefill and decode nodes in this process (their ranks in child processes) and a router over
    them, restarted to change its routing policy."""

    def __init__(self, config: EngineConfig, prefill: int, decode: int, timeout_s: float):
        from kvbridge.bench.serve_stacks import _start_all
        from kvbridge.engine.config import PPConfig
        from kvbridge.nodes import start_node
        from kvbridge.serving.config import NodeConfig

        node = NodeConfig(config, PPConfig(pp_size=1))
        roles = ["prefill"] * prefill + ["decode"] * decode
        servers = _start_all([lambda role=role: start_node(role, node) for role in roles])
        self.by_role = {r: [s for s, role in zip(servers, roles) if role == r] for r in ROLES}
        self.cache = not config.disable_prefix_cache
        self.timeout_s = timeout_s
        self.router = None

    @property
    def nodes(self) -> list:
        return [s for r in ROLES for s in self.by_role[r]]

    def route(self, policy: str) -> str:
        """A fresh router with `policy`, once healthy; its gRPC address."""
        from kvbridge.bench.serve_stacks import Stack, wait_healthy
        from kvbridge.router.config import RouterConfig
        from kvbridge.router.server import start_router

        self.stop_router()
        addresses = {r: tuple(s.address for s in self.by_role[r]) for r in ROLES}
        config = RouterConfig(port=0, http_port=0, request_timeout_s=self.timeout_s, routing=policy, **addresses)
        self.router = start_router(config)
        wait_healthy(Stack("prefix", self.router))
        return f"127.0.0.1:{self.router.port}"

    def clear(self) -> int | None:
        """Admin.ClearPrefixCache on every node: the pages dropped, None if a node does not serve it."""
        import grpc

        from kvbridge.common import rpc
        from kvbridge.v1 import admin_pb2, admin_pb2_grpc

        dropped = 0
        for s in self.nodes:
            with rpc.make_channel(s.address) as channel:
                try:
                    stub = admin_pb2_grpc.AdminStub(channel)
                    dropped += stub.ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=30).pages_dropped
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                        return None
                    raise
        return dropped

    def counters(self) -> dict[str, dict[str, float]]:
        """role -> COUNTERS key -> the sum over the role's nodes (every label)."""
        return {r: sum_counters([s.registry for s in self.by_role[r]]) for r in ROLES}

    def routing_decisions(self) -> dict[str, int]:
        out: Counter = Counter()
        for family in self.router.dispatcher.metrics.registry.collect():
            for s in family.samples:
                if s.name == "kvbridge_router_routing_decisions_total":
                    out[f"{s.labels.get('role')}:{s.labels.get('reason')}"] += int(s.value)
        return dict(sorted(out.items()))

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def stop(self) -> None:
        self.stop_router()
        for s in self.nodes:
            try:
                s.stop()
            except Exception as e:  # stop the others all the same
                log(f"stopping a node: {type(e).__name__}: {e}")


def sum_counters(registries: list) -> dict[str, float]:
    names = {v: k for k, v in COUNTERS.items()}
    out = dict.fromkeys(COUNTERS, 0.0)
    for registry in registries:
        for family in registry.collect():
            for s in family.samples:
                if s.name in names:
                    out[names[s.name]] += s.value
    return out


# ---------------------------------------------------------------------------- runs


def run_mode(args, pool, fleet: PrefixFleet, mode: str, w: ChatWorkload, warm: list[str]) -> dict:
    policy, cache = MODES[mode]
    log(f"{mode}: starting the router (routing {policy}) ...")
    address = fleet.route(policy)
    bad = pool.submit(prefix_load.run_warmup, address, warm, args.request_timeout_s).result()
    if bad:
        log(f"{mode}: {len(bad)} of {len(warm)} warm-up requests failed: {bad[0]}")
    cleared = fleet.clear() if cache else 0
    if cleared is None:
        log(f"{mode}: warning: the nodes do not serve Admin.ClearPrefixCache; caches not cleared")
    time.sleep(0.5)  # the router's KV event streams see the clearing
    before, routed = fleet.counters(), fleet.routing_decisions()
    log(f"{mode}: {len(w.users)} conversations x {len(w.users[0])} turns ...")
    records, duration = pool.submit(
        prefix_load.run_chats, address, w, args.request_timeout_s, mode, args.turn_period_s
    ).result()
    delta = counter_delta(before, fleet.counters())
    head = {"bench": "prefix", "mode": mode, "routing": policy, "prefix_cache": cache, "model": args.model}
    head |= {"seed": args.seed, "conversations": len(w.users), "turns": len(w.users[0]), "page_size": args.page_size}
    head["turn_period_s"] = args.turn_period_s
    head["caches_cleared"] = cleared is not None
    row = mode_row(head, records, duration, delta, args.page_size)
    after = fleet.routing_decisions()
    row["routing_decisions"] = {k: n - routed.get(k, 0) for k, n in after.items() if n > routed.get(k, 0)}
    return row


def run_all(args, pool, w: ChatWorkload, warm: list[str]) -> list[dict]:
    base = EngineConfig(
        model=args.model, page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens, threads=args.threads
    )
    rows = []
    for cache in (True, False):
        modes = [m for m in args.modes if MODES[m][1] == cache]
        if not modes:
            continue
        nodes = f"{args.prefill_nodes} prefill + {args.decode_nodes} decode nodes"
        log(f"starting {nodes} (prefix cache {'on' if cache else 'off'}) ...")
        config = replace(base, disable_prefix_cache=not cache)
        fleet = PrefixFleet(config, args.prefill_nodes, args.decode_nodes, args.request_timeout_s)
        try:
            for mode in modes:
                rows.append(run_mode(args, pool, fleet, mode, w, warm))
                print(json.dumps(rows[-1]) if args.json else text_of(rows[-1]), flush=True)
                if args.json:
                    log(text_of(rows[-1]))
        finally:
            fleet.stop()
    return rows


def warmup_prompts(tokenizer, n: int, tokens: int, seed: int) -> list[str]:
    rng = random.Random(f"{seed}-warmup")
    return [Texts(tokenizer).words(rng, tokens)[0] for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check(args)
        tokenizer, _, max_context = load_tokenizer(args)
        w = prefix_load.build_workload(
            tokenizer, args.conversations, args.turns, args.system_tokens, args.user_tokens, args.output_tokens,
            args.seed,
        )  # fmt: skip
        check_context(w, max_context)
    except BenchUsageError as e:
        print(f"kvbridge bench prefix: error: {e}", file=sys.stderr)
        return 2
    from kvbridge.common import logs

    logs.setup(args.log_level)
    warm = warmup_prompts(tokenizer, 2 * (args.prefill_nodes + args.decode_nodes), WARMUP_TOKENS, args.seed)
    # the client: a process of its own, so the router's and the fronts' threads here do not share its GIL
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            rows = run_all(args, pool, w, warm)
        except Exception as e:
            log(f"error: {type(e).__name__}: {e}")
            return 1
    row = summary(rows)
    print(json.dumps(row) if args.json else text_of(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
