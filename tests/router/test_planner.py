"""The SLO planner's decisions (router/planner.py), figures in, a move or none out: which side needs
a node, patience, dwell, never a role emptied, never a donor side that queues; its latency window."""

from __future__ import annotations

import pytest

from kvbridge.router.planner import NodeView, Planner, Signals, Window, p90, queues_of
from kvbridge.v1 import admin_pb2

SLO = Planner(slo_ttft_s=0.5, slo_itl_s=0.05, patience=2, min_dwell_s=30.0)
FLEET = [NodeView("p1", "prefill"), NodeView("d1", "decode", outstanding=3), NodeView("d2", "decode", outstanding=1)]


def planner(**kw) -> Planner:
    return Planner(**({"slo_ttft_s": 0.5, "slo_itl_s": 0.05, "patience": 2, "min_dwell_s": 30.0} | kw))


@pytest.mark.parametrize(
    ("signals", "want"),
    [
        (Signals(0.9, 0.02, prefill_queue=4, decode_queue=0), ("prefill", "ttft")),  # prompts wait
        (Signals(0.9, 0.02, prefill_queue=0, decode_queue=3), ("decode", "ttft")),  # pages wait
        (Signals(0.9, 0.02, prefill_queue=0, decode_queue=0), None),  # slow, nothing queued: no node helps
        (Signals(0.54, 0.02, prefill_queue=9, decode_queue=0), None),  # within the 10 % margin
        (Signals(0.3, 0.08, prefill_queue=0, decode_queue=0), ("decode", "itl")),
        (Signals(None, None, prefill_queue=5, decode_queue=0), None),  # nothing relayed: nothing to judge
        (Signals(0.3, 0.04, prefill_queue=5, decode_queue=5), None),  # SLOs met: queues alone move nothing
    ],
)
def test_the_side_that_needs_a_node(signals, want):
    assert SLO.want(signals) == want


def test_a_move_needs_patience_and_takes_the_least_loaded_donor():
    plan = planner()
    short_of_prefill = Signals(0.9, 0.02, prefill_queue=4, decode_queue=0)
    assert plan.decide(short_of_prefill, FLEET, now=100) is None  # once: not yet
    move = plan.decide(short_of_prefill, FLEET, now=101)
    assert (move.address, move.old, move.role, move.reason) == ("d2", "decode", "prefill", "ttft")
    assert move.line() == (
        "d2 decode -> prefill (ttft over its SLO; ttft_p90_ms=900.0 itl_p90_ms=20.0 prefill_queue=4 decode_queue=0)"
    )
    assert plan.decide(short_of_prefill, FLEET, now=102) is None  # the next move needs its own run
    # a want that changes starts its run again
    short_of_decode = Signals(0.9, 0.02, prefill_queue=0, decode_queue=3)
    assert plan.decide(short_of_decode, FLEET, now=103) is None
    assert plan.decide(Signals(0.2, 0.01, 0, 0), FLEET, now=104) is None
    assert plan.decide(short_of_decode, FLEET, now=105) is None


def test_no_role_is_emptied_no_donor_too_fresh_or_fixed_and_only_a_move_that_evens_queues_out():
    short_of_decode = Signals(0.9, 0.02, prefill_queue=0, decode_queue=3)
    assert planner(patience=1).decide(short_of_decode, FLEET, now=0) is None  # p1 is the only prefill node
    fleet = [*FLEET, NodeView("p2", "prefill", switched_s=-10.0)]
    assert planner(patience=1).decide(short_of_decode, fleet, now=0).address == "p1"
    fresh = [NodeView("p1", "prefill", switched_s=-5.0), NodeView("p2", "prefill", elastic=False), *FLEET[1:]]
    plan = planner(patience=1)
    assert plan.decide(short_of_decode, fresh, now=0) is None  # p1 switched 5 s ago, p2 is fixed
    assert plan.decide(short_of_decode, fresh, now=25.1).address == "p1"  # its 30 s dwell is over
    # the fleet dwells too: no second move within 30 s of the last, whichever node
    assert plan.decide(short_of_decode, fleet, now=54.9) is None
    assert plan.decide(short_of_decode, fleet, now=55.1).address == "p1"
    down = [NodeView("p1", "prefill"), NodeView("p2", "prefill", healthy=False), *FLEET[1:]]
    assert planner(patience=1).decide(short_of_decode, down, now=0) is None  # p1: the last healthy prefill node
    # a move only where it evens the queues out: 2 P with 1 queued each would leave 2 on the one left,
    # no less than 3 queued on each of 2 D spread over 3 (2): no move; with 4 on each D (8/3): a move
    assert planner(patience=1).decide(Signals(0.9, 0.02, 1, 3), fleet, now=0) is None
    assert planner(patience=1).decide(Signals(0.9, 0.02, 1, 4), fleet, now=0).address == "p1"


def test_the_decode_queue_counts_in_the_share_of_pages_decoding_requests_hold():
    def status(**queues):
        return admin_pb2.Status(queues=queues)

    # prompts wait for prefill: the decode nodes' pages sit in transfer, their queue is not theirs
    waiting = [("prefill", status(waiting=6)), ("prefill", status(waiting=2))]
    stuck = [("decode", status(prealloc=10, transfer=9, running=1)), ("decode", status(prealloc=6, transfer=7))]
    assert queues_of(waiting + stuck) == (4.0, 16 * 1 / 17 / 2)
    # decoding holds the pages: the queue is the decode side's
    busy = [("decode", status(prealloc=5, retracted=1, running=12)), ("decode", status(prealloc=4, running=12))]
    assert queues_of(waiting + busy) == (4.0, 5.0)
    assert queues_of([]) == (0.0, 0.0)


def test_the_window_takes_the_p90_of_an_interval_and_keeps_a_bounded_sample():
    w = Window(cap=100, seed=1)
    for i in range(1, 11):
        w.add("ttft", i / 10)
    w.add("itl", 0.02)
    assert w.take() == (1.0, 0.02)  # 10 samples: the 9th of 0-based sorted ones
    assert w.take() == (None, None)  # emptied
    for i in range(10_000):
        w.add("itl", 0.001 * (i % 100))
    assert len(w.itl) == 100
    assert 0.07 <= w.take()[1] <= 0.099  # a uniform sample's p90 of 0..0.099
    assert p90([0.5]) == 0.5 and p90([]) is None
