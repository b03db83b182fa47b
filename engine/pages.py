"""Node-wide KV page bookkeeping: a free-list allocator with shared pages, and per-request page
tables.

Pure Python, no torch: rank 0 hands out page ids, and every rank's physical pool
(engine/kv_pool.py) is indexed by the same ids. A page is free, held (by one request or, once
the prefix cache shared it, by several), or idle: cached by the prefix cache
(engine/prefix_cache.py) with no holder. Idle pages count as free: when the free list runs
dry, the least recently used idle page is evicted and handed out.
"""

from __future__ import annotations

from collections import deque

from kvbridge.engine.prefix_cache import PrefixCache


class PageAllocator:
    """Hands out page ids in [0, num_pages); a page may have several holders (request ids), each
    holding it once. `cache`: the prefix cache whose idle pages count as free (None: no cache)."""

    def __init__(self, num_pages: int, cache: PrefixCache | None = None):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.cache = cache
        self._free: deque[int] = deque(range(num_pages))
        self._holders: dict[int, set[str]] = {}  # page id -> who holds it (never empty)

    @property
    def num_free(self) -> int:
        """Pages an allocate() can hand out now: free ones and idle cached ones."""
        return len(self._free) + (self.cache.num_idle if self.cache else 0)

    @property
    def num_used(self) -> int:
        """Pages held by at least one request."""
        return len(self._holders)

    @property
    def num_holds(self) -> int:
        """(page, holder) pairs: the sum of every holder's page count."""
        return sum(len(h) for h in self._holders.values())

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def can_take(self, new: int, shared: list[int]) -> bool:
        """`new` pages can be allocated after `shared` (cached pages) are shared: the idle ones among
        them count as free until then."""
        return self.can_allocate(new + sum(1 for p in shared if p not in self._holders))

    def allocate(self, owner: str, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"{owner}: asked for {n} KV pages, {self.num_free} free")
        pages = [self._free.popleft() if self._free else self.cache.evict() for _ in range(n)]
        for p in pages:
            self._holders[p] = {owner}
        return pages

    def share(self, owner: str, pages: list[int]) -> None:
        """`owner` holds these cached pages too (a prefix cache hit); idle ones are in use again."""
        for p in pages:
            holders = self._holders.get(p)
            if holders is None:
                self.cache.revive(p)  # (KeyError: neither held nor cached)
                self._holders[p] = {owner}
            elif owner in holders:
                raise ValueError(f"page {p} is held by {owner!r} already")
            else:
                holders.add(owner)

    def free(self, owner: str, pages: list[int]) -> None:
        """`owner` lets go of `pages`; those nobody holds any more are free, or idle when cached."""
        for p in pages:
            if owner not in self._holders.get(p, ()):
                raise ValueError(f"page {p} is held by {sorted(self._holders.get(p, ()))}, not {owner!r}")
        # the last page first: a sequence's deepest blocks become the least recently used, so the
        # prefixes other requests share are evicted last
        for p in reversed(pages):
            holders = self._holders[p]
            holders.discard(owner)
            if not holders:
                del self._holders[p]
                if self.cache is None or not self.cache.park(p):
                    self._free.append(p)

    def clear_cache(self) -> int:
        """Drop the prefix cache's index; its idle pages are free again. Returns how many."""
        if self.cache is None:
            return 0
        idle = self.cache.clear()
        self._free.extend(idle)
        return len(idle)

    def holders(self, page: int) -> set[str]:
        return set(self._holders.get(page, ()))

    def owners(self) -> set[str]:
        return set().union(*self._holders.values()) if self._holders else set()

    def owned_by(self, owner: str) -> list[int]:
        return sorted(p for p, h in self._holders.items() if owner in h)

    def check_invariants(self) -> None:
        free = set(self._free)
        idle = self.cache.idle_pages() if self.cache else set()
        if len(free) != len(self._free):
            raise AssertionError(f"free list holds duplicates: {len(self._free)} entries, {len(free)} distinct")
        for name, a, b in (("free and held", free, self._holders.keys()), ("free and idle", free, idle)):
            if a & b:
                raise AssertionError(f"pages both {name}: {sorted(a & b)[:8]}")
        if idle & self._holders.keys():
            raise AssertionError(f"pages both idle and held: {sorted(idle & self._holders.keys())[:8]}")
        if len(free) + len(self._holders) + len(idle) != self.num_pages:
            raise AssertionError(
                f"free({len(free)}) + held({len(self._holders)}) + idle({len(idle)}) != num_pages({self.num_pages})"
            )
        if self.cache is not None:
            self.cache.check_invariants()
            unindexed = [p for p in idle if not self.cache.indexed(p)]
            if unindexed:
                raise AssertionError(f"idle pages the cache does not index: {unindexed[:8]}")


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
