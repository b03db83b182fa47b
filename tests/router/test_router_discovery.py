"""Nodes found in DNS (router/discovery.py): the pool follows each name's answers, a failed lookup
changes nothing, nodes from flags are left alone; a real router finds a real node by name."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvbridge.common import rpc
from kvbridge.router.config import RouterConfig
from kvbridge.router.discovery import Discovery, DnsTarget, parse_target, resolve
from kvbridge.router.pool import NodePool
from kvbridge.router.server import start_router
from kvbridge.v1 import generation_pb2_grpc
from tests.router.fakes import make_request, wait_until


def test_targets_parse_and_bad_ones_are_named():
    assert parse_target("prefill=kvbridge-prefill.kvbridge.svc:50051") == DnsTarget(
        "prefill", "kvbridge-prefill.kvbridge.svc", 50051
    )
    with pytest.raises(ValueError, match="ROLE one of colocated, prefill, decode, got 'router=x:1'"):
        parse_target("router=x:1")
    with pytest.raises(ValueError, match="discover: expected HOST:PORT"):
        parse_target("decode=no-port")
    with pytest.raises(ValueError, match="discover_interval_s must be > 0"):
        RouterConfig(discover=("decode=d:1",), discover_interval_s=0)


def test_the_pool_follows_the_answers_and_a_failed_lookup_changes_nothing():
    answers = [{"10.0.0.1:7000", "10.0.0.2:7000"}, {"10.0.0.2:7000", "10.0.0.3:7000"}, OSError("no such name"), set()]

    async def resolver(name: str, port: int) -> set[str]:
        assert (name, port) == ("p.svc", 7000)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    pool = NodePool([("prefill", "10.0.0.9:7000")], connect=False)  # (from a flag: never removed here)
    d = Discovery(pool, [parse_target("prefill=p.svc:7000")], resolver)
    seen = []
    for _ in range(4):
        asyncio.run(d.refresh())
        seen.append(sorted(n.address for n in pool.nodes))
    assert seen == [
        ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.9:7000"],
        ["10.0.0.2:7000", "10.0.0.3:7000", "10.0.0.9:7000"],
        ["10.0.0.2:7000", "10.0.0.3:7000", "10.0.0.9:7000"],  # the lookup failed: kept
        ["10.0.0.9:7000"],  # an answer without them: gone
    ]
    assert all(n.role == "prefill" for n in pool.nodes)


def test_names_resolve_to_host_port_addresses():
    got = asyncio.run(resolve("localhost", 7000))
    assert "127.0.0.1:7000" in got and all(a.endswith(":7000") for a in got)
    with pytest.raises(socket.gaierror):
        asyncio.run(resolve("no-such-host.invalid", 7000))


def test_a_router_finds_a_node_by_its_name(colocated_node):
    port = colocated_node.address.rsplit(":", 1)[1]
    router = start_router(
        RouterConfig(port=0, http_port=0, discover=(f"colocated=localhost:{port}",), health_retry_s=0.1)
    )
    try:
        node = next(n for n in router.pool.nodes if n.address == f"127.0.0.1:{port}")
        assert wait_until(lambda: node.healthy)
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
        responses = list(stub.Generate(make_request([5, 6, 7], max_new_tokens=3), timeout=60))
        assert sum(len(r.token_ids) for r in responses) == 3 and responses[-1].finish_reason == "length"
    finally:
        router.stop(grace_s=0)
