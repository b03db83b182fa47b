"""Routing policies (router/policy.py) on hand-built nodes, and the pool's pick and pending-token
accounting over them, without any server."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from kvbridge.common.blocks import block_hashes
from kvbridge.router.config import RouterConfig
from kvbridge.router.kv_index import STORED, Batch, Event
from kvbridge.router.policy import Policy
from kvbridge.router.pool import NodePool
from kvbridge.router.prompts import PromptBlocks


@dataclass
class N:
    role: str = "prefill"
    outstanding: int = 0
    pending_tokens: int = 0


def choose(policy: Policy, nodes, turn=0, tokens=100, cached=None):
    c = policy.choose(nodes, turn, tokens, cached)
    return c.index, c.reason, c.tokens


CACHE = Policy("cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.5)


def test_a_prefix_hit_beats_a_less_loaded_node_without_one():
    # cost = 100 - 64 + 0 = 36 against 100 - 0 + 0 = 100
    assert choose(CACHE, [N(outstanding=1), N()], cached=[64, 0]) == (0, "prefix_hit", 36)


def test_pending_tokens_outweigh_a_hit():
    # cost = 100 - 64 + 80 = 116 against 100
    assert choose(CACHE, [N(pending_tokens=80), N()], cached=[64, 0]) == (1, "no_hit", 100)


def test_equal_costs_go_to_fewer_outstanding_then_round_robin():
    assert choose(CACHE, [N(outstanding=1), N()], cached=[0, 0]) == (1, "no_hit", 100)
    assert [choose(CACHE, [N(), N(), N()], turn=t, cached=[8, 8, 8])[0] for t in range(4)] == [0, 1, 2, 0]


def test_imbalance_falls_back_to_least_loaded():
    nodes = [N(outstanding=10), N(outstanding=3)]  # 10 - 3 > 2 and 10 > 1.5 * 3
    assert choose(CACHE, nodes, cached=[96, 0]) == (1, "imbalance", 100)
    assert choose(CACHE, [N(outstanding=10), N(outstanding=7)], cached=[96, 0]) == (0, "prefix_hit", 4)  # 10 < 10.5
    assert choose(Policy(), [N(outstanding=60), N()], cached=[96, 0]) == (0, "prefix_hit", 4)  # 60 - 0 <= 64


def test_decode_nodes_go_by_load_then_by_cached_prefix():
    d = [N("decode", 1), N("decode", 1), N("decode", 2)]
    assert choose(CACHE, d, cached=[0, 32, 64]) == (1, "prefix_hit", 0)  # decode computes no prompt: 0 tokens
    assert choose(CACHE, [N("decode", 0), N("decode", 1)], cached=[0, 64]) == (0, "no_hit", 0)
    # with a decode node among the candidates, colocated ones are weighed the same way
    assert choose(CACHE, [N("colocated", 1), N("decode", 0)], cached=[96, 0]) == (1, "no_hit", 0)


def test_without_cached_prefixes_cache_aware_is_least_loaded():
    assert choose(CACHE, [N(outstanding=2), N(outstanding=1)], cached=None) == (1, "no_index", 0)


def test_round_robin_rotates_whatever_the_load():
    nodes = [N(outstanding=9), N(), N()]
    rr = Policy("round_robin")
    assert [choose(rr, nodes, turn=t, cached=[0, 0, 99]) for t in range(4)] == [
        (0, "round_robin", 0), (1, "round_robin", 0), (2, "round_robin", 0), (0, "round_robin", 0)
    ]  # fmt: skip


def test_least_loaded_ignores_the_cache():
    ll = Policy("least_loaded")
    assert choose(ll, [N(), N(outstanding=1)], cached=[0, 99]) == (0, "least_loaded", 0)
    assert [choose(ll, [N(), N()], turn=t)[0] for t in range(3)] == [0, 1, 0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"routing": "x"}, "routing must be one of cache_aware, least_loaded, round_robin, got 'x'"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold must be >= 0, got -1"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold must be >= 1 and finite, got 0.5"),
        ({"balance_rel_threshold": float("nan")}, "balance_rel_threshold must be >= 1 and finite, got nan"),
    ],
)
def test_bad_routing_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        RouterConfig(**fields)


def test_the_config_makes_its_policy():
    assert RouterConfig(routing="round_robin", balance_abs_threshold=3).policy == Policy("round_robin", 3, 1.5)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing must be one of cache_aware, least_loaded, round_robin, got 'x'"):
        Policy("x")


# ---------------------------------------------------------------------- the pool's pick


def indexed_pool(*roles: str, policy: Policy | None = None) -> NodePool:
    pool = NodePool([(r, f"127.0.0.1:{5000 + i}") for i, r in enumerate(roles)], connect=False, policy=policy)
    for node in pool.nodes:
        pool.set_health(node, True)
        node.blocks.apply(Batch(seq=0, snapshot=True, events=(), page_size=4))
    return pool


def prompt(ids: list[int], salt: str = "") -> PromptBlocks:
    return PromptBlocks(len(ids), {4: block_hashes(ids, 4, salt)})


def test_pick_charges_the_tokens_to_compute_and_release_takes_them_back():
    pool = indexed_pool("prefill", "prefill")
    a, b = pool.nodes
    ids = list(range(12))  # 3 blocks
    a.blocks.apply(Batch(1, False, (Event(STORED, block_hashes(ids, 4)[:1]),), 4))  # a holds the first block
    first = pool.pick(["prefill"], prompt=prompt(ids))
    assert (first.node, first.reason, first.tokens, a.pending_tokens) == (a, "prefix_hit", 8, 8)
    second = pool.pick(["prefill"], prompt=prompt(ids))  # a: 12 - 4 + 8 = 16, b: 12
    assert (second.node, second.reason, second.tokens, b.pending_tokens) == (b, "no_hit", 12, 12)
    pool.release(a, first.tokens)
    pool.release(b, second.tokens)
    assert (a.pending_tokens, b.pending_tokens, a.outstanding, b.outstanding) == (0, 0, 0, 0)


def test_a_salted_prompt_misses_unsalted_blocks():
    pool = indexed_pool("colocated", "colocated")
    ids = list(range(8))
    pool.nodes[1].blocks.apply(Batch(1, False, (Event(STORED, block_hashes(ids, 4)),), 4))
    hit = pool.pick(["colocated"], prompt=prompt(ids))
    assert (pool.nodes.index(hit.node), hit.reason) == (1, "prefix_hit")
    pool.release(hit.node, hit.tokens)
    miss = pool.pick(["colocated"], prompt=prompt(ids, salt="tenant"))
    assert miss.reason == "no_hit"


def test_no_prompt_or_no_index_is_no_index():
    pool = indexed_pool("colocated")
    assert pool.pick(["colocated"]).reason == "no_index"
    pool.nodes[0].blocks.clear()
    assert pool.pick(["colocated"], prompt=prompt(list(range(8)))).reason == "no_index"


def test_round_robin_pool_rotates_without_releases():
    pool = indexed_pool("colocated", "colocated", "colocated", policy=Policy("round_robin"))
    picks = [pool.pick(["colocated"]) for _ in range(4)]
    assert [pool.nodes.index(p.node) for p in picks] == [0, 1, 2, 0]
    assert {p.reason for p in picks} == {"round_robin"}


def test_a_removed_node_drops_its_index():
    pool = indexed_pool("colocated")
    node = pool.nodes[0]
    node.blocks.apply(Batch(1, False, (Event(STORED, [1, 2]),), 4))
    pool.remove(node.address)
    assert (node.blocks.synced, len(node.blocks)) == (False, 0)
