"""Clients that cancel at every moment: 500 requests through the router to one prefill and one
decode node, 32 at a time, each cancelled by its client before sending, right after, after k
tokens, or never (seeded). Every call ends, nothing leaks (no page, queue entry or request left
on either node or the router), and the requests nobody cancelled get the tokens of a quiet run."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.metrics import OUTCOMES
from kvbridge.router.config import RouterConfig
from kvbridge.router.metrics import RETRY_REASONS
from kvbridge.router.server import start_router
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.pd import start_nodes, stop_nodes, token_prompt, wait_idle

REQUESTS = 500
CONCURRENCY = 32
MAX_NEW_TOKENS = 6
CALL_DEADLINE_S = 30.0
MODES = ("before", "after_send", "after_tokens", "never")
HARD_TIMEOUT_S = 300  # the whole module (the hard_timeout fixture, tests/conftest.py)


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    nodes = start_nodes({"p": ("prefill", 1), "d": ("decode", 1, "shm")})
    router = start_router(
        RouterConfig(port=0, http_port=0, prefill=(nodes["p"].address,), decode=(nodes["d"].address,))
    )
    yield nodes["p"], nodes["d"], router
    router.stop()
    stop_nodes(nodes)


def request(ids: list[int]) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return generation_pb2.GenerateRequest(prompt=token_prompt(ids), sampling=sampling)


def run(stub, ids: list[int], mode: str, rng: random.Random) -> tuple[str, list[int], grpc.StatusCode | None]:
    """One call, cancelled by its client as `mode` says; returns (mode, tokens read, final code)."""
    call = stub.Generate(request(ids), timeout=CALL_DEADLINE_S)
    tokens: list[int] = []
    if mode == "before":
        call.cancel()
    elif mode == "after_send":
        time.sleep(rng.uniform(0, 0.03))
        call.cancel()
    else:
        stop_after = rng.randint(1, MAX_NEW_TOKENS - 1) if mode == "after_tokens" else None
        try:
            for resp in call:
                tokens += resp.token_ids
                if stop_after is not None and len(tokens) >= stop_after:
                    call.cancel()
                    break
        except grpc.RpcError:
            pass
    return mode, tokens, call.code()  # code() waits for the call's end: the per-call deadline bounds it


def test_500_requests_cancelled_at_random_moments_leave_nothing_behind(fleet):
    p, d, router = fleet
    rng = random.Random(20240611)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 40))] for _ in range(16)]
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        reference = list(
            pool.map(lambda ids: [t for r in stub.Generate(request(ids), timeout=60) for t in r.token_ids], prompts)
        )
    assert all(len(tokens) == MAX_NEW_TOKENS for tokens in reference)

    plan = [(i % len(prompts), rng.choice(MODES), random.Random(rng.random())) for i in range(REQUESTS)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda job: run(stub, prompts[job[0]], job[1], job[2]), plan))
    seconds = time.monotonic() - t0

    for (index, mode, _), (_, tokens, code) in zip(plan, results):
        want = reference[index]
        if mode == "never":
            assert (code, tokens) == (grpc.StatusCode.OK, want)
        else:  # cancelled: whatever came before the cancel is a prefix of the quiet run's tokens
            assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK), (mode, code)
            assert tokens == want[: len(tokens)]
    counts = {m: sum(mode == m for _, mode, _ in plan) for m in MODES}
    print(f"{REQUESTS} requests ({counts}) in {seconds:.1f} s")

    deadline = time.monotonic() + 15
    while router.dispatcher.num_in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert router.dispatcher.num_in_flight() == 0
    assert set(router.pool.outstanding().values()) == {0}
    registry = router.dispatcher.metrics.registry
    outcomes = {o: registry.get_sample_value("kvbridge_router_requests_total", {"outcome": o}) for o in OUTCOMES}
    assert outcomes["error"] == outcomes["stop"] == 0  # a cancel is an abort, never an error, never retried
    assert outcomes["length"] >= counts["never"] + len(prompts) and sum(outcomes.values()) <= REQUESTS + len(prompts)
    assert sum(registry.get_sample_value("kvbridge_router_retries_total", {"reason": r}) for r in RETRY_REASONS) == 0
    for node in (p, d):
        st = wait_idle(node.address)
        assert [r.kv_pages_used for r in st.ranks] == [0], (node.role, st)
        assert not any(st.queues.values()) and st.requests_in_flight == 0 and st.transfers_in_flight == 0, st
