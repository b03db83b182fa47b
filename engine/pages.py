"""Node-wide KV page bookkeeping: a free-list allocator and per-request page tables.

Pure Python, no torch: rank 0 hands out page ids, and every rank's physical pool
(engine/kv_pool.py) is indexed by the same ids.
"""

from __future__ import annotations

from collections import deque


class PageAllocator:
    """Hands out page ids in [0, num_pages) to owners; every page has at most one owner."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, str] = {}  # page id -> owner (a request id)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: str, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{owner}: asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, owner: str, pages: list[int]) -> None:
        for p in pages:
            if self._owner.get(p) != owner:
                raise ValueError(f"page {p} is owned by {self._owner.get(p)!r}, not {owner!r}")
        for p in pages:
            del self._owner[p]
            self._free.append(p)

    def owners(self) -> set[str]:
        return set(self._owner.values())

    def owned_by(self, owner: str) -> list[int]:
        return sorted(p for p, o in self._owner.items() if o == owner)

    def check_invariants(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"free list holds duplicates: {len(self._free)} entries, {len(free)} distinct")
        if free & self._owner.keys():
            raise AssertionError(f"pages both free and owned: {sorted(free & self._owner.keys())[:8]}")
        if len(free) + len(self._owner) != self.num_pages:
            raise AssertionError(f"free({len(free)}) + used({len(self._owner)}) != num_pages({self.num_pages})")


class PageTable:
    """The pages one request holds, in token order: token t lives in page pages[t // page_size]."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def num_pages_needed(self, num_tokens: int) -> int:
        """Extra pages needed so that the table covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(self.pages))

    def slots(self, start: int, end: int) -> tuple[list[int], list[int]]:
        """(page id, offset in page) of each token position in [start, end)."""
        ps = self.page_size
        return [self.pages[t // ps] for t in range(start, end)], [t % ps for t in range(start, end)]
