"""n > 1 in the scheduler: choices i > 0 share choice 0's full prompt pages, cache or no cache; each
computes only the prompt's last partial page (its own: it writes its own tokens there), only once
choice 0's prompt is scheduled; a shared page is freed when the last choice holding it ends."""

from __future__ import annotations

import pytest

from common.sampling import SamplingParams
from engine.config import EngineConfig
from engine.pages import PageAllocator, PageTable
from engine.prefix_cache import PrefixCache
from engine.request import Phase, Request
from engine.scheduler import Scheduler

PS = 4
PROMPT = list(range(3, 33))  # 30 tokens: 7 full pages before the last token, 2 tokens on the 8th


def scheduler(cache: bool, chunk: int = 16, pages: int = 64) -> Scheduler:
    config = EngineConfig(model="tiny-random", page_size=PS, chunked_prefill_size=chunk, max_running_requests=16)
    return Scheduler(config, PageAllocator(pages, PrefixCache() if cache else None), max_context=256)


def choices(n: int, max_new: int = 3) -> list[Request]:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=1.0, seed=7, n=n)
    reqs = [Request(f"r:n{i}" if i else "r", list(PROMPT), params.choice(i), PageTable(PS)) for i in range(n)]
    for child in reqs[1:]:
        child.parent = reqs[0]
    return reqs


def run_step(s: Scheduler, token: int = 5):
    step = s.schedule()
    assert step is not None
    finished = s.postprocess(step, [token] * len(step.sampled))
    return step, finished


@pytest.mark.parametrize("cache", [False, True])
def test_choices_share_the_prompt_pages_and_compute_the_last_partial_page_each(cache):
    s = scheduler(cache)
    reqs = choices(4)
    for r in reqs:
        s.add(r)
    # chunks of 16: choice 0's prompt takes two steps; the others wait for it (FCFS behind it)
    step, _ = run_step(s)
    assert [(rid, q) for rid, q in zip(step.batch.rids, step.batch.q_lens)] == [("r", 16)]
    step, _ = run_step(s)
    assert [(rid, q) for rid, q in zip(step.batch.rids, step.batch.q_lens)] == [("r", 14)]
    # then each choice computes the 2 tokens after the 7 shared pages, and choice 0 decodes
    step, _ = run_step(s)
    assert list(zip(step.batch.rids, step.batch.starts, step.batch.q_lens)) == [
        ("r", 30, 1), ("r:n1", 28, 2), ("r:n2", 28, 2), ("r:n3", 28, 2)
    ]  # fmt: skip
    shared = reqs[0].page_table.pages[:7]
    for child in reqs[1:]:
        assert child.page_table.pages[:7] == shared
        assert child.page_table.pages[7] not in reqs[0].page_table.pages  # the partial page is its own
        assert child.cached_tokens == 28
    assert all(s.allocator.holders(p) == {"r", "r:n1", "r:n2", "r:n3"} for p in shared)
    assert s.allocator.num_used == 7 + 4  # the shared pages once, and one page of its own each
    if cache:  # the shared pages were not looked up in the cache: no hit counted for them
        assert s.allocator.cache.hit_tokens == 0
    s.check_invariants()


@pytest.mark.parametrize("cache", [False, True])
def test_a_shared_page_is_freed_when_the_last_choice_ends(cache):
    s = scheduler(cache)
    reqs = choices(3, max_new=3)
    for r in reqs:
        s.add(r)
    ended = []
    while len(ended) < 3:
        _, finished = run_step(s)
        ended += finished
        if ended and len(ended) < 3:  # choice 0 (ahead by a step) ended, the others still hold the prompt
            assert reqs[0].finished and s.allocator.num_used >= 7
            assert all(s.allocator.holders(p) == {"r:n1", "r:n2"} for p in reqs[1].page_table.pages[:7])
    assert [r.rid for r in ended] == ["r", "r:n1", "r:n2"]
    assert s.allocator.num_used == 0
    if cache:  # the prompt's pages stay indexed, held by nobody
        assert s.allocator.num_free == 64
    s.check_invariants()


def test_a_choice_whose_parent_ended_or_was_preempted_starts_from_the_cache():
    s = scheduler(cache=False)
    parent, child = choices(2)
    parent.finish_reason = "abort"
    assert s.starting_pages(child) == [] and child.parent is None  # nothing cached: it computes all
    parent2, child2 = choices(2)
    s.add(parent2)
    s.schedule()
    assert s.starting_pages(child2) is None  # its parent's prompt is still being scheduled
    s.preempt(parent2)  # back to waiting: the choice does not wait for it
    assert s.starting_pages(child2) == [] and child2.parent is None


def test_a_choice_waits_while_its_parent_kv_is_arriving_on_a_decode_node():
    s = scheduler(cache=False)
    parent, child = choices(2)
    for phase in (Phase.PREALLOC, Phase.TRANSFERRING, Phase.RETRACTED, Phase.RESUMING):
        parent.phase = phase
        assert s.starting_pages(child) is None
    parent.page_table.pages = s.allocator.allocate("r", 8)
    parent.num_computed, parent.output_ids = 30, [9]  # transferred: it joins decoding as a prebuilt request
    s.add_prebuilt(parent)
    assert s.starting_pages(child) == parent.page_table.pages[:7]


def test_choice_params_seed_and_prompt_logprobs():
    p = SamplingParams(temperature=1.0, seed=(1 << 64) - 2, n=4, prompt_logprobs=2, logprobs=1)
    got = [(c.n, c.seed, c.prompt_logprobs, c.logprobs) for c in (p.choice(i) for i in range(4))]
    assert got == [(1, (1 << 64) - 2, 2, 1), (1, (1 << 64) - 1, None, 1), (1, 0, None, 1), (1, 1, None, 1)]
    assert SamplingParams(n=3).choice(2).seed is None
    for bad in (0, 17):
        with pytest.raises(ValueError, match=rf"n must be in \[1, 16\], got {bad}"):
            SamplingParams(n=bad)
