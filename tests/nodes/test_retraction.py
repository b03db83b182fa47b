"""Decode retraction under memory pressure, on real processes: a decode node (pp 2) whose pool
holds a fraction of what its requests grow to retracts the newest ones (KV to host memory on
every rank, consensus DECODE_RETRACTED to resume), and every output still equals colocated
serving token for token. Retractions are counted in the node's metrics."""

from __future__ import annotations

import re
from dataclasses import replace
from urllib.request import urlopen

import grpc
import pytest

from kvbridge.common.sampling import SamplingParams
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY, in_parallel, pd_generate, start_nodes, stop_nodes, token_prompt, wait_idle

MAX_NEW = 40
D_POOL_TOKENS = 96  # 24 pages of 4; eight requests grow to about 14 pages each


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    from kvbridge.engine.config import PPConfig
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig

    nodes = start_nodes({"p": ("prefill", 1)})
    nodes["d"] = start_node(
        "decode",
        NodeConfig(
            replace(TINY, kv_cache_tokens=D_POOL_TOKENS), PPConfig(pp_size=2), transfer_backend="shm", metrics_port=0
        ),
    )
    yield nodes
    stop_nodes(nodes)


def test_retracted_requests_resume_and_equal_colocated(fleet, tiny_model):
    prompts = make_prompts(8, tiny_model.config.vocab_size, seed=5, min_len=6, max_len=20)
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)
    expected = [c.output_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))]
    p, d = fleet["p"], fleet["d"]
    results = in_parallel(
        lambda ids: pd_generate(p.address, d.address, token_prompt(ids), MAX_NEW), [(ids,) for ids in prompts]
    )
    for (tokens, _, prefill_result), want in zip(results, expected):
        assert not isinstance(prefill_result, grpc.RpcError), prefill_result
        assert tokens == want
    body = urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).read().decode()
    retractions = float(re.search(r"^kvbridge_retractions_total (\S+)$", body, re.M).group(1))
    assert retractions >= 1, body
    decided = re.findall(
        r'^kvbridge_consensus_decisions_total\{stream="decode_retracted",verdict="ready"\} (\S+)$', body, re.M
    )
    # a retracted request resumes through consensus, unless the token in flight when it was retracted
    # was its last (it then finishes without resuming): so at least one, and at most every retraction
    assert decided and 1 <= float(decided[0]) <= retractions
    for node in (p, d):
        st = wait_idle(node.address)
        assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks)
        assert not any(st.queues.values()), dict(st.queues)
