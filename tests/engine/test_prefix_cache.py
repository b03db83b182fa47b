"""The prefix cache on the engine: exact outputs with it on and off, the pages it shares, its
LRU eviction and events, and an eviction storm that leaks nothing."""

from __future__ import annotations

import itertools
import random

import pytest

from kvbridge.common import blocks
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.pages import PageAllocator
from kvbridge.engine.prefix_cache import CLEARED, REMOVED, STORED, PrefixCache
from tests.conftest import make_llm

PS = 4  # page size of make_llm's engines
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7)


def test_block_hashes_chain_whole_prefixes_and_salts():
    a = blocks.block_hashes(list(range(10)), 4)
    assert len(a) == 2  # two full blocks; the last 2 tokens are not a block
    assert blocks.block_hashes(list(range(8)), 4) == a  # a block's hash depends only on its prefix
    assert blocks.block_hashes([9, *range(1, 8)], 4)[1] != a[1]  # ... all of it: block 1 differs too
    assert blocks.block_hashes(list(range(8)), 4, salt="tenant-a") != a
    assert blocks.extend(a[:1], list(range(12)), 4) == blocks.block_hashes(list(range(12)), 4)


def test_allocator_shares_parks_and_evicts_least_recently_used_deepest_first():
    cache = PrefixCache()
    alloc = PageAllocator(4, cache)
    pages = alloc.allocate("a", 3)
    cache.insert([11, 12, 13], pages)
    alloc.share("b", pages[:2])
    assert alloc.holders(pages[0]) == {"a", "b"} and alloc.num_holds == 5 and alloc.num_used == 3
    alloc.free("a", pages)  # page 3 of a is idle now; 1 and 2 still b's
    assert cache.num_idle == 1 and alloc.num_free == 2
    alloc.free("b", pages[:2])
    assert alloc.num_used == 0 and alloc.num_free == 4 and cache.num_cached == 3
    # a's deepest block went idle first: it is evicted first, then b's (freed last page first)
    got = alloc.allocate("c", 3)
    assert got[0] not in pages and got[1:] == [pages[2], pages[1]]
    assert cache.match([11, 12, 13]) == [pages[0]]
    alloc.check_invariants()
    assert cache.take_events() == [(STORED, [11, 12, 13]), (REMOVED, [13, 12])]
    with pytest.raises(ValueError, match=r"held by \['c'\], not 'a'"):
        alloc.free("a", got[:1])


def test_clear_drops_the_index_and_frees_idle_pages_only():
    cache = PrefixCache()
    alloc = PageAllocator(4, cache)
    pages = alloc.allocate("a", 2)
    cache.insert([1, 2], pages)
    alloc.free("a", pages[1:])
    assert alloc.clear_cache() == 1
    assert cache.num_cached == 0 and cache.match([1]) == [] and alloc.num_free == 3
    alloc.free("a", pages[:1])  # no longer indexed: freed, not parked
    assert alloc.num_free == 4 and cache.num_idle == 0
    alloc.check_invariants()
    assert cache.take_events() == [(CLEARED, [])]


@pytest.fixture(scope="module")
def engines(tiny_model):
    on = make_llm(tiny_model, chunked_prefill_size=8)
    off = make_llm(tiny_model, chunked_prefill_size=8, disable_prefix_cache=True)
    return on, off


def _turns(vocab: int, seed: int) -> list[list[int]]:
    """Prompts sharing prefixes of every alignment with the first: mid-page, on a page boundary,
    the whole prompt again (a full hit leaves its last token to compute), longer, and diverging."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(37)]
    return [
        base[:13],  # 3 full pages + 1
        base[:13],  # the same again: 3 pages hit (the last token is computed)
        base[:16],  # ends exactly on a page boundary: 3 pages hit, the 4th page computed
        base[:16],  # the same again: still 3 (4 would leave nothing to compute)
        base[:30],  # 4 pages hit, mid-page end
        base[:9] + [rng.randrange(3, vocab) for _ in range(12)],  # diverges inside page 3
        base[:37],
    ]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_with_the_cache_equal_outputs_without_it(engines, tiny_model, params):
    on, off = engines
    on.allocator.clear_cache()
    prompts = _turns(tiny_model.config.vocab_size, seed=3)
    hits = [on.allocator.cache.hit_tokens]
    for prompt in prompts:  # one at a time: each turn finds the pages of those before it
        got = on.generate([prompt], params)[0]
        want = off.generate([prompt], params)[0]
        assert got.output_ids == want.output_ids
        hits.append(on.allocator.cache.hit_tokens)
        on.check_invariants()
    assert [b - a for a, b in itertools.pairwise(hits)] == [0, 12, 12, 12, 16, 8, 28]


def test_salted_requests_share_nothing_with_others(engines, tiny_model):
    on, _ = engines
    on.allocator.clear_cache()
    prompt = _turns(tiny_model.config.vocab_size, seed=5)[0]
    want = on.generate([prompt], GREEDY)[0].output_ids
    before = on.allocator.cache.hit_tokens
    req = on.add_request(prompt, GREEDY, cache_salt="tenant-b")
    while on.scheduler.num_unfinished:
        on.step()
    assert req.output_ids == want and req.cached_tokens == 0 and on.allocator.cache.hit_tokens == before
    again = on.add_request(prompt, GREEDY, cache_salt="tenant-b")
    while on.scheduler.num_unfinished:
        on.step()
    assert again.cached_tokens == 12 and again.output_ids == want


def test_an_eviction_storm_leaks_nothing_and_changes_no_output(tiny_model):
    """300 requests over 20 shared prefixes through a pool that holds a fraction of them: pages
    are evicted all the time; every step keeps refcounts and the index consistent."""
    rng = random.Random(11)
    vocab = tiny_model.config.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 40))] for _ in range(20)]
    prompts = [rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))] for _ in range(300)]
    # 48 pages of 4 tokens: the prefixes alone need ~125
    on = make_llm(tiny_model, chunked_prefill_size=16, num_pages=48, max_running_requests=8)
    off = make_llm(tiny_model, chunked_prefill_size=16, num_pages=48, max_running_requests=8, disable_prefix_cache=True)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    reqs = [on.add_request(p, params) for p in prompts]
    while on.scheduler.num_unfinished:
        on.step()
        on.check_invariants()
    want = [c.output_ids for c in off.generate(prompts, params)]
    assert [r.output_ids for r in reqs] == want
    cache = on.allocator.cache
    assert cache.evicted > 100 and cache.hit_tokens > 0
    assert on.allocator.num_used == 0 and on.allocator.num_free == 48  # nothing held: every page free or idle
    on.check_invariants()
