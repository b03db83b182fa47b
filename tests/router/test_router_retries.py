"""The router's reliability against in-test nodes that fail on cue: which failures are retried and
where, how many times and how far apart, what the client is told when nothing is left, and the
router's own timeouts (no first token; a stream gone quiet)."""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import fields
from itertools import pairwise

import grpc
import pytest

from kvbridge.router import routed
from kvbridge.router.cli import config_from_args
from kvbridge.router.config import RouterConfig
from tests.router.fakes import generate, make_request, router_stub, wait_until

UNAVAILABLE, EXHAUSTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
# The router's own timeouts where an attempt on a healthy in-test node must beat them: the node answers
# in milliseconds, this leaves a loaded 2-core host its pauses (the node that never answers takes 30 s).
FIRST_TOKEN_S = 1.0
IDLE_S = 1.0


def retries(router) -> dict[str, float]:
    registry = router.dispatcher.metrics.registry
    reasons = ("unavailable", "resource_exhausted", "deadline_exceeded")
    counts = {r: registry.get_sample_value("kvbridge_router_retries_total", {"reason": r}) for r in reasons}
    return {r: n for r, n in counts.items() if n}


def timeouts(router) -> dict[str, float]:
    registry = router.dispatcher.metrics.registry
    counts = {t: registry.get_sample_value("kvbridge_router_timeouts_total", {"timeout": t}) for t in TIMEOUTS}
    return {t: n for t, n in counts.items() if n}


TIMEOUTS = ("first_token", "idle_stream")


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def failure(router, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        generate(router, **kw)
    return err.value


def idle(router) -> bool:
    return router.dispatcher.num_in_flight() == 0 and set(router.pool.outstanding().values()) == {0}


# ---------------------------------------------------------------- which failures, where, how often


def test_a_full_node_is_retried_on_another_with_a_fresh_upstream_rid(fleet):
    router, nodes = fleet(colocated=2)
    a, b = nodes["colocated"]
    a.fail = EXHAUSTED  # the first pick
    request = make_request()
    request.rid = "full-1"
    assert tokens_of(router_stub(router).Generate(request, timeout=30)) == [100, 101, 102, 103]
    assert [r.rid for r in a.requests] == ["full-1"] and [r.rid for r in b.requests] == ["full-1:retry1"]
    assert retries(router) == {"resource_exhausted": 1}


def test_attempts_are_bounded_and_the_client_gets_the_last_status(fleet):
    router, nodes = fleet(colocated=4, router={"max_attempts": 3})
    for node in nodes["colocated"]:
        node.fail = UNAVAILABLE
    err = failure(router)
    tried = [n for n in nodes["colocated"] if n.requests]
    assert [len(n.requests) for n in tried] == [1, 1, 1]  # three nodes, once each; the fourth never asked
    last = max(tried, key=lambda n: n.arrived[0])
    assert (err.code(), err.details()) == (UNAVAILABLE, f"{last.address} fails as told (from colocated/{last.address})")
    assert retries(router) == {"unavailable": 2}
    assert wait_until(lambda: idle(router))


def test_resource_exhausted_everywhere_reaches_the_client_as_resource_exhausted(fleet):
    router, nodes = fleet(colocated=2)
    for node in nodes["colocated"]:
        node.fail = EXHAUSTED
    err = failure(router)
    assert err.code() == EXHAUSTED and "fails as told" in err.details()
    assert [len(n.requests) for n in nodes["colocated"]] == [1, 1]
    assert retries(router) == {"resource_exhausted": 1}


def test_other_failures_are_not_retried(fleet):
    router, nodes = fleet(colocated=2)
    for node in nodes["colocated"]:
        node.fail = grpc.StatusCode.INTERNAL
    assert failure(router).code() == grpc.StatusCode.INTERNAL
    assert sum(len(n.requests) for n in nodes["colocated"]) == 1 and retries(router) == {}


def test_retries_back_off_doubling_up_to_the_cap(fleet):
    router, nodes = fleet(colocated=4, router={"retry_backoff_s": 0.5, "max_attempts": 4})
    for node in nodes["colocated"]:
        node.fail = UNAVAILABLE
    assert failure(router).code() == UNAVAILABLE
    arrived = sorted(t for n in nodes["colocated"] for t in n.arrived)
    gaps = [b - a for a, b in pairwise(arrived)]
    assert len(gaps) == 3
    # 0.5 s, 1 s, then 2 s capped to 1 s; each gap is its pause plus a round trip (at the upper bounds: the
    # first pause of a backoff doubled once too often, the third of one not capped)
    assert 0.5 <= gaps[0] < 1.0 and 1.0 <= gaps[1] < 2.0 and 1.0 <= gaps[2] < 2.0, gaps


def test_a_node_timeout_is_retried_but_the_requests_own_deadline_is_not(fleet):
    router, nodes = fleet(colocated=2)
    a, b = nodes["colocated"]
    a.fail = DEADLINE  # a node's own timeout (bootstrap, transfer): another node may do better
    assert len(generate(router)) == 5
    assert (len(a.requests), len(b.requests)) == (1, 1) and retries(router) == {"deadline_exceeded": 1}

    slow, _ = fleet(colocated=2, first_s=5.0, router={"request_timeout_s": 0.5, "first_token_timeout_s": 0})
    assert failure(slow).code() == DEADLINE  # the request's deadline passed on the first node: not retried
    assert retries(slow) == {}
    assert wait_until(lambda: idle(slow))


def migrations(router) -> dict[str, float]:
    samples = router.dispatcher.metrics.migrations.collect()[0].samples
    return {s.labels["reason"]: s.value for s in samples if s.name.endswith("_total") and s.value}


def read(call) -> tuple[list[int], str, grpc.RpcError | None]:
    """A call's token ids and text, and its error (None: it completed)."""
    got, text = [], ""
    try:
        for resp in call:
            got += resp.token_ids
            text += resp.text
    except grpc.RpcError as e:
        return got, text, e
    return got, text, None


def test_a_failure_after_the_first_token_moves_the_stream_to_another_node(fleet):
    router, nodes = fleet(colocated=2)
    for node in nodes["colocated"]:
        node.fail, node.fail_after = UNAVAILABLE, 2
    nodes["colocated"][1].fail = None  # (whichever gets it first, the other completes it)
    got, text, error = read(router_stub(router).Generate(make_request(), timeout=30))
    assert (got, text, error) == ([100, 101, 102, 103], "t0 t1 t2 t3 ", None)  # nothing twice, nothing missing
    first, second = sorted(nodes["colocated"], key=lambda n: n.arrived[0] if n.arrived else 1e18)
    assert [list(r.resume_ids) for r in first.requests + second.requests] == [[], [100, 101]]
    assert second.requests[0].rid == first.requests[0].rid + ":retry1"
    assert migrations(router) == {"unavailable": 1} and retries(router) == {}


def test_a_stream_that_cannot_move_ends_with_the_status_and_why(fleet):
    router, nodes = fleet(colocated=2)
    for node in nodes["colocated"]:
        node.fail, node.fail_after = UNAVAILABLE, 2
    got, _, error = read(router_stub(router).Generate(make_request(), timeout=30))
    assert got == [100, 101] and error.code() == UNAVAILABLE
    assert error.details().endswith("after 2 tokens, not migrated: no other healthy node pair can take it over")
    assert [len(n.requests) for n in nodes["colocated"]] == [1, 1]  # moved once; the second failed at once too
    assert migrations(router) == {"unavailable": 1}


def test_migrations_are_bounded(fleet):
    router, nodes = fleet(colocated=3, router={"max_migrations": 1})
    for node in nodes["colocated"]:
        node.fail, node.fail_after = UNAVAILABLE, 1  # at token 1: the node it moves to fails at once
    got, _, error = read(router_stub(router).Generate(make_request(), timeout=30))
    assert got == [100] and error.code() == UNAVAILABLE
    why = "after 1 tokens, not migrated: it was migrated 1 times already (--max-migrations 1)"
    assert error.details().endswith(why)
    assert sorted(len(n.requests) for n in nodes["colocated"]) == [0, 1, 1]


def test_max_migrations_0_ends_the_stream_at_the_failure(fleet):
    router, nodes = fleet(colocated=2, router={"max_migrations": 0})
    nodes["colocated"][0].fail = nodes["colocated"][1].fail = UNAVAILABLE
    nodes["colocated"][0].fail_after = nodes["colocated"][1].fail_after = 2
    got, _, error = read(router_stub(router).Generate(make_request(), timeout=30))
    assert got == [100, 101] and "not migrated: it was migrated 0 times already" in error.details()
    assert sum(len(n.requests) for n in nodes["colocated"]) == 1 and migrations(router) == {}


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION]
)
def test_an_abort_or_a_failure_another_node_would_repeat_is_not_migrated(fleet, code):
    router, nodes = fleet(colocated=2)
    for node in nodes["colocated"]:
        node.fail, node.fail_after = code, 2
    got, _, error = read(router_stub(router).Generate(make_request(), timeout=30))
    assert got == [100, 101] and error.code() == code and "not migrated" not in error.details()
    assert sum(len(n.requests) for n in nodes["colocated"]) == 1 and migrations(router) == {}


def test_a_disaggregated_stream_moves_to_another_decode_node_and_prefills_its_tokens_again(fleet):
    router, nodes = fleet(prefill=1, decode=2, router={"routing": "round_robin"})
    d1, d2 = nodes["decode"]
    d1.fail, d1.fail_after = UNAVAILABLE, 3
    assert read(router_stub(router).Generate(make_request(max_new_tokens=6), timeout=30))[::2] == (
        [100, 101, 102, 103, 104, 105],
        None,
    )
    [p] = nodes["prefill"]
    assert [list(r.resume_ids) for r in p.requests] == [[], [100, 101, 102]]  # the new P computes them
    assert [list(r.resume_ids) for r in d2.requests] == [[100, 101, 102]]
    assert [r.prefill.room for r in d2.requests] == [p.requests[1].room] and p.requests[1].room != p.requests[0].room


def test_an_unseeded_sampled_request_gets_a_seed_of_its_own_so_that_it_can_move(fleet):
    router, nodes = fleet(colocated=1)
    [node] = nodes["colocated"]
    generate(router, temperature=0.7)
    generate(router, temperature=0.7, seed=5)
    generate(router)  # greedy: no seed needed
    seeds = [r.sampling.seed if r.sampling.HasField("seed") else None for r in node.requests]
    assert seeds[0] is not None and seeds[1:] == [5, None]


def test_a_full_decode_node_is_left_out_and_the_prefill_node_paired_again(fleet):
    router, nodes = fleet(prefill=1, decode=2)
    [p], (d1, d2) = nodes["prefill"], nodes["decode"]
    d1.fail = EXHAUSTED
    assert tokens_of(generate(router)) == [100, 101, 102, 103]
    [first], [second] = d1.requests, d2.requests
    assert second.rid == first.rid + ":retry1" and second.prefill.room != first.prefill.room
    assert [(r.rid, r.room) for r in p.requests] == [(first.rid, first.prefill.room), (second.rid, second.prefill.room)]
    assert retries(router) == {"resource_exhausted": 1}


def test_a_prefill_node_failing_after_the_decode_node_answered_does_not_end_the_stream(fleet):
    router, nodes = fleet(prefill=1, decode=1, tokens=40, token_s=0.05)
    [p] = nodes["prefill"]
    p.fail, p.fail_late_s = UNAVAILABLE, 1.0  # D streams from 0.05 s to 2 s at least; P's call fails at 1 s
    assert tokens_of(generate(router)) == list(range(100, 140))
    assert retries(router) == {}


def test_a_client_cancel_during_the_backoff_ends_the_request_at_once(fleet, monkeypatch):
    monkeypatch.setattr(routed, "RETRY_BACKOFF_CAP_S", 60.0)  # (the 1 s cap would end the pause about as soon)
    router, nodes = fleet(colocated=2, timeout_s=120, router={"retry_backoff_s": 60.0})
    a, b = nodes["colocated"]
    a.fail = UNAVAILABLE
    call = router_stub(router).Generate(make_request(), timeout=120)
    assert wait_until(lambda: retries(router) == {"unavailable": 1})  # counted as the 60 s pause starts
    call.cancel()
    assert wait_until(lambda: router.dispatcher.num_in_flight() == 0, timeout=30)  # not at the pause's end
    assert b.requests == []


# ---------------------------------------------------------------- the router's timeouts


def test_no_first_token_in_time_cancels_the_attempt_and_retries_elsewhere(fleet):
    router, nodes = fleet(colocated=2, router={"first_token_timeout_s": FIRST_TOKEN_S})
    a, b = nodes["colocated"]
    a.first_s = 30.0  # the first pick never answers
    t0 = time.monotonic()
    assert tokens_of(generate(router)) == [100, 101, 102, 103]
    assert FIRST_TOKEN_S <= time.monotonic() - t0 < 10.0  # cut at the timeout, not at a's 30 s
    assert wait_until(lambda: a.requests[0].rid in a.cancelled) and len(b.requests) == 1
    assert timeouts(router) == {"first_token": 1} and retries(router) == {"deadline_exceeded": 1}


def test_no_first_token_on_any_attempt_is_deadline_exceeded(fleet):
    router, nodes = fleet(colocated=2, first_s=30.0, router={"first_token_timeout_s": 0.3, "max_attempts": 2})
    err = failure(router)
    last = max(nodes["colocated"], key=lambda n: n.arrived[0])
    assert (err.code(), err.details()) == (DEADLINE, f"no first token within 0.3 s (from colocated/{last.address})")
    assert timeouts(router) == {"first_token": 2} and retries(router) == {"deadline_exceeded": 1}
    assert wait_until(lambda: all(n.requests[0].rid in n.cancelled for n in nodes["colocated"]))
    assert wait_until(lambda: idle(router))


def test_no_first_token_blames_the_prefill_node_while_its_call_runs(fleet):
    router, nodes = fleet(prefill=2, decode=1, router={"first_token_timeout_s": FIRST_TOKEN_S})
    (p1, p2), [d] = nodes["prefill"], nodes["decode"]
    p1.hold = threading.Event()  # the first pick prefills forever
    assert tokens_of(generate(router)) == [100, 101, 102, 103]
    assert [len(p1.requests), len(p2.requests), len(d.requests)] == [1, 1, 2]  # the same decode node, again
    assert wait_until(lambda: p1.requests[0].rid in p1.cancelled and d.requests[0].rid in d.cancelled)
    assert timeouts(router) == {"first_token": 1}


def test_no_first_token_blames_the_decode_node_once_the_prefill_returned(fleet):
    router, nodes = fleet(prefill=1, decode=2, router={"first_token_timeout_s": FIRST_TOKEN_S})
    [p], (d1, d2) = nodes["prefill"], nodes["decode"]
    d1.first_s = 30.0  # the prefill node returns at once; the first decode node never answers
    assert tokens_of(generate(router)) == [100, 101, 102, 103]
    assert [len(p.requests), len(d1.requests), len(d2.requests)] == [2, 1, 1]
    assert timeouts(router) == {"first_token": 1}


def test_a_stream_quiet_for_too_long_after_its_first_token_moves_then_is_deadline_exceeded(fleet):
    router, nodes = fleet(colocated=2, router={"idle_stream_timeout_s": IDLE_S, "first_token_timeout_s": FIRST_TOKEN_S})
    for node in nodes["colocated"]:
        node.stall_after = 2  # each node stalls at its token 2: the one it moves to at once
    t0 = time.monotonic()
    got, _, error = read(router_stub(router).Generate(make_request(), timeout=30))
    last = max(nodes["colocated"], key=lambda n: n.arrived[0])
    assert got == [100, 101]
    assert (error.code(), error.details()) == (
        DEADLINE,
        f"no first token within {FIRST_TOKEN_S:g} s (from colocated/{last.address}); after 2 tokens, not migrated: "
        "no other healthy node pair can take it over",
    )
    assert IDLE_S + FIRST_TOKEN_S <= time.monotonic() - t0 < 20.0  # cut by both timeouts, not the 30 s deadline
    assert all(wait_until(lambda n=n: n.requests[0].rid in n.cancelled) for n in nodes["colocated"])
    assert timeouts(router) == {"idle_stream": 1, "first_token": 1}
    assert migrations(router) == {"idle_stream": 1} and retries(router) == {}


def test_timeouts_off_leave_a_slow_stream_alone(fleet):
    router, _ = fleet(
        colocated=1, tokens=4, token_s=0.2, first_s=0.4, router={"first_token_timeout_s": 0, "idle_stream_timeout_s": 0}
    )
    assert tokens_of(generate(router)) == [100, 101, 102, 103]
    assert timeouts(router) == {}


def test_timeouts_longer_than_the_gaps_leave_a_slow_stream_alone(fleet):
    router, _ = fleet(
        colocated=1,
        tokens=4,
        token_s=0.2,
        first_s=0.4,
        router={"first_token_timeout_s": 10, "idle_stream_timeout_s": 10},
    )
    assert tokens_of(generate(router)) == [100, 101, 102, 103]
    assert timeouts(router) == {}


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("max_attempts", "0", "--max-attempts must be >= 1, got 0"),
        ("max_migrations", "-1", "--max-migrations must be >= 0, got -1"),
        ("retry_backoff_s", "-1", "--retry-backoff-s must be >= 0 and finite, got -1.0"),
        ("first_token_timeout_s", "nan", "--first-token-timeout-s must be >= 0 and finite, got nan"),
        ("idle_stream_timeout_s", "inf", "--idle-stream-timeout-s must be >= 0 and finite, got inf"),
    ],
)
def test_bad_reliability_flags_name_the_flag_and_value(flag, value, message):
    flags = {
        f.name: ",".join(f.default) if isinstance(f.default, tuple) else str(f.default) for f in fields(RouterConfig)
    }
    args = argparse.Namespace(**(flags | {flag: value}))
    with pytest.raises(ValueError) as err:
        config_from_args(args)
    assert str(err.value) == message


def test_reliability_defaults():
    c = RouterConfig()
    assert (c.max_attempts, c.retry_backoff_s, c.first_token_timeout_s, c.idle_stream_timeout_s) == (3, 0.05, 300, 30)
    assert c.max_migrations == 3
