"""What a transfer backend is: both halves of one way to move pages, and how to choose it.

A backend is one module in this folder that defines its `Backend` and one line in
kv_transfer/factory.py REGISTRY. The module holds:

- the sending half, a `Sender` subclass (kv_transfer/sender.py): how a prefill rank opens a
  connection to one decode rank from that rank's endpoint data, and writes pages through it;
- the receiving half, a `Receiving` subclass: what a decode rank opens for the backend at
  start-up (a shared segment, a store, nothing), and the endpoint data it publishes
  (layout.Endpoint), which travels in the rank's RankEndpoint.endpoints[name] as the backend's
  own bytes;
- `check`: why a peer's endpoint data for the backend cannot be used ("" when it can): run on
  every layout that arrives from the network (adapters.layout_from_proto).

Every backend's notices (TransferDone, FirstToken) go to the decode rank's KVReceiver service,
which checks each page id, layer and byte count (rooms.py); a backend adds no second way in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvbridge.kv_transfer.sender import Sender

if TYPE_CHECKING:
    from kvbridge.engine.kv_pool import KVPool
    from kvbridge.kv_transfer.receiver import ReceiverConfig
    from kvbridge.kv_transfer.rooms import RoomTable


class Receiving:
    """A backend's half on one decode rank, open for the rank's life. The receiver calls, in order:
    buffer (once, before the pool exists), start (once, with the pool), close (once, at the end,
    also after a failed start)."""

    def __init__(self, config: ReceiverConfig):
        self.config = config

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Memory for the rank's pool, where the backend needs the pool in memory of its own (a
        shared segment); None to leave the pool where the engine puts it."""
        return None

    def start(self, pool: KVPool, rooms: RoomTable) -> bytes:
        """Open (the pool exists now; `rooms` checks and counts every write) and return the endpoint
        data senders need to reach this half (b"" when the rank's KVReceiver address is enough)."""
        return b""

    def close(self) -> None:
        """Stop; idempotent."""


@dataclass(frozen=True)
class Backend:
    name: str  # as --transfer-backend, KVLayout.backends and RegisterRequest.backend say it
    devices: frozenset[str]  # device types of the pools it moves ("cpu", "cuda")
    sender: type[Sender]  # the prefill rank's half
    receiving: Callable[[ReceiverConfig], Receiving]  # the decode rank's half
    same_host: bool = False  # only between two processes of one host (local_host_id)
    direct: bool = False  # the sender writes into the decode pool itself: the decode rank counts the
    #                       bytes its notices report, not bytes that came through it
    check: Callable[[bytes], str] = lambda data: ""  # why a peer's endpoint data is unusable ("" when fine)

    def moves(self, device: str | torch.device) -> bool:
        """Whether the backend moves pools that live on `device`."""
        return torch.device(device).type in self.devices
