"""Shared factories: small engines on tiny-random, and the default model loaded once; a colocated
tiny-random node; the hard timeouts that turn a hang into a failure; the node checks after every
test."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM
from kvbridge.engine.weights import load_model, tiny_random

# Bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (some CI images set it):
# without them every process a test starts (a node's front, each rank) compiles kvbridge's sources
# again, 1-3 s a process on 2 cores, and pytest rewrites every test module's asserts on every run.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_random()


@pytest.fixture(scope="session")
def default_model():
    return load_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def hf_default():
    """The default model in transformers (fp32, from the same GGUF file): the independent reference."""
    transformers = pytest.importorskip("transformers")
    import torch

    from kvbridge.engine.weights import smollm2_path

    path = smollm2_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def make_llm(model, num_stages: int = 1, **overrides) -> LLM:
    config = EngineConfig(model=model.source, **{"page_size": 4, "kv_cache_tokens": 8192, **overrides})
    return LLM(config, model=model, num_stages=num_stages, progress=False)


def make_prompts(n: int, vocab: int, seed: int = 0, min_len: int = 3, max_len: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


@pytest.fixture(scope="module")
def colocated_node():
    """A colocated node (pp 1) on tests/pd.py's TINY config, started once per module."""
    from kvbridge.engine.config import PPConfig
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig
    from tests.pd import TINY

    made = start_node("colocated", NodeConfig(TINY, PPConfig()))
    yield made
    made.stop()


@contextlib.contextmanager
def hard_deadline(seconds: float, before_exit=None):
    """A hang must fail the run, not stall it: past `seconds`, dump every thread's stack and exit.

    faulthandler's watchdog does it (it runs even while a thread holds the GIL); with `before_exit`
    a timer thread calls it first (e.g. to kill the child processes a test started), then dumps and
    exits (status 3)."""
    if before_exit is None:
        faulthandler.dump_traceback_later(seconds, exit=True)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
        return

    def expire() -> None:
        before_exit()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _deadline_of(module):
    """A test module's hard deadline: its HARD_TIMEOUT_S (600 s unless set) and its before_hard_exit()."""
    return getattr(module, "HARD_TIMEOUT_S", 600), getattr(module, "before_hard_exit", None)


@pytest.fixture(scope="module")
def hard_timeout(request):
    """Fail (not hang) the module: from the first test that asks for it (or a module fixture that
    does) to the end of the module, past the module's HARD_TIMEOUT_S (see hard_deadline)."""
    with hard_deadline(*_deadline_of(request.module)):
        yield


@pytest.fixture
def hard_timeout_per_test(request):
    """The same bound on each test that asks for it, alone (HARD_TIMEOUT_S of its module)."""
    with hard_deadline(*_deadline_of(request.module)):
        yield


@pytest.fixture(autouse=True)
def kvbridge_logs_reach_caplog():
    """common/logs.py setup (which a bench, demo or CLI run in this process calls) sets the `kvbridge`
    loggers' level, every module's included (a bench: error), and stops them propagating to the
    root logger, where caplog listens: each test starts with both as Python's defaults (a test that
    needs a level sets it)."""
    root = logging.getLogger("kvbridge")
    root.propagate = True
    root.setLevel(logging.NOTSET)


@pytest.fixture(autouse=True)
def node_invariants():
    """After every test: each node still running is idle within 15 s and passes its invariant
    checks (serving/server.py NodeServer.check_invariants)."""
    yield
    from kvbridge.serving.server import LIVE

    for server in list(LIVE):
        if server.dead:
            continue
        deadline = time.monotonic() + 15
        while (held := server.node.front.status()["requests_in_flight"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held == 0, f"{server.role} node {server.address} still holds {held} requests after the test"
        assert server.check_invariants() == [], f"{server.role} node {server.address}"


@pytest.fixture
def router_phases():
    """(time.monotonic(), fields) of every `event=phase` line a router in this process logs during
    the test (routed, retry, migrate, finished, ...)."""
    import logging

    logger, lines = logging.getLogger("kvbridge.router"), []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "fields", {})
            if fields.get("event") == "phase":
                lines.append((time.monotonic(), dict(fields)))

    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


LONG_CASES = Path(__file__).with_name("long_cases.txt")


def long_cases() -> set[str]:
    """The node ids tests/long_cases.txt lists (comments and blank lines left out)."""
    lines = (line.split("#", 1)[0].strip() for line in LONG_CASES.read_text().splitlines())
    return {line for line in lines if line}


@pytest.hookimpl(tryfirst=True)  # (before `-m` deselects by marks)
def pytest_collection_modifyitems(config, items):
    """Cases listed in tests/long_cases.txt are `long` as if marked where they are defined: the cases
    measured over the line on the slowest CPU of our kind (scripts/long_cases.py keeps the list)."""
    listed = long_cases()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.long)
