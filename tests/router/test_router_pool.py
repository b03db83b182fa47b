"""Node selection and router configuration, without any server."""

from __future__ import annotations

import pytest

from kvbridge.common.rpc import EventLoop
from kvbridge.router.config import RouterConfig, parse_address
from kvbridge.router.pool import NodePool


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
        ({"colocated": ("h:1", "h:1")}, "listed twice: 'h:1'"),
        ({"colocated": ("h:1",), "port": 70000}, "port must be in [0, 65535] (or -1: no gRPC), got 70000"),
        ({"colocated": ("h:1",), "port": 9, "http_port": 9}, "port and http_port are both 9"),
        ({"metrics_port": 9, "http_port": 9}, "http_port and metrics_port are both 9"),
        ({"metrics_port": -2}, "metrics_port must be -1 (off) or in [0, 65535], got -2"),
        ({"colocated": ("h:1",), "request_timeout_s": 0.0}, "request_timeout_s must be > 0, got 0.0"),
        ({"colocated": ("h",)}, "colocated: expected HOST:PORT"),
    ],
)
def test_bad_config_raises_naming_the_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        RouterConfig(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "kwargs", [{}, {"prefill": ("h:1",)}, {"decode": ("h:1",)}, {"metrics_port": 0, "http_port": 0, "port": 0}]
)
def test_any_fleet_is_a_valid_config_none_included(kwargs):
    """Nodes can be added at run time, so a router may start with no node, or half a P+D pair."""
    c = RouterConfig(**kwargs)
    assert c.nodes == [(role, a) for role in ("prefill", "decode") for a in kwargs.get(role, ())]


def test_config_lists_nodes_by_role():
    c = RouterConfig(colocated=("a:1",), prefill=("p:1",), decode=("d:1", "d:2"))
    assert c.nodes == [("colocated", "a:1"), ("prefill", "p:1"), ("decode", "d:1"), ("decode", "d:2")]


# ---------------------------------------------------------------- the fleet at run time


def test_added_nodes_are_routed_to_once_healthy_and_removed_ones_at_once_never():
    pool = make_pool("colocated")
    changes = []
    pool.add_listener(lambda: changes.append(len(pool.nodes)))
    added = pool.add("colocated", "127.0.0.1:6000")
    assert (added.role, added.address, added.healthy, added.reported) == ("colocated", "127.0.0.1:6000", False, False)
    assert picks(pool, ["colocated"], 2) == [0, 0]  # not healthy yet
    pool.set_health(added, True)
    assert picks(pool, ["colocated"], 4) == [0, 1, 0, 1]
    assert pool.remove("127.0.0.1:5000") is not added
    assert [pool.acquire(["colocated"]) for _ in range(2)] == [added, added]
    assert changes == [2, 2, 1]  # added, turned healthy, removed


def test_the_same_address_may_serve_two_roles_and_removal_must_then_name_one():
    pool = make_pool("colocated")
    pool.add("decode", "127.0.0.1:5000")
    with pytest.raises(ValueError) as err:
        pool.remove("127.0.0.1:5000")
    assert str(err.value) == "'127.0.0.1:5000' is in the pool as colocated and decode: say which role to remove"
    assert pool.remove("127.0.0.1:5000", role="decode").role == "decode"
    assert [(n.role, n.address) for n in pool.nodes] == [("colocated", "127.0.0.1:5000")]


@pytest.mark.parametrize(
    ("role", "address", "message"),
    [
        ("colocated", "127.0.0.1:5000", "a colocated node '127.0.0.1:5000' is already in the pool"),
        ("router", "127.0.0.1:7000", "role must be one of colocated, prefill, decode, got 'router'"),
        ("prefill", "127.0.0.1", "prefill: expected HOST:PORT with a port in [1, 65535], got '127.0.0.1'"),
    ],
)
def test_bad_additions_are_refused_naming_the_value(role, address, message):
    pool = make_pool("colocated")
    with pytest.raises(ValueError) as err:
        pool.add(role, address)
    assert str(err.value) == message
    assert len(pool.nodes) == 1


def test_removing_an_unknown_node_names_it():
    pool = make_pool("colocated")
    with pytest.raises(KeyError) as err:
        pool.remove("127.0.0.1:7000")
    assert err.value.args[0] == "no node '127.0.0.1:7000' in the pool"
    with pytest.raises(KeyError) as err:
        pool.remove("127.0.0.1:5000", role="decode")
    assert err.value.args[0] == "no decode node '127.0.0.1:5000' in the pool"
    with pytest.raises(ValueError) as err:
        pool.remove("127.0.0.1:5000", role="x")
    assert str(err.value) == "role must be one of colocated, prefill, decode (or empty), got 'x'"


@pytest.fixture
def loop():
    made = EventLoop("test-pool")
    yield made
    made.stop()


def test_a_removed_node_keeps_its_channel_until_its_last_request_is_released(loop):
    pool = NodePool([("colocated", "127.0.0.1:5000")], loop=loop)  # channels made, never used: not started
    [node] = pool.nodes
    pool.set_health(node, True)
    first, second = pool.acquire(["colocated"]), pool.acquire(["colocated"])
    pool.remove(node.address)
    assert pool.acquire(["colocated"]) is None
    pool.release(first)
    assert node.channel is not None  # one request still streams over it
    pool.release(second)
    assert node.channel is None  # closed
    pool.close()


def test_a_closed_pool_routes_nothing_and_closes_idle_channels(loop):
    pool = NodePool([("colocated", "127.0.0.1:5000"), ("decode", "127.0.0.1:5001")], loop=loop)
    for node in pool.nodes:
        pool.set_health(node, True)
    busy = pool.acquire(["colocated"])
    idle = next(n for n in pool.nodes if n is not busy)
    pool.close()
    assert pool.acquire(["colocated", "decode"]) is None
    assert (busy.channel is not None, idle.channel is None) == (True, True)
    pool.release(busy)
    assert busy.channel is None
    with pytest.raises(ValueError, match="the node pool is closed"):
        pool.add("colocated", "127.0.0.1:5002")


def test_a_pool_that_connects_needs_a_loop():
    with pytest.raises(ValueError) as err:
        NodePool([("colocated", "127.0.0.1:5000")])
    assert str(err.value) == "a pool that connects to its nodes needs the event loop its channels live on"
