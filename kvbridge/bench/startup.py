"""Start-up of a node to SERVING: a first start (an empty weight cache: the GGUF dequantized) and
restarts that find the cache.

    python -m kvbridge.bench.startup [--role serve|prefill|decode] [--model M] [--restarts 2]
        [--cache-dir DIR] [--fresh-kernels] [--json] [-- extra node flags]

Each start is a `kvbridge ROLE` process on a free loopback port, timed from its launch to the
first gRPC health answer SERVING (the weights loaded, the ranks up), then stopped. The first
start gets an empty weight cache of its own (KVBRIDGE_CACHE) unless --cache-dir names one; the
restarts reuse it. The CPU kernels are built by the set-up (scripts/setup.sh), so starts find
them; --fresh-kernels gives the first start an empty kernel cache too (TORCH_EXTENSIONS_DIR: it
builds them). One JSON object per start; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(role: str, model: str, cache: Path, fresh_kernels: bool, extra: list[str]) -> dict:
    """One start, timed to SERVING; the process is stopped before returning."""
    port = free_port()
    env = os.environ | {"KVBRIDGE_CACHE": str(cache / "kvbridge")}
    if fresh_kernels:
        env["TORCH_EXTENSIONS_DIR"] = str(cache / "torch_extensions")
    cmd = [sys.executable, "-m", "kvbridge", role, "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen([*cmd, "--quiet", *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.perf_counter() - t0 < TIMEOUT_S:
                if proc.poll() is not None:
                    raise RuntimeError(f"{role} exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return {"seconds_to_serving": round(time.perf_counter() - t0, 2)}
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"{role} did not serve within {TIMEOUT_S:.0f} s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench startup", description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="serve", choices=("serve", "prefill", "decode"))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--cache-dir", default="", help="the cache directory to start from (default: a new, empty one)")
    ap.add_argument("--fresh-kernels", action="store_true", help="the first start builds the CPU kernels too")
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    ap.add_argument("extra", nargs="*", help="flags for the node, after --")
    args = ap.parse_args(argv)
    if args.restarts < 0:
        print(f"bench startup: error: --restarts must be >= 0, got {args.restarts}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvbridge-startup-") as tmp:
        cache = Path(args.cache_dir) if args.cache_dir else Path(tmp)
        for i in range(args.restarts + 1):
            kind = "first" if i == 0 and not args.cache_dir else "restart"
            print(f"bench startup: {args.role} start {i + 1}/{args.restarts + 1} ({kind}) ...", file=sys.stderr)
            row = {"bench": "startup", "role": args.role, "model": args.model, "start": kind}
            row["fresh_kernels"] = args.fresh_kernels and kind == "first"
            print(
                json.dumps(row | start_once(args.role, args.model, cache, args.fresh_kernels, args.extra)), flush=True
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
