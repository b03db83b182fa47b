"""Backends are chosen here, once, by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kv_pool import KVPool
from kv_transfer.backends.cuda_ipc import CudaIpcSender
from kv_transfer.backends.grpc_stream import GrpcSender
from kv_transfer.backends.shm import ShmSender
from kv_transfer.backends.torch_p2p import TorchSender
from kv_transfer.layout import NodeLayout
from kv_transfer.poll import StatusChange
from kv_transfer.sender import Sender, SenderConfig

SENDERS: dict[str, type[Sender]] = {
    "shm": ShmSender,  # same host, CPU pools: one copy into the decode rank's shared pool
    "cuda_ipc": CudaIpcSender,  # same host, GPU pools: device-to-device copies through IPC handles
    "torch": TorchSender,  # anywhere torch.distributed reaches: gloo (CPU) or NCCL (GPU) pairs
    "grpc": GrpcSender,  # anywhere: pages as bytes on a gRPC stream
}
BACKENDS = tuple(SENDERS)  # what a node lists in KVLayout.backends
CHOICES = ("auto", *BACKENDS)  # what --transfer-backend accepts
CPU_BACKENDS = ("shm", "torch", "grpc")  # what a node whose pools are in host memory can drive
CUDA_BACKENDS = ("cuda_ipc", "torch", "grpc")  # ... and one whose pools are on a GPU


def drivable(device: str | torch.device) -> tuple[str, ...]:
    """The backends a node whose KV pools live on `device` can drive."""
    return CUDA_BACKENDS if torch.device(device).type == "cuda" else CPU_BACKENDS


def make_sender(
    name: str,
    pool: KVPool,
    rank: int,
    config: SenderConfig | None = None,
    on_change: Callable[[StatusChange], None] | None = None,
) -> Sender:
    """The prefill rank's sender for one backend (resolve "auto" with choose_backend first)."""
    if name not in SENDERS:
        raise ValueError(f"transfer backend must be one of {list(SENDERS)}, got {name!r}")
    return SENDERS[name](pool, rank, config, on_change)


def choose_backend(prefill: NodeLayout, decode: NodeLayout, device: str | torch.device = "cpu") -> str:
    """The fastest backend both nodes drive and the pair can use: shm (same host, CPU pools),
    cuda_ipc (same host, CUDA pools), torch, then grpc, the universal fallback."""
    if not all(r.receiver_addr for r in decode.ranks):  # every backend's notices go there
        raise ValueError("the decode layout has a rank without a receiver address")
    both = set(prefill.backends) & set(decode.backends)
    same_host = bool(prefill.host_id) and prefill.host_id == decode.host_id
    ranks = decode.ranks
    on_cuda = torch.device(device).type == "cuda"
    if same_host and not on_cuda and "shm" in both and all(r.shm_name for r in ranks):
        return "shm"
    if same_host and on_cuda and "cuda_ipc" in both and all(r.cuda_ipc_handle for r in ranks):
        return "cuda_ipc"
    if "torch" in both and all(r.torch_addr for r in ranks):
        return "torch"
    return "grpc"
