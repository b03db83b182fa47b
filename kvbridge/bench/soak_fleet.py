"""bench soak's fleet (see kvbridge/bench/soak.py): starting a prefill node, a decode node and a
router in this process (the nodes' ranks in their own processes) and stopping them; which
processes it has, which died, their RSS and CPU time, and the /dev/shm segments it made."""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor


def faults_of(common: str, own: str, seed: int) -> str:
    """The node's spec: its own random stream first (a seed in the specs overrides it)."""
    return ",".join(s for s in (f"seed={seed}", common, own) if s)


def start(args: argparse.Namespace):
    from dataclasses import replace

    from kvbridge.engine.config import EngineConfig, PPConfig
    from kvbridge.nodes import start_node
    from kvbridge.router.config import RouterConfig
    from kvbridge.router.server import start_router
    from kvbridge.serving.config import NodeConfig

    t = args.node_timeout_s
    base = EngineConfig(
        model=args.model, page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens,
        chunked_prefill_size=args.chunked_prefill_size, bootstrap_timeout_s=t, prealloc_timeout_s=t,
        transfer_timeout_s=t,
    )  # fmt: skip
    p_config = replace(base, fault_inject=faults_of(args.fault_inject, args.prefill_faults, 2 * args.seed + 1))
    d_config = replace(base, fault_inject=faults_of(args.fault_inject, args.decode_faults, 2 * args.seed + 2))
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(start_node, "prefill", NodeConfig(p_config, PPConfig(pp_size=args.prefill_pp), metrics_port=0))
        d_node = NodeConfig(
            d_config, PPConfig(pp_size=args.decode_pp), transfer_backend=args.transfer_backend, metrics_port=0
        )
        d = pool.submit(start_node, "decode", d_node)
        errors = [f.exception() for f in (p, d)]
        if any(errors):
            for f in (p, d):
                if f.exception() is None:
                    f.result().stop()
            raise next(e for e in errors if e is not None)
        prefill, decode = p.result(), d.result()
    try:
        router = start_router(
            RouterConfig(
                port=0, http_port=0, prefill=(prefill.address,), decode=(decode.address,), metrics_port=0,
                request_timeout_s=args.request_timeout_s,
            )
        )  # fmt: skip
    except BaseException:
        decode.stop()
        prefill.stop()
        raise
    return {"prefill": prefill, "decode": decode}, router, (p_config.fault_inject, d_config.fault_inject)


def shm_segments(nodes: dict) -> list[str]:
    names = []
    for server in nodes.values():
        names += [r.endpoint("shm").decode() for r in server.node.layout.ranks if r.endpoint("shm")]
    return names


def stop(nodes: dict, router) -> dict[str, list]:
    """Stops the router, then the decode node, then the prefill node; each node's rank reports."""
    reports = {}
    for name, server in (("router", router), ("decode", nodes["decode"]), ("prefill", nodes["prefill"])):
        try:
            reports[name] = server.stop() or []
        except Exception as e:  # stop the others all the same
            print(f"bench soak: stopping the {name}: {type(e).__name__}: {e}", file=sys.stderr)
            reports[name] = []
    del reports["router"]
    return reports


def processes(nodes: dict) -> dict[str, int]:
    """name -> pid of this process (every front and the router) and of every rank process."""
    out = {"front": os.getpid()}
    for name, server in nodes.items():
        for rank, proc in zip(server.node.ranks.pp.local_ranks, server.node.ranks.procs):
            out[f"{name}.rank{rank}"] = proc.pid
    return out


def dead_processes(nodes: dict) -> list[str]:
    dead = []
    for name, server in nodes.items():
        dead += [f"{name}.rank{r}" for r in server.dead]
        ranks = zip(server.node.ranks.pp.local_ranks, server.node.ranks.procs)
        dead += [f"{name}.rank{r}" for r, p in ranks if not p.is_alive()]
    return sorted(set(dead))


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None
