"""KV transfer bandwidth between a prefill rank process and a decode rank process, per engine,
next to a memcpy of the same bytes between the same devices measured in the same run.

    python -m kvbridge.bench.kv_transfer [--mib 64] [--engines shm,torch,grpc] [--repeats 5] [--scattered]
        [--device cpu|cuda[:N]] [--decode-device DEV] [--dtype float32|bfloat16|float16] [--json]

The pool geometry defaults to the default model's (SmolLM2-135M: 30 layers, 3 KV heads, head
dim 64) with 16-token pages. `--device` holds the prefill rank's pool, `--decode-device` (default:
the same) the decode rank's; the memcpy copies between the two (device to device on a GPU, a peer
copy across GPUs). Each timed round is one room: push every page, finish, until the prefill side
sees SUCCESS (so TransferDone round trips are included). Connections are opened and pages mapped in
an untimed warm-up room. An engine that cannot move pages between the two devices (shm: CPU pools;
cuda_ipc: CUDA pools; torch: NCCL pairs no two ranks on one GPU) gets a row with `skipped` and why.
One JSON object per line; progress on stderr.
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

from kvbridge.engine.kv_pool import KVPool
from kvbridge.kv_transfer import (
    BACKENDS,
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
from kvbridge.kv_transfer.layout import dtype_from_name
from kvbridge.kv_transfer.rooms import Source


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
    device: str = "cpu"  # the prefill rank's pool: cpu | cuda | cuda:N
    decode_device: str = "cpu"  # the decode rank's pool

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


def device_of(name: str) -> torch.device:
    """The device `name` names, "cuda" as cuda:0 (so that two spellings of one GPU compare equal)."""
    d = torch.device(name)
    return torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d


def why_not(engine: str, cfg: BenchConfig) -> str:
    """Why `engine` cannot move pages from cfg.device to cfg.decode_device ("" when it can)."""
    src, dst = device_of(cfg.device), device_of(cfg.decode_device)
    if engine == "shm" and "cuda" in (src.type, dst.type):
        return "shm moves CPU pools"
    if engine == "cuda_ipc" and "cpu" in (src.type, dst.type):
        return "cuda_ipc moves CUDA pools"
    if engine == "torch" and src.type == "cuda" and src == dst:
        return f"NCCL pairs no two ranks on one GPU ({src})"
    return ""


class Memcpy:
    """A copy of the same bytes between two prefaulted buffers on the two pools' devices: the yardstick."""

    def __init__(self, nbytes: int, src: torch.device, dst: torch.device):
        self.src = torch.full((nbytes,), 7, dtype=torch.uint8, device=src)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=dst)
        self.cuda = [d for d in {src, dst} if d.type == "cuda"]
        self.seconds()

    def _sync(self) -> None:
        for d in self.cuda:
            torch.cuda.synchronize(d)

    def seconds(self) -> float:
        self._sync()
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        self._sync()
        return time.perf_counter() - t0


KEY = bytes(range(16))  # every room's write key (both sides are the benchmark's own)


def decode_main(engine: str, cfg: BenchConfig, out, stop) -> None:
    rc = ReceiverConfig(
        0, 0, cfg.num_layers, cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim, cfg.dtype, cfg.decode_device
    )
    with KVReceiverEndpoint(rc) as receiver:
        for room in range(cfg.repeats + 1):
            receiver.expect(room, f"bench-{room}", cfg.page_ids(1), [Source(0, 0, cfg.num_layers)], engine, KEY)
        out.put(receiver.endpoint)  # (a RankInfo, between this bench's own processes)
        stop.wait(600)


def run_engine(engine: str, cfg: BenchConfig, memcpy: Memcpy) -> list[tuple[float, float]]:
    """(transfer seconds, memcpy seconds) per timed round; the transfer timed on the prefill side,
    with the decode rank in another process, and the memcpy right before it (the machine is noisy)."""
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=decode_main, args=(engine, cfg, out, stop), daemon=True)
    proc.start()
    try:
        endpoint: RankInfo = out.get(timeout=120)
        layout = NodeLayout(cfg.geometry, cfg.num_layers, cfg.num_pages, (endpoint,), "", (engine,), local_host_id())
        dtype = dtype_from_name(cfg.dtype)
        shape = cfg.geometry.pool_shape(cfg.num_pages, (0, cfg.num_layers))
        buffer = torch.randn(shape, dtype=dtype, device=device_of(cfg.device))
        pool = KVPool(cfg.num_pages, (0, cfg.num_layers), cfg.page_size, cfg.kv_heads, cfg.head_dim, dtype,
                      buffer.device, buffer=buffer)  # fmt: skip
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


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, list[str]] | str:
    """The run's config and engines, or an error message."""
    d = BenchConfig()
    ap = argparse.ArgumentParser(prog="kvbridge bench kv_transfer", description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="", help=f"comma-separated, of {', '.join(BACKENDS)} (default: all that "
                    "can move pages between the two devices)")  # fmt: skip
    ap.add_argument("--mib", type=int, default=d.mib)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--num-layers", type=int, default=d.num_layers)
    ap.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--scattered", action="store_true", help="shuffled page ids (no consecutive runs)")
    ap.add_argument("--device", default=d.device, help="the prefill rank's pool: cpu | cuda | cuda:N")
    ap.add_argument("--decode-device", default="", help="the decode rank's pool (default: --device)")
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    args = ap.parse_args(argv)
    cfg = BenchConfig(
        args.mib, args.page_size, args.num_layers, dtype=args.dtype, repeats=args.repeats, scattered=args.scattered,
        device=args.device, decode_device=args.decode_device or args.device,
    )  # fmt: skip
    for name in (cfg.device, cfg.decode_device):
        try:
            dev = device_of(name)
        except RuntimeError:
            return f"bad device {name!r} (cpu | cuda | cuda:N)"
        if dev.type not in ("cpu", "cuda"):
            return f"bad device {name!r} (cpu | cuda | cuda:N)"
        if dev.type == "cuda" and not torch.cuda.is_available():
            return f"device {name!r} asked for, but CUDA is not available"
        if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
            return f"device {name!r} asked for, but {torch.cuda.device_count()} CUDA devices are visible"
    engines = args.engines.split(",") if args.engines else [e for e in BACKENDS if not why_not(e, cfg)]
    unknown = [e for e in engines if e not in BACKENDS]
    if unknown:
        return f"unknown engines {unknown}; choose from {list(BACKENDS)}"
    return cfg, engines


def main(argv: list[str] | None = None) -> int:
    parsed = parse_args(argv)
    if isinstance(parsed, str):
        print(f"bench kv_transfer: error: {parsed}", file=sys.stderr)
        return 2
    cfg, engines = parsed
    nbytes = cfg.num_pages * cfg.num_layers * cfg.geometry.layer_block_bytes
    src, dst = device_of(cfg.device), device_of(cfg.decode_device)
    memcpy = Memcpy(nbytes, src, dst)
    for engine in engines:
        common = {"bench": "kv_transfer", "engine": engine, "device": str(src), "decode_device": str(dst)}
        if reason := why_not(engine, cfg):
            print(json.dumps(common | {"skipped": reason}), flush=True)
            continue
        print(f"bench kv_transfer: {engine} {src} -> {dst}, {cfg.num_pages} pages, {nbytes / 2**20:.1f} MiB ...",
              file=sys.stderr)  # fmt: skip
        rounds = run_engine(engine, cfg, memcpy)
        transfer, copy = min(t for t, _ in rounds), min(m for _, m in rounds)
        row = common | {
            "gbps": round(nbytes / transfer / 1e9, 3),  # best round
            "memcpy_gbps": round(nbytes / copy / 1e9, 3),  # best memcpy src -> dst, each timed right before a round
            "ratio_to_memcpy": round(copy / transfer, 3),  # of the bests
            "ratio_median": round(statistics.median(m / t for t, m in rounds), 3),  # of round-by-round ratios
            "bytes": nbytes,
            "pages": cfg.num_pages,
            "page_bytes": cfg.num_layers * cfg.geometry.layer_block_bytes,
            "dtype": cfg.dtype,
            "scattered": cfg.scattered,
            "repeats": cfg.repeats,
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
