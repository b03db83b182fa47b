"""The backends, registered here once: a new one is a module in backends/ (backends/base.py says
what it holds) and one entry below."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbridge.engine.kv_pool import KVPool
from kvbridge.kv_transfer.backends import cuda_ipc, grpc_stream, shm, torch_p2p
from kvbridge.kv_transfer.backends.base import Backend
from kvbridge.kv_transfer.layout import NodeLayout
from kvbridge.kv_transfer.poll import StatusChange
from kvbridge.kv_transfer.sender import Sender, SenderConfig

# In order of preference: `auto` takes the first one both nodes drive and the pair can use.
REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        shm.BACKEND,  # same host, CPU pools: one copy into the decode rank's shared pool
        cuda_ipc.BACKEND,  # same host, GPU pools: device-to-device copies through IPC handles
        torch_p2p.BACKEND,  # anywhere torch.distributed reaches: gloo (CPU) or NCCL (GPU) pairs
        grpc_stream.BACKEND,  # anywhere: pages as bytes on a gRPC stream (the fallback)
    )
}
BACKENDS = tuple(REGISTRY)  # what a node may list in KVLayout.backends
CHOICES = ("auto", *BACKENDS)  # what --transfer-backend accepts
FALLBACK = "grpc"  # every decode rank's KVReceiver takes it


def backend(name: str) -> Backend:
    if name not in REGISTRY:
        raise ValueError(f"transfer backend must be one of {list(REGISTRY)}, got {name!r}")
    return REGISTRY[name]


def drivable(device: str | torch.device) -> tuple[str, ...]:
    """The backends a node whose KV pools live on `device` can drive."""
    return tuple(name for name, b in REGISTRY.items() if b.moves(device))


def make_sender(
    name: str,
    pool: KVPool,
    rank: int,
    config: SenderConfig | None = None,
    on_change: Callable[[StatusChange], None] | None = None,
) -> Sender:
    """The prefill rank's sender for one backend (resolve "auto" with choose_backend first)."""
    return backend(name).sender(pool, rank, config, on_change)


def choose_backend(prefill: NodeLayout, decode: NodeLayout, device: str | torch.device = "cpu") -> str:
    """The first registered backend that both nodes drive, that moves pools on `device`, that the
    pair's hosts allow, and whose endpoint every decode rank published; else the fallback."""
    if not all(r.receiver_addr for r in decode.ranks):  # every backend's notices go there
        raise ValueError("the decode layout has a rank without a receiver address")
    both = set(prefill.backends) & set(decode.backends)
    same_host = bool(prefill.host_id) and prefill.host_id == decode.host_id
    for name, b in REGISTRY.items():
        if name not in both or not b.moves(device) or (b.same_host and not same_host):
            continue
        if all(r.endpoint(name) is not None for r in decode.ranks):
            return name
    return FALLBACK
