"""Proof that disaggregation happened, or did not: kvbridge_router_pd_decisions_total{outcome}
counts each attempt as disaggregated (a prefill and a decode node), colocated (a colocated node
chosen) or fallback (a colocated node because no prefill node could take it: a fleet quietly
serving without its prefill nodes shows here)."""

from __future__ import annotations

import time

from tests.router.test_router_tokenize import call

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def decisions(router) -> dict[str, float]:
    samples = router.dispatcher.metrics.pd_decisions.collect()[0].samples
    return {s.labels["outcome"]: s.value for s in samples if s.name.endswith("_total")}


def prompt_tokens(router) -> dict[str, float]:
    samples = router.dispatcher.metrics.prompt_tokens.collect()[0].samples
    return {s.labels["computed_by"]: s.value for s in samples if s.name.endswith("_total")}


def test_pairs_count_as_disaggregated(fleet):
    router, _ = fleet(prefill=1, decode=1)
    assert decisions(router) == {"disaggregated": 0, "colocated": 0, "fallback": 0}  # exported from the start
    assert prompt_tokens(router) == {"prefill": 0, "colocated": 0}
    used = [call(router, "POST", "/v1/chat/completions", BODY) for _ in range(3)]
    assert [status for status, _ in used] == [200] * 3
    assert decisions(router) == {"disaggregated": 3, "colocated": 0, "fallback": 0}
    assert prompt_tokens(router) == {"prefill": sum(body["usage"]["prompt_tokens"] for _, body in used), "colocated": 0}


def test_a_colocated_fleet_counts_as_colocated(fleet):
    router, _ = fleet(colocated=1)
    for _ in range(2):
        assert call(router, "POST", "/v1/chat/completions", BODY)[0] == 200
    assert decisions(router) == {"disaggregated": 0, "colocated": 2, "fallback": 0}


def test_serving_without_the_prefill_fleet_counts_as_fallback(fleet):
    router, nodes = fleet(colocated=1, prefill=1, decode=1)
    nodes["prefill"][0].stop()
    deadline = time.monotonic() + 30
    while router.dispatcher.pool.has_eligible("prefill"):
        assert time.monotonic() < deadline, "the router never saw the prefill node go"
        time.sleep(0.05)
    used = [call(router, "POST", "/v1/chat/completions", BODY) for _ in range(2)]
    assert [status for status, _ in used] == [200] * 2
    assert decisions(router) == {"disaggregated": 0, "colocated": 0, "fallback": 2}
    # the prompts computed on the colocated node while the prefill fleet was gone
    assert prompt_tokens(router) == {"prefill": 0, "colocated": sum(body["usage"]["prompt_tokens"] for _, body in used)}
