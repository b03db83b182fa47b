"""n > 1 in the scheduler: choices i > 0 wait beside choice 0 (`forks`) until its prompt is scheduled
(or, on a decode node, arrived), then join the running requests at once sharing its full prompt
pages, cache or no cache; each computes only the prompt's last partial page (its own: it writes its
own tokens there); a shared page is freed when the last choice holding it ends; a choice whose
choice 0 ends or is preempted first is admitted as any request."""

from __future__ import annotations

import pytest

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.pages import PageAllocator, PageTable
from kvbridge.engine.prefix_cache import PrefixCache
from kvbridge.engine.request import Phase, Request
from kvbridge.engine.scheduler import Scheduler

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
    # chunks of 16: choice 0's prompt takes two steps; the others wait beside it
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


def test_a_choice_whose_parent_ends_or_is_preempted_before_its_prompt_is_in_waits_as_any_request():
    s = scheduler(cache=False)
    parent, child = choices(2)
    s.add(parent)
    s.add(child)
    assert s.forked() == [child] and list(s.waiting) == [parent]
    s.schedule()  # choice 0's first chunk (16 of 30)
    s.preempt(parent)  # back to waiting, its prompt not in: its choice no longer waits for it
    assert s.forked() == [] and child.parent is None and list(s.waiting) == [parent, child]
    s.check_invariants()
    p2, c2 = choices(2)
    s2 = scheduler(cache=False)
    s2.add(p2)
    s2.add(c2)
    s2.finish(p2, "abort")
    assert s2.forked() == [] and list(s2.waiting) == [c2] and c2.parent is None
    p3, c3 = choices(2)
    s3 = scheduler(cache=False)
    s3.add(p3)
    s3.add(c3)
    s3.finish(c3, "abort")  # a choice aborted while it waited
    assert s3.forks == {} and list(s3.waiting) == [p3]


def test_choice_0_ending_at_its_first_token_leaves_its_choices_the_prompt():
    s = scheduler(cache=False)
    reqs = choices(3, max_new=1)
    for r in reqs:
        s.add(r)
    s.schedule()
    step = s.schedule()  # choice 0's last chunk: its choices join at once, holding the shared pages
    assert [r.rid for r in s.running] == ["r", "r:n1", "r:n2"]
    assert s.postprocess(step, [5]) == [reqs[0]]  # choice 0 ends with its first token
    step = s.schedule()
    assert list(zip(step.batch.rids, step.batch.starts, step.batch.q_lens)) == [("r:n1", 28, 2), ("r:n2", 28, 2)]
    assert s.allocator.num_used == 7 + 2  # the prompt's pages live on in the choices


def test_on_a_decode_node_choices_fork_when_choice_0_arrives():
    """Choice 0 is preallocated and receives its KV outside the scheduler; its choices wait (holding
    nothing, past no cap) and join when it does, whatever else runs."""
    config = EngineConfig(model="tiny-random", page_size=PS, chunked_prefill_size=16, max_running_requests=1)
    s = Scheduler(config, PageAllocator(64), max_context=256, evict="retract")
    other = Request("busy", [5, 6, 7], SamplingParams(max_new_tokens=50), PageTable(PS))
    s.add(other)
    s.schedule()  # the one running slot is taken
    parent, child = choices(2)
    parent.phase = Phase.PREALLOC
    s.add(child)
    assert s.forked() == [child]
    parent.page_table.pages = s.allocator.allocate("r", 8)
    parent.num_computed, parent.output_ids = 30, [9]  # its KV and first token arrived
    s.add_prebuilt(parent)
    assert s.forked() == [] and child in s.running and child.page_table.pages[:7] == parent.page_table.pages[:7]
    s.check_invariants()


def test_choice_params_seed_and_prompt_logprobs():
    p = SamplingParams(temperature=1.0, seed=(1 << 64) - 2, n=4, prompt_logprobs=2, logprobs=1)
    got = [(c.n, c.seed, c.prompt_logprobs, c.logprobs) for c in (p.choice(i) for i in range(4))]
    assert got == [(1, (1 << 64) - 2, 2, 1), (1, (1 << 64) - 1, None, 1), (1, 0, None, 1), (1, 1, None, 1)]
    assert SamplingParams(n=3).choice(2).seed is None
    for bad in (0, 17):
        with pytest.raises(ValueError, match=rf"n must be in \[1, 16\], got {bad}"):
            SamplingParams(n=bad)


def test_a_choice_added_after_its_prompt_is_in_joins_at_once_and_one_of_an_ended_choice_0_waits():
    s = scheduler(cache=False)
    parent, late = choices(2)
    s.add(parent)
    s.schedule()
    s.schedule()  # choice 0's prompt is in
    s.add(late)
    assert late in s.running and late.page_table.pages[:7] == parent.page_table.pages[:7] and not s.forks
    ended, orphan = choices(2)
    ended.finish_reason, orphan.rid = "abort", "o:n1"
    s.add(orphan)
    assert list(s.waiting) == [orphan] and orphan.parent is None
    s.check_invariants()
