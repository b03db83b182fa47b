"""Local prefill (router/local_prefill.py): the rule on exact inputs, its flags, and the router's
choice over fake nodes: while the prefill node holds a long prompt, a short one goes to the decode
node alone (a signed local route, no prefill call), counted by decision and reason; a long one still
goes to the prefill node; with the flag off nothing goes local. The real nodes' side (the decode node
computes the prompt, the tokens of the P->D path) is tests/nodes/test_local_prefill.py."""

from __future__ import annotations

import threading

import pytest

from kvbridge.common import rpc
from kvbridge.common.security import message_proof_ok
from kvbridge.router.config import RouterConfig
from kvbridge.router.local_prefill import REASONS, Decision, LocalPrefill
from kvbridge.v1 import admin_pb2, admin_pb2_grpc
from tests.router.fakes import generate, make_request, router_stub, wait_until

RULE = LocalPrefill(max_tokens=64, ratio=4.0)


@pytest.mark.parametrize(
    "uncached, prefill, decode, logprobs, expected",
    [
        (10, 41, 0, False, Decision(True, "prefill_queue")),  # 41 > 4 x (0 + 10)
        (10, 40, 0, False, Decision(False, "short_queue")),  # 40 is not above 4 x 10
        (10, 0, 0, False, Decision(False, "short_queue")),  # an idle prefill node always gets it
        (0, 1, 0, False, Decision(True, "prefill_queue")),  # all cached on D: any prefill queue is longer
        (10, 120, 20, False, Decision(False, "short_queue")),  # 120 is not above 4 x (20 + 10)
        (10, 121, 20, False, Decision(True, "prefill_queue")),
        (64, 10_000, 0, False, Decision(True, "prefill_queue")),  # at the limit
        (65, 10_000, 0, False, Decision(False, "long_prompt")),  # past it, however long the queue
        (10, None, 0, False, Decision(False, "no_prefill_node")),
        (None, 10_000, 0, False, Decision(False, "unknown_length")),
        (10, 10_000, 0, True, Decision(False, "prompt_logprobs")),  # the prefill node computes those
    ],
)
def test_the_rule_on_exact_inputs(uncached, prefill, decode, logprobs, expected):
    assert RULE.decide(uncached, prefill, decode, logprobs) == expected
    assert expected.reason in REASONS
    assert expected.label == ("local" if expected.local else "prefill")


def test_the_ratio_and_the_limit_are_the_flags_and_zero_turns_it_off():
    assert RouterConfig().local_prefill == LocalPrefill(512, 4.0)
    assert RouterConfig().local_prefill.enabled
    assert not RouterConfig(local_prefill_max_tokens=0).local_prefill.enabled
    config = RouterConfig(local_prefill_max_tokens=32, local_prefill_ratio=1.5)
    assert config.local_prefill == LocalPrefill(32, 1.5)
    assert LocalPrefill(32, 1.5).decide(10, 63, 32, False) == Decision(False, "short_queue")  # 63 = 1.5 x (32 + 10)
    assert LocalPrefill(32, 1.5).decide(10, 64, 32, False) == Decision(True, "prefill_queue")  # 64 > 63
    assert not RouterConfig(local_prefill_max_tokens=0).local_prefill.enabled
    for bad in ({"local_prefill_max_tokens": -1}, {"local_prefill_ratio": 0}, {"local_prefill_ratio": float("nan")}):
        with pytest.raises(ValueError, match="local_prefill"):
            RouterConfig(**bad)


def local_decisions(router) -> dict[tuple[str, str], float]:
    samples = router.dispatcher.metrics.local_prefill.collect()[0].samples
    return {(s.labels["decision"], s.labels["reason"]): s.value for s in samples if s.name.endswith("_total")}


def counted(router, series: str, label: str) -> dict[str, float]:
    samples = getattr(router.dispatcher.metrics, series).collect()[0].samples
    return {s.labels[label]: s.value for s in samples if s.name.endswith("_total") and s.value}


def indexed_fleet(fleet, max_tokens: int):
    """A router over one fake P and one fake D that serve KV events, once both are indexed: the router
    counts a prompt's tokens in the queue of the node that computes it (cache_aware's accounting)."""
    router, nodes = fleet(prefill=1, decode=1, kv_events=True, router={"local_prefill_max_tokens": max_tokens})
    assert wait_until(lambda: all(n.blocks.synced for n in router.pool.nodes))
    return router, nodes


def hold_long_prompt(router, p, length: int = 40):
    """A request of `length` prompt tokens held at the prefill node (its Prefill call blocks): the
    router counts its tokens in the prefill node's queue until it is released. Returns (thread, out)."""
    p.hold = threading.Event()
    out: list = []
    thread = threading.Thread(target=lambda: out.append(generate(router, ids=list(range(1, length + 1)))))
    thread.start()
    assert wait_until(lambda: len(p.requests) == 1)
    return thread, out


def release(p, thread) -> None:
    p.hold.set()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_short_prompt_goes_to_the_decode_node_while_the_prefill_node_holds_a_long_one(fleet):
    router, nodes = indexed_fleet(fleet, 8)
    [p], [d] = nodes["prefill"], nodes["decode"]
    # the prefill node idle: a short prompt is the prefill node's (its queue, 0, is not longer)
    assert generate(router, ids=(1, 2, 3))[-1].finish_reason == "length"
    assert local_decisions(router) == {("prefill", "short_queue"): 1}
    assert len(p.requests) == 1 and d.requests[-1].prefill.room > 0
    p.requests.clear()

    thread, out = hold_long_prompt(router, p)  # 40 tokens: past the limit of 8, the prefill node's
    assert local_decisions(router) == {("prefill", "short_queue"): 1, ("prefill", "long_prompt"): 1}
    short = generate(router, ids=(1, 2, 3))  # 40 queued > 4 x 3: the decode node computes it
    assert short[-1].finish_reason == "length" and [t for r in short for t in r.token_ids] == [100, 101, 102, 103]
    route, rid = d.requests[-1].prefill, d.requests[-1].rid
    assert (route.local, route.room, route.prefill_addr) == (True, 0, "")
    assert message_proof_ok(rpc.security().fleet(), route, rid.encode())  # signed by the router, over the rid
    assert len(p.requests) == 1  # the prefill node never saw it
    assert local_decisions(router)[("local", "prefill_queue")] == 1
    assert counted(router, "pd_decisions", "outcome") == {"disaggregated": 2, "local": 1}
    assert counted(router, "prompt_tokens", "computed_by") == {"prefill": 43, "decode": 3}
    # its tokens left the decode node's queue at its first response; the held prompt's are still queued
    assert wait_until(lambda: {n.role: n.pending_tokens for n in router.pool.nodes} == {"prefill": 40, "decode": 0})

    # a prompt past the limit still goes to the prefill node, however long its queue
    medium = threading.Thread(target=lambda: generate(router, ids=list(range(1, 10))))
    medium.start()
    assert wait_until(lambda: len(p.requests) == 2)
    assert local_decisions(router)[("prefill", "long_prompt")] == 2
    release(p, thread)
    medium.join(timeout=30)
    assert out and out[0][-1].finish_reason == "length"
    assert wait_until(lambda: all(n.pending_tokens == 0 and n.outstanding == 0 for n in router.pool.nodes))


def test_the_decode_nodes_own_queue_counts_against_going_local(fleet):
    router, nodes = indexed_fleet(fleet, 8)
    [p], [d] = nodes["prefill"], nodes["decode"]
    thread, _ = hold_long_prompt(router, p, length=40)
    d.stall_after = 0  # the decode node sends nothing: a local prompt stays in its queue
    stalled = router_stub(router).Generate(make_request(ids=(1, 2, 3, 4, 5, 6, 7, 8)), timeout=30)
    assert wait_until(lambda: len(d.requests) == 2 and d.requests[-1].prefill.local)
    assert {n.role: n.pending_tokens for n in router.pool.nodes} == {"prefill": 40, "decode": 8}
    admin = admin_pb2_grpc.AdminStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
    [listed] = admin.ListRequests(admin_pb2.ListRequestsRequest(phase="local_prefill"), timeout=5).requests
    assert (listed.rid, listed.peer, listed.room, listed.prompt_tokens) == (d.requests[-1].rid, d.address, 0, 8)
    d.stall_after = None
    # 40 queued is not above 4 x (8 + 3): this one goes to the prefill node (held behind the first)
    third = threading.Thread(target=lambda: generate(router, ids=(1, 2, 3)))
    third.start()
    assert wait_until(lambda: len(p.requests) == 2)
    assert local_decisions(router) == {
        ("prefill", "long_prompt"): 1, ("local", "prefill_queue"): 1, ("prefill", "short_queue"): 1
    }  # fmt: skip
    stalled.cancel()
    release(p, thread)
    third.join(timeout=30)
    assert wait_until(lambda: all(n.pending_tokens == 0 and n.outstanding == 0 for n in router.pool.nodes))


def test_with_the_flag_off_nothing_goes_local(fleet):
    router, nodes = indexed_fleet(fleet, 0)
    [p], [d] = nodes["prefill"], nodes["decode"]
    thread, _ = hold_long_prompt(router, p)
    short = threading.Thread(target=lambda: generate(router, ids=(1, 2, 3)))
    short.start()
    assert wait_until(lambda: len(p.requests) == 2)  # behind the held one, at the prefill node
    assert not any(r.prefill.local for r in d.requests)
    release(p, thread)
    short.join(timeout=30)
    assert local_decisions(router) == {}  # off: no decision is made, none counted
    assert counted(router, "pd_decisions", "outcome") == {"disaggregated": 2}
