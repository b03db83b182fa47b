"""KV transfer bandwidth between a prefill rank process and a decode rank process, per engine,
next to single-process memcpy of the same bytes measured in the same run.

    python -m kvbridge.bench.kv_transfer [--mib 64] [--engines shm,torch,grpc] [--repeats 5] [--scattered] [--json]

The pool geometry defaults to the default model's (SmolLM2-135M: 30 layers, 3 KV heads, head
dim 64) with 16-token pages. Each timed round is one room: push every page, finish, until the
prefill side sees SUCCESS (so TransferDone round trips are included). Connections are opened
and pages mapped in an untimed warm-up room. One JSON object per line; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from engine.kv_pool import KVPool
from kv_transfer import (
    KVPoll,
    KVReceiverEndpoint,
    NodeLayout,
    PageGeometry,
    RankInfo,
    ReceiverConfig,
    StatusChange,
    local_host_id,
    make_sender,
)
from kv_transfer.rooms import Source


@dataclass(frozen=True)
class BenchConfig:
    mib: int = 64  # bytes moved per round, in MiB (rounded down to whole pages)
    page_size: int = 16  # tokens per page
    num_layers: int = 30  # one prefill rank and one decode rank own them all: whole pages move
    kv_heads: int = 3
    head_dim: int = 64
    dtype: str = "float32"
    repeats: int = 5  # timed rounds per engine
    scattered: bool = False  # shuffled page ids on both sides: no consecutive runs

    @property
    def geometry(self) -> PageGeometry:
        return PageGeometry(self.page_size, self.kv_heads, self.head_dim, self.dtype)

    @property
    def num_pages(self) -> int:
        return max(1, (self.mib << 20) // (self.geometry.layer_block_bytes * self.num_layers))

    def page_ids(self, seed: int) -> list[int]:
        ids = list(range(self.num_pages))
        if self.scattered:
            g = torch.Generator().manual_seed(seed)
            ids = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
        return ids


class Memcpy:
    """Single-process copy of the same bytes between two prefaulted buffers: the yardstick."""

    def __init__(self, nbytes: int):
        self.src, self.dst = torch.randn(nbytes // 4), torch.zeros(nbytes // 4)
        self.dst.copy_(self.src)

    def seconds(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


KEY = bytes(range(16))  # every room's write key (both sides are the benchmark's own)


def decode_main(engine: str, cfg: BenchConfig, out, stop) -> None:
    rc = ReceiverConfig(0, 0, cfg.num_layers, cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim, cfg.dtype)
    with KVReceiverEndpoint(rc) as receiver:
        for room in range(cfg.repeats + 1):
            receiver.expect(room, f"bench-{room}", cfg.page_ids(1), [Source(0, 0, cfg.num_layers)], engine, KEY)
        e = receiver.endpoint
        out.put((e.rank, e.layer_start, e.layer_end, e.receiver_addr, e.shm_name, e.torch_addr))
        stop.wait(600)


def run_engine(engine: str, cfg: BenchConfig, memcpy: Memcpy) -> list[tuple[float, float]]:
    """(transfer seconds, memcpy seconds) per timed round; the transfer timed on the prefill side,
    with the decode rank in another process, and the memcpy right before it (the machine is noisy)."""
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=decode_main, args=(engine, cfg, out, stop), daemon=True)
    proc.start()
    try:
        endpoint = RankInfo(*out.get(timeout=120))
        layout = NodeLayout(cfg.geometry, cfg.num_layers, cfg.num_pages, (endpoint,), "", (engine,), local_host_id())
        buffer = torch.randn(cfg.geometry.pool_shape(cfg.num_pages, (0, cfg.num_layers)))
        pool = KVPool(cfg.num_pages, (0, cfg.num_layers), cfg.page_size, cfg.kv_heads, cfg.head_dim, torch.float32,
                      buffer=buffer)  # fmt: skip
        done: dict[int, threading.Event] = {room: threading.Event() for room in range(cfg.repeats + 1)}

        def on_change(change: StatusChange) -> None:
            if change.state.is_terminal:
                done[change.room].set()

        sender = make_sender(engine, pool, 0, on_change=on_change)
        src, dst = cfg.page_ids(2), cfg.page_ids(1)
        times = []
        with sender:
            for room in range(cfg.repeats + 1):
                sender.connect(room, layout, dst, KEY)
                t_memcpy = memcpy.seconds()
                t0 = time.perf_counter()
                sender.push(room, src, dst, cfg.num_pages * cfg.page_size)
                sender.finish(room, cfg.num_pages * cfg.page_size)
                if not done[room].wait(120) or sender.poll(room) != KVPoll.SUCCESS:
                    raise RuntimeError(f"{engine} room {room}: {sender.poll(room).name} {sender.reason(room)}")
                if room:  # room 0 warmed up: connections opened, pages mapped
                    times.append((time.perf_counter() - t0, t_memcpy))
        return times
    finally:
        stop.set()
        proc.join(30)


def main(argv: list[str] | None = None) -> int:
    d = BenchConfig()
    ap = argparse.ArgumentParser(prog="kvbridge bench kv_transfer", description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="shm,torch,grpc", help="comma-separated: shm, torch, grpc")
    ap.add_argument("--mib", type=int, default=d.mib)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--num-layers", type=int, default=d.num_layers)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--scattered", action="store_true", help="shuffled page ids (no consecutive runs)")
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    args = ap.parse_args(argv)
    cfg = BenchConfig(args.mib, args.page_size, args.num_layers, repeats=args.repeats, scattered=args.scattered)
    nbytes = cfg.num_pages * cfg.num_layers * cfg.geometry.layer_block_bytes
    memcpy = Memcpy(nbytes)
    for engine in args.engines.split(","):
        print(f"bench kv_transfer: {engine}, {cfg.num_pages} pages, {nbytes / 2**20:.1f} MiB ...", file=sys.stderr)
        rounds = run_engine(engine, cfg, memcpy)
        transfer, copy = min(t for t, _ in rounds), min(m for _, m in rounds)
        row = {
            "bench": "kv_transfer",
            "engine": engine,
            "gbps": round(nbytes / transfer / 1e9, 3),  # best round
            "memcpy_gbps": round(nbytes / copy / 1e9, 3),  # best memcpy, each timed right before a round
            "ratio_to_memcpy": round(copy / transfer, 3),  # of the bests
            "ratio_median": round(statistics.median(m / t for t, m in rounds), 3),  # of round-by-round ratios
            "bytes": nbytes,
            "pages": cfg.num_pages,
            "page_bytes": cfg.num_layers * cfg.geometry.layer_block_bytes,
            "scattered": cfg.scattered,
            "repeats": cfg.repeats,
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
