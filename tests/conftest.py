"""Shared factories: small engines on tiny-random, and the default model loaded once."""

from __future__ import annotations

import random
import time

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.weights import load_model, tiny_random


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_random()


@pytest.fixture(scope="session")
def default_model():
    return load_model("smollm2-135m-instruct", progress=False)


def make_llm(model, num_stages: int = 1, **overrides) -> LLM:
    config = EngineConfig(model=model.source, **{"page_size": 4, "kv_cache_tokens": 8192, **overrides})
    return LLM(config, model=model, num_stages=num_stages, progress=False)


def make_prompts(n: int, vocab: int, seed: int = 0, min_len: int = 3, max_len: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


@pytest.fixture(autouse=True)
def node_invariants():
    """After every test: each node still running is idle within 15 s and passes its invariant
    checks (serving/server.py NodeServer.check_invariants)."""
    yield
    from serving.server import LIVE

    for server in list(LIVE):
        if server.dead:
            continue
        deadline = time.monotonic() + 15
        while (held := server.node.front.status()["requests_in_flight"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held == 0, f"{server.role} node {server.address} still holds {held} requests after the test"
        assert server.check_invariants() == [], f"{server.role} node {server.address}"
