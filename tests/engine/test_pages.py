"""The page allocator: no leak, no double ownership, under any allocate/free sequence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.engine.pages import PageAllocator, PageTable

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(0, 9)), max_size=60)


@settings(max_examples=400, deadline=None)
@given(num_pages=st.integers(1, 24), ops=ops)
def test_used_plus_free_is_total_and_no_page_owned_twice(num_pages, ops):
    alloc = PageAllocator(num_pages)
    held: dict[str, list[int]] = {}
    for op, owner_i, n in ops:
        owner = f"r{owner_i}"
        if op == "alloc":
            if alloc.can_allocate(n):
                held.setdefault(owner, []).extend(alloc.allocate(owner, n))
            else:
                with pytest.raises(MemoryError):
                    alloc.allocate(owner, n)
        elif held.get(owner):
            k = min(n, len(held[owner]))
            freed, held[owner] = held[owner][:k], held[owner][k:]
            alloc.free(owner, freed)
        alloc.check_invariants()
        all_held = [p for pages in held.values() for p in pages]
        assert len(all_held) == len(set(all_held)) == alloc.num_used
        assert alloc.num_used + alloc.num_free == num_pages
        for owner, pages in held.items():
            assert alloc.owned_by(owner) == sorted(pages)


def test_free_by_a_non_owner_is_refused_and_changes_nothing():
    alloc = PageAllocator(4)
    pages = alloc.allocate("a", 2)
    with pytest.raises(ValueError, match=r"held by \['a'\], not 'b'"):
        alloc.free("b", pages)
    assert alloc.num_used == 2 and alloc.owned_by("a") == sorted(pages)


def test_page_table_maps_tokens_to_pages_and_offsets():
    table = PageTable(page_size=4)
    assert table.num_pages_needed(9) == 3
    table.pages = [7, 2, 5]
    assert table.num_pages_needed(9) == 0 and table.num_pages_needed(13) == 1
    assert table.slots(3, 9) == ([7, 2, 2, 2, 2, 5], [3, 0, 1, 2, 3, 0])
