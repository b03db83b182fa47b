"""Point-to-point transport between pipeline ranks over torch.distributed.

Sends are asynchronous (isend) so that no two ranks can block sending to each other;
receives block. Byte payloads are length-prefixed.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init(rank: int, world: int, init_addr: str, timeout_s: float) -> tuple:
    """Join the node's process group; returns (data group, control group), both gloo on CPU."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    return dist.new_group(backend="gloo"), dist.new_group(backend="gloo")


class Link:
    """One rank's channel to its pipeline neighbours on one process group."""

    def __init__(self, group):
        self.group = group
        self._sending: list[tuple[dist.Work, torch.Tensor]] = []  # tensors kept alive until sent

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        self._sending = [(w, t) for w, t in self._sending if not w.is_completed()]
        self._sending.append((dist.isend(tensor, dst, group=self.group), tensor))

    def send_bytes(self, payload: bytes, dst: int) -> None:
        self._isend(torch.tensor([len(payload)], dtype=torch.int64), dst)
        self._isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst)

    def recv_bytes(self, src: int) -> bytes:
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, src, group=self.group)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(buf, src, group=self.group)
        return buf.numpy().tobytes()

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        self._isend(tensor.contiguous(), dst)

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        dist.recv(out, src, group=self.group)
        return out

    def flush(self) -> None:
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()
