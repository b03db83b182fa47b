"""Point-to-point transport between pipeline ranks over torch.distributed.

Sends are asynchronous (isend) so that no two ranks can block sending to each other;
receives block. Byte payloads are length-prefixed.
"""

from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ControlGroups:
    """The consensus channel's gloo groups (of their own: nothing queues behind hidden states)."""

    ring: object  # rounds, rank k -> k + 1
    nudge: object  # ranks 1..P-1 -> rank 0: "my local status changed", so that an idle rank 0 starts a round


def init(rank: int, world: int, init_addr: str, timeout_s: float) -> tuple:
    """Join the node's process group; returns (data group, ControlGroups), all gloo on CPU."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    data = dist.new_group(backend="gloo")
    return data, ControlGroups(dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))


MAX_UNWAITED = 256  # sends kept before the oldest is waited for (see Sends)


class Sends:
    """Async sends in order, each tensor kept alive until its send is waited for.

    A gloo send reports completion only once wait() is called on it, so polling is_completed()
    never shrinks the list: it would grow with every message (and every scan get slower). The
    receiver takes messages in order, so waiting for the oldest of MAX_UNWAITED sends returns at
    once unless the peer is that far behind, which a pipeline's bounded microbatches rule out."""

    def __init__(self, group):
        self.group = group
        self._works: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._works.append((dist.isend(tensor, dst, group=self.group), tensor))
        while len(self._works) > MAX_UNWAITED:
            self._works.popleft()[0].wait()

    def flush(self) -> None:
        while self._works:
            self._works.popleft()[0].wait()


class Link:
    """One rank's channel to its pipeline neighbours on one process group."""

    def __init__(self, group):
        self.group = group
        self._sends = Sends(group)

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends.send(tensor, dst)

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
        self._sends.flush()
