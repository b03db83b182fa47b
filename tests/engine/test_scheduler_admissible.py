"""The role's say on waiting requests (`Scheduler.admissible`): a request it holds back keeps its
place in the queue while the ones behind it start; it is asked on every pass again; a request
preempted while its token was in flight still goes first (nothing is admitted past it)."""

from __future__ import annotations

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.pages import PageAllocator, PageTable
from kvbridge.engine.request import Request
from kvbridge.engine.scheduler import Scheduler

PS = 4


def scheduler() -> Scheduler:
    config = EngineConfig(model="tiny-random", page_size=PS, chunked_prefill_size=64, max_running_requests=16)
    return Scheduler(config, PageAllocator(64), max_context=256)


def request(rid: str) -> Request:
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    return Request(rid, list(range(3, 11)), params, PageTable(PS))


def scheduled(s: Scheduler) -> list[str]:
    step = s.schedule()
    assert step is not None
    return list(step.batch.rids)


def test_a_held_back_request_keeps_its_place_while_the_ones_behind_it_start():
    s = scheduler()
    asked: list[str] = []
    held = {"a", "c"}

    def admissible(req: Request) -> bool:
        asked.append(req.rid)
        return req.rid not in held

    s.admissible = admissible
    reqs = {rid: request(rid) for rid in "abcd"}
    for r in reqs.values():
        s.add(r)
    assert scheduled(s) == ["b", "d"]
    assert [r.rid for r in s.waiting] == ["a", "c"]  # in their order, unprefilled, holding no page
    assert reqs["a"].page_table.pages == [] and reqs["c"].page_table.pages == []
    assert s.passes == 1
    # asked again on the next pass: "c" is let in, "a" still waits first in line
    held.discard("c")
    asked.clear()
    assert "c" in scheduled(s)
    assert asked == ["a", "c", "a"]  # (and "a" again for the next free place)
    assert [r.rid for r in s.waiting] == ["a"]
    held.clear()
    assert "a" in scheduled(s)
    assert list(s.waiting) == []
    assert s.passes == 3
    s.check_invariants()


def test_without_a_say_every_waiting_request_starts_in_order():
    s = scheduler()
    for rid in "xyz":
        s.add(request(rid))
    assert scheduled(s) == ["x", "y", "z"]


def test_a_request_awaiting_its_token_blocks_admission_behind_it():
    s = scheduler()
    first, second = request("p"), request("q")
    first.awaiting_output = True  # preempted while its sampled token was still in flight
    s.waiting.append(first)
    s.add(second)
    s.admissible = lambda req: True
    assert s.schedule() is None  # nothing runs, and "q" does not jump ahead of "p"
    assert [r.rid for r in s.waiting] == ["p", "q"]
