"""Caches keyed by addresses that clients or peers name are bounded and keyed in one spelling:
the router's node pool (AddNode), a decode node's prefill peers (GenerateRequest's prefill_addr)
and a prefill rank's KVReceiver channels (addresses from registrations)."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.common import rpc
from kvbridge.common.limits import normalized_address
from kvbridge.decode_node import service as decode_service
from kvbridge.decode_node.service import PrefillPeers
from kvbridge.kv_transfer import make_sender
from kvbridge.kv_transfer import sender as sender_module
from kvbridge.kv_transfer.adapters import layout_to_proto
from kvbridge.kv_transfer.layout import RankInfo
from kvbridge.router import pool as pool_module
from kvbridge.router.pool import NodePool, PoolFull
from kvbridge.v1 import prefill_pb2, prefill_pb2_grpc
from tests.kv_transfer.test_kv_transfer_sender import layout_of, make_prefill_pool
from tests.pd import fleet_signed


@pytest.mark.parametrize(
    ("given", "key"),
    [("LocalHost:050051", "localhost:50051"), ("10.0.0.7:8", "10.0.0.7:8"), ("[::1]:0443", "[::1]:443")],
)
def test_an_address_has_one_spelling(given, key):
    assert normalized_address(given) == key


@pytest.mark.parametrize("bad", ["", "host", "host:0", "host:65536", "::1:80", "h" * 300 + ":80", "host:+80"])
def test_a_malformed_address_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="address"):
        normalized_address(bad)


def test_the_router_pool_is_bounded_and_one_node_has_one_address(monkeypatch):
    monkeypatch.setattr(pool_module, "MAX_NODES", 3)
    pool = NodePool([("decode", "Node-A:0100")], connect=False)
    with pytest.raises(ValueError, match="a decode node 'node-a:100' is already in the pool"):
        pool.add("decode", "node-a:100")
    pool.add("prefill", "node-a:100")  # another role at the same address is another node
    pool.add("colocated", "node-b:1")
    with pytest.raises(PoolFull, match="the pool holds 3 nodes, its limit"):
        pool.add("colocated", "node-c:1")
    assert pool.remove("NODE-B:001").address == "node-b:1"
    assert pool.add("colocated", "node-c:1").address == "node-c:1"  # room again
    assert [(n.role, n.address) for n in pool.nodes] == [
        ("decode", "node-a:100"), ("prefill", "node-a:100"), ("colocated", "node-c:1"),
    ]  # fmt: skip


class LayoutOnly(prefill_pb2_grpc.BootstrapServicer):
    def __init__(self):
        self.fetches = 0

    def GetLayout(self, request, context):
        self.fetches += 1
        layout = layout_to_proto(layout_of([RankInfo(0, 0, 6, receiver_addr="127.0.0.1:1")]))
        return fleet_signed(prefill_pb2.GetLayoutResponse(layout=layout), request.nonce)


def test_a_decode_nodes_prefill_peers_are_a_bounded_lru(monkeypatch):
    monkeypatch.setattr(decode_service, "MAX_PEERS", 2)
    servers = []
    for _ in range(3):
        servicer = LayoutOnly()
        server, port, _ = rpc.make_server(
            "127.0.0.1", 0, [(prefill_pb2_grpc.add_BootstrapServicer_to_server, servicer)], ["kvbridge.v1.Bootstrap"]
        )
        server.start()
        servers.append((server, port, servicer))
    a, b, c = (f"127.0.0.1:{port}" for _, port, _ in servers)

    async def run() -> list:
        peers = PrefillPeers()
        try:
            seen = []
            for addr in (a, b, f"127.0.0.1:0{a.rpartition(':')[2]}", c, b, a):  # a twice in two spellings
                await peers.get(addr)
                seen.append(list(peers._peers))
            return seen
        finally:
            await peers.close()

    try:
        seen = asyncio.run(run())
    finally:
        for server, _, _ in servers:
            server.stop(0)
    assert seen == [[a], [a, b], [b, a], [a, c], [c, b], [b, a]]  # b evicted by c, fetched again; then c by a
    assert [s.fetches for _, _, s in servers] == [2, 2, 1]


def test_a_senders_receiver_channels_are_a_bounded_lru(monkeypatch):
    monkeypatch.setattr(sender_module, "MAX_STUBS", 2)
    sender = make_sender("grpc", make_prefill_pool((0, 6), 0), 0)
    try:
        for addr in ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1", "127.0.0.1:3"):
            sender._stub(addr)
        assert list(sender._stubs) == ["127.0.0.1:1", "127.0.0.1:3"]
    finally:
        sender.close()
