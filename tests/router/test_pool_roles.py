"""The router's view of elastic nodes (router/pool.py): a role learned from the node (older reports
ignored), and which switches leave the fleet able to serve."""

from __future__ import annotations

from kvbridge.router.pool import NodePool


def pool_of(*nodes: tuple[str, str]) -> NodePool:
    pool = NodePool(list(nodes), connect=False)
    for node in pool.nodes:
        pool.set_health(node, True)
    return pool


def by_address(pool: NodePool, address: str):
    return next(n for n in pool.nodes if n.address == address)


def test_a_learned_role_moves_the_node_and_an_older_report_is_ignored():
    pool = pool_of(("prefill", "h:1"), ("decode", "h:2"), ("decode", "h:3"))
    node = by_address(pool, "h:2")
    assert pool.set_role(node, "prefill", 1) is True
    assert [n.node.address for n in [pool.pick(("prefill",)), pool.pick(("prefill",))]] == ["h:1", "h:2"]
    assert pool.pick(("decode",)).node.address == "h:3"
    assert pool.set_role(node, "decode", 0) is False and node.role == "prefill"  # a stale answer
    assert pool.set_role(node, "prefill", 1) is False  # no change
    assert pool.set_role(node, "router", 2) is False and (node.role, node.role_epoch) == ("prefill", 1)


def test_the_last_node_of_a_role_may_not_switch_and_switching_nodes_count_as_gone():
    pool = pool_of(("prefill", "h:1"), ("decode", "h:2"), ("decode", "h:3"))
    p, d2, d3 = (by_address(pool, a) for a in ("h:1", "h:2", "h:3"))
    assert pool.begin_switch(p, "decode") == (
        "h:1 is the last prefill node serving: switching it to decode leaves the fleet no prefill node"
    )
    assert pool.begin_switch(d2, "prefill") == "" and d2.switching_to == "prefill"
    # a node the router is switching gets no new request (it refuses them until its health says so)
    assert [pool.pick(("decode",)).node.address for _ in range(3)] == ["h:3"] * 3
    assert pool.begin_switch(d2, "colocated") == "a switch of h:2 to prefill is in progress"
    assert pool.begin_switch(d3, "prefill").startswith("h:3 is the last decode node serving")
    pool.end_switch(d2)
    assert d2.switching_to == "" and pool.begin_switch(d3, "colocated") == ""
    pool.end_switch(d3)
    pool.set_health(d3, False)  # an unhealthy node serves nothing: d2 is the last decode node
    assert pool.begin_switch(d2, "prefill").startswith("h:2 is the last decode node serving")
    assert pool.begin_switch(d2, "decode") == ""  # its own role: nothing to refuse (the node says so)


def test_the_last_colocated_node_may_go_where_a_pd_pair_serves():
    pool = pool_of(("colocated", "h:1"), ("prefill", "h:2"))
    c = by_address(pool, "h:1")
    assert pool.begin_switch(c, "prefill").startswith("h:1 is the last colocated node serving")
    assert pool.begin_switch(c, "decode") == ""  # then h:2 prefills and h:1 decodes


def test_a_switch_under_way_is_told_once_when_its_role_would_be_left_empty():
    """A switch the pool let begin comes to strand its role when the last other node of it goes while
    it waits: turned unhealthy, changed role (switched straight at the node) or removed."""
    pool = pool_of(("prefill", "h:1"), ("decode", "h:2"), ("decode", "h:3"), ("decode", "h:4"))
    d2, d3, d4 = (by_address(pool, a) for a in ("h:2", "h:3", "h:4"))
    told: list[str] = []
    why = (
        "h:2 would be the last decode node serving: another decode node turned unhealthy, left the pool or "
        "changed role while it waited to switch"
    )
    assert pool.begin_switch(d2, "prefill", told.append) == ""
    pool.set_health(d3, False)
    assert told == []  # d4 still decodes
    pool.set_role(d4, "prefill", 1)
    assert told == [why]
    pool.set_health(d4, False)
    assert told == [why]  # once
    pool.end_switch(d2)
    pool.set_health(d3, True)
    assert pool.begin_switch(d2, "prefill", told.append) == ""
    pool.remove("h:3")
    assert told == [why, why]
    pool.end_switch(d2)
    pool.set_health(d4, True)
    assert pool.begin_switch(d4, "decode", told.append) == "" and d4.switching_to == "decode"
    pool.set_health(d2, False)  # the prefill role keeps h:1: nothing to tell
    pool.end_switch(d4)
    pool.set_role(by_address(pool, "h:1"), "decode", 1)
    assert told == [why, why]  # (no switch under way)
