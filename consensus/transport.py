"""The ring transport interface, and an in-memory ring for tests.

A transport is one rank's two ends of the control ring (rank r sends to (r + 1) % P and
receives from (r - 1) % P). Two operations, both called only by that rank's driver:

    send(payload: bytes) -> None
        Queue `payload` for the next rank. Reliable and in order (FIFO per link); it may
        return before the peer received it, and must not wait for the peer to call recv.
        A broken link raises (any exception: the driver lets it propagate).
    recv(timeout: float | None) -> bytes | None
        The next payload from the previous rank, whole and exactly once. timeout is in
        seconds: 0 polls, None waits for ever; returns None when nothing arrived in time.

Payloads are small (a few bytes per rid in flight) and opaque to the transport; the
driver encodes and decodes them (`consensus.codec`). A torch.distributed implementation
sends a length (one int64 tensor) then the bytes (a uint8 tensor) on a gloo group of its
own, so rounds never queue behind hidden states. With pp_size == 1 no transport is used.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, runtime_checkable


@runtime_checkable
class Transport(Protocol):
    """One rank's ends of the control ring: send to the next rank, receive from the previous."""

    def send(self, payload: bytes) -> None: ...

    def recv(self, timeout: float | None) -> bytes | None: ...


class InMemoryRing:
    """A ring of `pp_size` in-process links. Single-threaded: recv never blocks (timeouts are ignored)."""

    def __init__(self, pp_size: int):
        if pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {pp_size}")
        self.pp_size = pp_size
        self._inboxes: list[deque[bytes]] = [deque() for _ in range(pp_size)]  # by receiving rank
        self.num_sent = 0  # payloads sent over any link
        self.bytes_sent = 0  # their total size

    def endpoint(self, rank: int) -> InMemoryEndpoint:
        if not 0 <= rank < self.pp_size:
            raise ValueError(f"rank must be in [0, {self.pp_size}), got {rank}")
        return InMemoryEndpoint(self, rank)

    def pending(self, rank: int) -> int:
        """Payloads waiting for `rank`."""
        return len(self._inboxes[rank])

    def deliver(self, to_rank: int, payload: bytes) -> None:
        self._inboxes[to_rank].append(bytes(payload))
        self.num_sent += 1
        self.bytes_sent += len(payload)

    def take(self, rank: int) -> bytes | None:
        inbox = self._inboxes[rank]
        return inbox.popleft() if inbox else None


class InMemoryEndpoint:
    """Rank `rank`'s ends of an InMemoryRing; implements Transport."""

    def __init__(self, ring: InMemoryRing, rank: int):
        self.ring = ring  # the ring it belongs to
        self.rank = rank  # this rank

    def send(self, payload: bytes) -> None:
        if not isinstance(payload, (bytes, bytearray)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        self.ring.deliver((self.rank + 1) % self.ring.pp_size, payload)

    def recv(self, timeout: float | None = 0) -> bytes | None:
        return self.ring.take(self.rank)
