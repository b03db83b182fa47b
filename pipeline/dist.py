"""Point-to-point transport between pipeline ranks over torch.distributed.

Sends are asynchronous (isend) so that no two ranks can block sending to each other;
receives block. Byte payloads are length-prefixed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvbridge.common.net import gloo_backend, listening_store, local_address


@dataclass(frozen=True)
class ControlGroups:
    """The consensus channel's gloo groups (of their own: nothing queues behind hidden states)."""

    ring: object  # rounds, rank k -> k + 1
    nudge: object  # ranks 1..P-1 -> rank 0: "my local status changed", so that an idle rank 0 starts a round


def init(rank: int, world: int, init_addr: str, timeout_s: float, key: str = "", listener=None) -> tuple:
    """Join the node's process group; returns (data group, ControlGroups), all gloo on CPU. Rank 0
    serves the rendezvous store, listening on init_addr's host only; with `key`, every rendezvous
    key lives under that secret prefix (a stranger reaching the store cannot meddle with them).
    listener: rank 0's socket already listening on init_addr (else rank 0 binds it)."""
    host, _, port = init_addr.rpartition(":")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = listening_store(host, int(port), timeout, world, listener)
    else:
        store = dist.TCPStore(host.strip("[]"), int(port), world, is_master=False, timeout=timeout)
    if key:
        store = dist.PrefixStore(f"kvbridge/{key}/", store)
    # every group's transport listens on loopback when the ranks meet there; across hosts each rank
    # listens on its own address that reaches rank 0's host (init_addr's), where its peers reach it too
    backend = gloo_backend(local_address(host))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    data = dist.new_group(backend=backend)
    ring, nudge = (dist.new_group(backend=backend) for _ in range(2))
    return data, ControlGroups(ring, nudge)


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
        self._isend(tensor.detach().cpu().contiguous(), dst)  # (gloo moves host memory only)

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        dist.recv(out, src, group=self.group)
        return out

    def flush(self) -> None:
        self._sends.flush()
