"""Node selection and router configuration, without any server."""

from __future__ import annotations

import pytest

from router.config import RouterConfig, parse_address
from router.pool import NodePool


def make_pool(*roles: str, healthy: bool = True) -> NodePool:
    pool = NodePool([(role, f"127.0.0.1:{5000 + i}") for i, role in enumerate(roles)], connect=False)
    for node in pool.nodes:
        pool.set_health(node, healthy)
    return pool


def picks(pool: NodePool, roles, n: int, release: bool = True) -> list[int]:
    out = []
    for _ in range(n):
        node = pool.acquire(roles)
        out.append(pool.nodes.index(node))
        if release:
            pool.release(node)
    return out


def test_equal_idle_nodes_alternate():
    pool = make_pool("colocated", "colocated", "colocated")
    assert picks(pool, ["colocated"], 6) == [0, 1, 2, 0, 1, 2]


def test_fewest_outstanding_wins():
    pool = make_pool("colocated", "colocated")
    assert picks(pool, ["colocated"], 4, release=False) == [0, 1, 0, 1]
    pool.release(pool.nodes[1])
    assert picks(pool, ["colocated"], 1, release=False) == [1]
    assert pool.outstanding() == {"colocated/127.0.0.1:5000": 2, "colocated/127.0.0.1:5001": 2}


def test_unhealthy_and_excluded_nodes_are_skipped():
    pool = make_pool("colocated", "colocated", "colocated")
    pool.set_health(pool.nodes[1], False)
    assert picks(pool, ["colocated"], 4) == [0, 2, 0, 2]
    assert pool.acquire(["colocated"], exclude=[pool.nodes[0], pool.nodes[2]]) is None


def test_roles_are_kept_apart_and_each_role_set_has_its_own_turn():
    pool = make_pool("prefill", "decode", "prefill", "decode")
    assert picks(pool, ["decode"], 2) == [1, 3]
    assert picks(pool, ["prefill"], 3) == [0, 2, 0]
    assert picks(pool, ["decode"], 2) == [1, 3]


def test_no_healthy_node_gives_none():
    pool = make_pool("colocated", healthy=False)
    assert pool.acquire(["colocated"]) is None
    assert not pool.has_eligible("colocated")


def test_release_without_acquire_is_a_bug():
    pool = make_pool("colocated")
    with pytest.raises(AssertionError, match="nothing outstanding"):
        pool.release(pool.nodes[0])


@pytest.mark.parametrize(
    ("addr", "message"),
    [
        ("localhost", "expected HOST:PORT"),
        (":50051", "expected HOST:PORT"),
        ("h:0", "expected HOST:PORT"),
        ("h:65536", "expected HOST:PORT"),
        ("h:x", "expected HOST:PORT"),
        ("::1:5", "bad host"),
    ],
)
def test_bad_addresses_are_named(addr, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_address(addr)
    assert repr(addr) in str(err.value)


def test_good_addresses_parse():
    assert parse_address("10.0.0.1:50051") == ("10.0.0.1", 50051)
    assert parse_address("[::1]:7") == ("[::1]", 7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "no backends"),
        ({"prefill": ("h:1",)}, "give both or neither"),
        ({"colocated": ("h:1", "h:1")}, "listed twice: 'h:1'"),
        ({"colocated": ("h:1",), "port": 70000}, "port must be in [0, 65535], got 70000"),
        ({"colocated": ("h:1",), "port": 9, "http_port": 9}, "both 9"),
        ({"colocated": ("h:1",), "request_timeout_s": 0.0}, "request_timeout_s must be > 0, got 0.0"),
        ({"colocated": ("h",)}, "colocated: expected HOST:PORT"),
    ],
)
def test_bad_config_raises_naming_the_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        RouterConfig(**kwargs)
    assert message in str(err.value)


def test_config_lists_nodes_by_role():
    c = RouterConfig(colocated=("a:1",), prefill=("p:1",), decode=("d:1", "d:2"))
    assert c.nodes == [("colocated", "a:1"), ("prefill", "p:1"), ("decode", "d:1"), ("decode", "d:2")]
