"""The prefix cache: full KV pages indexed by their block hash (common/blocks.py), so that a
request whose prompt starts like an earlier one reuses those pages instead of computing them.

Rank 0 owns it, beside the page allocator (engine/pages.py): the scheduler looks a request's
blocks up when it admits it (`match`) and indexes each page once every token of it is computed
(`insert`). An indexed page no request holds is idle: it keeps its KV, counts as free, and is
evicted least recently used first when the allocator runs out of free pages. The other ranks
keep no index: they write and read the pages the batches name, so they cannot disagree with it.

Every change is recorded as an event (STORED / REMOVED / CLEARED, with block hashes) for the
node's KV event stream (serving/kv_events.py); rank 0 takes them after each step (`take_events`).
"""

from __future__ import annotations

from collections import OrderedDict

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


class PrefixCache:
    def __init__(self) -> None:
        self._page: dict[int, int] = {}  # block hash -> page id
        self._hash: dict[int, int] = {}  # page id -> block hash
        self._idle: OrderedDict[int, None] = OrderedDict()  # indexed pages nobody holds, least recent first
        self._events: list[tuple[str, list[int]]] = []
        self.hit_tokens = 0  # prompt tokens found cached, since start
        self.query_tokens = 0  # prompt tokens looked up, since start
        self.evicted = 0  # pages evicted, since start

    # ---------------------------------------------------------------- the scheduler

    def match(self, hashes: list[int]) -> list[int]:
        """The pages of the longest run of `hashes`, from the first, that is cached."""
        pages = []
        for h in hashes:
            page = self._page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def insert(self, hashes: list[int], pages: list[int]) -> None:
        """Index pages[i] under hashes[i] (their tokens are computed); a block cached already keeps
        its page (this one stays its request's own)."""
        stored = []
        for h, page in zip(hashes, pages):
            if h not in self._page and page not in self._hash:
                self._page[h], self._hash[page] = page, h
                stored.append(h)
        if stored:
            self._record(STORED, stored)

    def lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one admission's lookup: `hit_tokens` of `query_tokens` prompt tokens were cached."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    # ---------------------------------------------------------------- the allocator

    def park(self, page: int) -> bool:
        """The page's last holder let go: True if it is indexed (it is idle now, most recent)."""
        if page not in self._hash:
            return False
        self._idle[page] = None
        return True

    def revive(self, page: int) -> None:
        """An idle page is held again (a cache hit)."""
        del self._idle[page]

    def evict(self) -> int:
        """Drop the least recently used idle page from the index; it is the caller's to hand out."""
        page, _ = self._idle.popitem(last=False)
        h = self._hash.pop(page)
        del self._page[h]
        self.evicted += 1
        self._record(REMOVED, [h])
        return page

    def clear(self) -> list[int]:
        """Forget every block; returns the idle pages (free now). Pages still held stay their holders'."""
        idle = list(self._idle)
        self._page.clear()
        self._hash.clear()
        self._idle.clear()
        self._events = [(CLEARED, [])]
        return idle

    # ---------------------------------------------------------------- what others read

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._hash)

    def indexed(self, page: int) -> bool:
        return page in self._hash

    def idle_pages(self) -> set[int]:
        return set(self._idle)

    def hashes(self) -> list[int]:
        return list(self._page)

    def take_events(self) -> list[tuple[str, list[int]]]:
        out, self._events = self._events, []
        return out

    def stats(self) -> dict:
        return {
            "enabled": True,
            "cached_pages": len(self._hash),
            "idle_pages": len(self._idle),
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "evicted_pages": self.evicted,
        }

    def check_invariants(self) -> None:
        if len(self._page) != len(self._hash) or any(self._hash.get(p) != h for h, p in self._page.items()):
            raise AssertionError(f"the index is not one-to-one: {len(self._page)} hashes, {len(self._hash)} pages")
        stray = [p for p in self._idle if p not in self._hash]
        if stray:
            raise AssertionError(f"idle pages that are not indexed: {stray[:8]}")

    def _record(self, kind: str, hashes: list[int]) -> None:
        if self._events and self._events[-1][0] == kind and kind != CLEARED:
            self._events[-1][1].extend(hashes)
        else:
            self._events.append((kind, hashes))
