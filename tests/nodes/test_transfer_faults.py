"""KV transfer failures injected on one prefill rank only (rank 1 of 2), at 1%, 10% and 50% of
200 requests each, on real processes: every request ends; the ones that succeed equal colocated
serving token for token; the others fail with UNAVAILABLE and a message saying where; both
nodes end with every page free; and each node's ranks applied identical decision logs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY, pd_generate, token_prompt, wait_idle

REQUESTS, MAX_NEW = 200, 4
FAILURES = {"the KV transfer failed on a prefill rank", "the KV transfer failed on a decode rank"}
HARD_TIMEOUT_S = 900  # the whole module (the hard_timeout fixture, tests/conftest.py)


@pytest.fixture(scope="module")
def reference(tiny_model, hard_timeout):
    prompts = make_prompts(REQUESTS, tiny_model.config.vocab_size, seed=11, min_len=4, max_len=24)
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)
    outputs = [c.output_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))]
    return prompts, outputs


@pytest.mark.parametrize(
    "rate", [pytest.param(0.01, marks=pytest.mark.long), 0.1, pytest.param(0.5, marks=pytest.mark.long)]
)
def test_transfer_failures_on_one_rank(reference, rate):
    prompts, expected = reference
    p_config = replace(TINY, fault_inject=f"rank1:transfer_fail={rate},seed=3")
    prefill = start_node("prefill", NodeConfig(p_config, PPConfig(pp_size=2)))
    decode = start_node(  # (a timeout bounds a hang only: every hand-off here ends, done or failed, in seconds)
        "decode", NodeConfig(replace(TINY, transfer_timeout_s=30), PPConfig(pp_size=2), transfer_backend="shm")
    )
    stopped = False
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(
                pool.map(lambda ids: pd_generate(prefill.address, decode.address, token_prompt(ids), MAX_NEW), prompts)
            )
        ok = failed = 0
        for (tokens, _, outcome), want in zip(results, expected):
            if isinstance(outcome, grpc.RpcError):
                failed += 1
                assert outcome.code() == grpc.StatusCode.UNAVAILABLE, outcome
                assert outcome.details() in FAILURES, outcome.details()
            else:
                ok += 1
                assert tokens == want
        assert ok + failed == REQUESTS
        assert 0.5 * rate * REQUESTS <= failed <= min(REQUESTS, 2 * rate * REQUESTS + 3), failed
        for node in (prefill, decode):
            st = wait_idle(node.address)
            assert [r.kv_pages_used for r in st.ranks] == [0, 0] and st.requests_in_flight == 0, st
        stopped = True
        for node in (prefill, decode):
            reports = node.stop()
            assert [r.error for r in reports] == ["", ""]
            assert len({(r.log_count, r.log_digest) for r in reports}) == 1, reports  # identical logs
            assert [r.live_requests for r in reports] == [0, 0] and reports[0].pages_used == 0
    finally:
        if not stopped:
            prefill.stop()
            decode.stop()
