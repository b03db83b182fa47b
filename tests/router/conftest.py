"""The router tests' fleet of in-test nodes (tests/router/fakes.py) behind a real router."""

from __future__ import annotations

import pytest

from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from tests.router.fakes import FakeNode, Rooms


@pytest.fixture
def fleet():
    """make(colocated=n, prefill=n, decode=n, timeout_s=30.0, router={RouterConfig fields}, **node kwargs)
    -> (router, {role: [FakeNode]}); every router and node made is stopped after the test."""
    made, routers = [], []

    def make(
        colocated: int = 0, prefill: int = 0, decode: int = 0, timeout_s: float = 30.0, router: dict | None = None, **kw
    ):
        rooms = Rooms()
        nodes = {
            role: [FakeNode(role, rooms, **kw) for _ in range(k)]
            for role, k in (("colocated", colocated), ("prefill", prefill), ("decode", decode))
        }
        made.extend(n for group in nodes.values() for n in group)
        config = RouterConfig(
            port=0,
            http_port=0,
            colocated=tuple(n.address for n in nodes["colocated"]),
            prefill=tuple(n.address for n in nodes["prefill"]),
            decode=tuple(n.address for n in nodes["decode"]),
            **({"request_timeout_s": timeout_s, "health_retry_s": 0.1} | (router or {})),
        )
        routers.append(start_router(config))
        return routers[-1], nodes

    yield make
    for r in routers:
        r.stop(grace_s=0)
    for n in made:
        n.stop()
