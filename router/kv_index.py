"""What one node's prefix cache holds, as its KV events tell the router: `BlockIndex`.

A block is one full KV page, named by a chained hash of the whole prefix up to it
(common/blocks.py), so a node holding block i of a prompt holds every block before it too, unless
it evicted one. `overlap` counts the blocks of a prompt a node holds from the first on, up to the
first it lacks: the prefix it would not compute again.

Batches (the node's KVEvents.Watch stream, router/pool.py) are applied in order: a snapshot
replaces the set; a change batch must carry the next seq, else the index has missed one (a gap)
and is cleared until the next snapshot. Past `max_blocks` the index is cleared too (the router's
memory is bounded whatever a node sends). Writes come from the router's loop; reads from any
thread (selection, the metrics scrape) under the index's own lock, never held with another.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvbridge.v1 import kv_events_pb2

MAX_BLOCKS = 1 << 22  # blocks indexed per node (~250 MiB of Python ints); past it: cleared and resynced
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
_KINDS = {
    kv_events_pb2.KVEvent.STORED: STORED,
    kv_events_pb2.KVEvent.REMOVED: REMOVED,
    kv_events_pb2.KVEvent.CLEARED: CLEARED,
}


@dataclass(frozen=True)
class Event:
    kind: str  # STORED | REMOVED | CLEARED
    hashes: Sequence[int] = ()  # block hashes, unsigned 64-bit (empty for CLEARED)


@dataclass(frozen=True)
class Batch:
    seq: int  # consecutive on one stream; a snapshot's is the seq it is current as of
    snapshot: bool  # events are every block the node holds: they replace what was known
    events: tuple[Event, ...]
    page_size: int  # tokens per block
    role: str = ""  # the node's role, as it says

    @property
    def size(self) -> int:
        """Hashes carried (what applying it costs)."""
        return sum(len(e.hashes) for e in self.events)


def batch_from_proto(msg: kv_events_pb2.KVEventBatch) -> Batch:
    """A KVEventBatch as a Batch; ValueError for an event of unknown kind or no page size (the
    stream is not trusted)."""
    if msg.page_size < 1:
        raise ValueError("KV event batch without a page size")
    events = []
    for e in msg.events:
        if e.kind not in _KINDS:
            raise ValueError(f"KV event of unknown kind {e.kind}")
        events.append(Event(_KINDS[e.kind], list(e.block_hashes)))
    return Batch(msg.seq, msg.snapshot, tuple(events), msg.page_size, msg.role)


class BlockIndex:
    """The block hashes one node holds, its page size and the seq of the last batch applied."""

    def __init__(self, max_blocks: int = MAX_BLOCKS):
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._blocks: set[int] = set()
        self._page_size = 0  # tokens per block; 0 = not synced
        self._seq: int | None = None  # of the last batch applied; None = not synced (no snapshot since a clear)

    @property
    def synced(self) -> bool:
        """A snapshot was applied since the last clear: overlap() is the node's state."""
        return self._seq is not None

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def seq(self) -> int | None:
        return self._seq

    def hashes(self) -> frozenset[int]:
        """A copy of the set (for tests and operators: it may be large)."""
        with self._lock:
            return frozenset(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def apply(self, batch: Batch) -> str | None:
        """Apply a batch; returns why the index had to be cleared instead ("gap": a change batch
        out of sequence or of another page size, or before any snapshot; "overflow": more than
        max_blocks), else None."""
        if batch.snapshot:
            blocks = _applied(set(), batch.events)
            if len(blocks) > self.max_blocks:
                self.clear()
                return "overflow"
            with self._lock:
                self._blocks, self._seq, self._page_size = blocks, batch.seq, batch.page_size
            return None
        with self._lock:
            if self._seq is None or batch.seq != self._seq + 1 or batch.page_size != self._page_size:
                verdict = "gap"
            else:
                _applied(self._blocks, batch.events)
                self._seq = batch.seq
                verdict = "overflow" if len(self._blocks) > self.max_blocks else None
        if verdict is not None:
            self.clear()
        return verdict

    def clear(self) -> None:
        """Forget everything: overlap() is 0 until the next snapshot."""
        with self._lock:
            self._blocks, self._seq, self._page_size = set(), None, 0

    def overlap(self, hashes: Iterable[int]) -> int:
        """How many of `hashes` (a prompt's blocks, in order) the node holds from the first on,
        stopping at the first it lacks."""
        n = 0
        with self._lock:
            blocks = self._blocks
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
        return n


def _applied(blocks: set[int], events: Iterable[Event]) -> set[int]:
    for e in events:
        if e.kind == STORED:
            blocks.update(e.hashes)
        elif e.kind == REMOVED:
            blocks.difference_update(e.hashes)
        else:
            blocks.clear()
    return blocks
