"""A Kubernetes inference gateway's prefill choice (router/gateway.py): with two prefill nodes, a
request naming one in x-gateway-prefill-endpoints (or llm-d's x-prefiller-host-port) is prefilled
there, counted under reason "gateway"; an address that is not a prefill node of the router gets 400
naming it, and no connection is opened to it."""

from __future__ import annotations

import contextlib
import socket

import pytest

from tests.router.test_router_tokenize import call

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@contextlib.contextmanager
def trap():
    """A listening socket on 127.0.0.1 that nobody may connect to: yields its address, then
    checks its accept queue is empty."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(BlockingIOError):
            sock.accept()  # nobody connected to it
    finally:
        sock.close()


def gateway_decisions(router) -> float:
    samples = router.dispatcher.metrics.routing.collect()[0].samples
    return sum(s.value for s in samples if s.name.endswith("_total") and s.labels["reason"] == "gateway")


@pytest.mark.parametrize("header", ["x-gateway-prefill-endpoints", "x-prefiller-host-port"])
def test_the_named_prefill_node_prefills(fleet, header):
    router, nodes = fleet(prefill=2, decode=1)
    rooms = nodes["prefill"][0].rooms
    for target in (1, 0, 1, 1):
        before = set(rooms.prefilled)
        status, answer = call(router, "POST", "/v1/chat/completions", BODY, {header: nodes["prefill"][target].address})
        assert status == 200, answer
        [room] = set(rooms.prefilled) - before
        assert rooms.prefilled[room] == nodes["prefill"][target].address
    assert gateway_decisions(router) == 4


def test_a_list_takes_its_first_healthy_known_node_and_unnamed_requests_route_as_ever(fleet):
    router, nodes = fleet(prefill=2, decode=1)
    p0, p1 = (n.address for n in nodes["prefill"])
    rooms = nodes["prefill"][0].rooms
    status, _ = call(router, "POST", "/v1/chat/completions", BODY, {"x-gateway-prefill-endpoints": f" {p1} , {p0}"})
    assert status == 200 and set(rooms.prefilled.values()) <= {p0, p1}
    for _ in range(4):  # no header: the policy spreads them over both
        assert call(router, "POST", "/v1/chat/completions", BODY)[0] == 200
    assert set(rooms.prefilled.values()) == {p0, p1}
    assert gateway_decisions(router) == 1


@pytest.mark.parametrize("header", ["x-gateway-prefill-endpoints", "x-prefiller-host-port"])
def test_an_address_that_is_no_prefill_node_of_the_router_is_refused_and_never_dialled(fleet, header):
    router, nodes = fleet(prefill=2, decode=1)
    decode = nodes["decode"][0].address
    with trap() as elsewhere:
        for named in (elsewhere, f"{nodes['prefill'][0].address},{elsewhere}", decode):
            status, answer = call(router, "POST", "/v1/chat/completions", BODY, {header: named})
            bad = named.split(",")[-1]
            assert (status, answer["error"]["message"]) == (
                400,
                f"{header}: {bad!r} is not a prefill node of this router",
            ), answer
    for garbage in ("nowhere", "[::1", "127.0.0.1:99999", "x" * 5000):  # (not addresses: refused, cut short)
        status, answer = call(router, "POST", "/v1/chat/completions", BODY, {header: garbage})
        assert status == 400 and answer["error"]["message"].startswith(f"{header}: "), answer
        assert "is not a prefill node of this router" in answer["error"]["message"]
        assert len(answer["error"]["message"]) < 200
    assert nodes["prefill"][0].rooms.prefilled == {} and gateway_decisions(router) == 0


def test_a_pod_named_by_its_ip_and_the_pools_port_is_its_prefill_node_never_the_named_port(fleet):
    """An InferencePool's picker names a prefill pod as podIP:targetPort (the pool's port, here a
    trap), not the node's gRPC port: the one prefill node on that host prefills, and the named port
    is never dialled. Another host is refused."""
    router, nodes = fleet(prefill=1, decode=1)
    with trap() as named:
        status, answer = call(router, "POST", "/v1/chat/completions", BODY, {"x-gateway-prefill-endpoints": named})
        assert status == 200, answer
        assert list(nodes["prefill"][0].rooms.prefilled.values()) == [nodes["prefill"][0].address]
    status, answer = call(router, "POST", "/v1/chat/completions", BODY, {"x-prefiller-host-port": "10.1.2.3:8000"})
    assert (status, answer["error"]["message"]) == (
        400,
        "x-prefiller-host-port: '10.1.2.3:8000' is not a prefill node of this router",
    )
    assert gateway_decisions(router) == 1
