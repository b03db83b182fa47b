"""A backend added from outside kv_transfer: one module's worth of code (here, this file's top half)
and one registration. Nothing else changes: the receiver opens its half and publishes its endpoint,
the layout carries it over protobuf, `auto` picks it by the registry's order, the factory builds its
sender, and the rooms check and count its writes like any other direct backend's.

The backend, "local", is a toy only in where the pools are (one process): each decode rank's pool
is found by a token its receiving half publishes."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import pytest
import torch

from kvbridge.engine.kv_pool import KVPool
from kvbridge.kv_transfer import KVPoll, KVReceiverEndpoint, NodeLayout, PageGeometry, RankInfo, ReceiverConfig, factory
from kvbridge.kv_transfer.adapters import layout_from_proto, layout_to_proto, sources_of
from kvbridge.kv_transfer.backends.base import Backend, Receiving
from kvbridge.kv_transfer.blocks import copy_pages
from kvbridge.kv_transfer.sender import Sender, SenderRoom, Target

# ---- the backend: both halves ----

POOLS: dict[bytes, tuple[torch.Tensor, tuple[int, int]]] = {}  # token -> (a decode rank's pool, its layers)


class LocalReceiving(Receiving):
    token = b""

    def start(self, pool, rooms) -> bytes:
        self.token = secrets.token_hex(8).encode()
        POOLS[self.token] = (pool.buffer, self.config.layers)
        return self.token

    def close(self) -> None:
        POOLS.pop(self.token, None)


class LocalSender(Sender):
    name = "local"

    def _key(self, info: RankInfo) -> str:
        return info.endpoint("local").decode()

    def _open(self, info: RankInfo, decode: NodeLayout):
        return POOLS[info.endpoint("local")]

    def _write(self, conn, r: SenderRoom, target: Target, src: Sequence[int], dst: Sequence[int]) -> int:
        pool, layers = conn
        return copy_pages(self.pool.buffer, self.layers, src, pool, layers, dst, target.lo, target.hi)


def check(data: bytes) -> str:
    return "" if len(data) == 16 else f"a token has 16 hex digits, got {len(data)}"


LOCAL = Backend("local", frozenset({"cpu"}), LocalSender, LocalReceiving, same_host=True, direct=True, check=check)

# ---- the registration, and what it takes part in ----

KEY = bytes(range(16))
GEOMETRY = PageGeometry(page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.fixture
def registered():
    """The one registration, first in `auto`'s order (as a line at the top of factory.REGISTRY)."""
    before = dict(factory.REGISTRY)
    factory.REGISTRY.clear()
    factory.REGISTRY.update({"local": LOCAL, **before})
    yield
    factory.REGISTRY.clear()
    factory.REGISTRY.update(before)


def test_a_registered_backend_moves_pages_end_to_end(registered):
    d_ranges, p_ranges = [(0, 3), (3, 6)], [(0, 6)]
    receivers = [
        KVReceiverEndpoint(ReceiverConfig(j, lo, hi, 8, 4, 2, 8, backends=("local",)))
        for j, (lo, hi) in enumerate(d_ranges)
    ]
    g = torch.Generator().manual_seed(1)
    pool = KVPool(8, (0, 6), 4, 2, 8, torch.float32, buffer=torch.randn(GEOMETRY.pool_shape(8, (0, 6)), generator=g))
    try:
        assert [[e.backend for e in r.endpoint.endpoints] for r in receivers] == [["local", "grpc"]] * 2
        decode = NodeLayout(GEOMETRY, 6, 8, tuple(r.endpoint for r in receivers), "fp", ("local", "grpc"), "h")
        decode = layout_from_proto(layout_to_proto(decode))  # as a prefill node gets it
        prefill = NodeLayout(
            GEOMETRY, 6, 8, tuple(RankInfo(i, *r) for i, r in enumerate(p_ranges)), "fp", ("local", "grpc"), "h"
        )
        backend = factory.choose_backend(prefill, decode, "cpu")
        assert backend == "local"
        sender = factory.make_sender(backend, pool, 0)
        for r in receivers:
            r.expect(5, "rid", [6, 7], sources_of(prefill), backend, KEY)
        sender.connect(5, decode, [6, 7], KEY)
        sender.push(5, [1, 2], [6, 7], 8)
        sender.finish(5, 8)
        deadline = time.monotonic() + 20
        while not all(x.poll(5).is_terminal for x in [sender, *receivers]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [x.poll(5) for x in [sender, *receivers]] == [KVPoll.SUCCESS] * 3
        for r, (lo, hi) in zip(receivers, d_ranges):
            assert torch.equal(r.pool.buffer[[6, 7]], pool.buffer[[1, 2], lo:hi])
            assert r.pool.buffer[:6].abs().sum() == 0
        sender.close()
    finally:
        for r in receivers:
            r.close()
    assert POOLS == {}  # each receiving half closed


def test_a_registered_backends_check_guards_its_endpoint(registered):
    with KVReceiverEndpoint(ReceiverConfig(0, 0, 6, 8, 4, 2, 8, backends=("local",))) as r:
        msg = layout_to_proto(NodeLayout(GEOMETRY, 6, 8, (r.endpoint,), "fp", ("local",), "h"))
    msg.ranks[0].endpoints["local"] = b"short"
    with pytest.raises(
        ValueError, match="layout rank 0: its local endpoint is unusable: a token has 16 hex digits, got 5"
    ):
        layout_from_proto(msg)
