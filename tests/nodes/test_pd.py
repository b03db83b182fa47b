"""Disaggregated serving on real processes: outputs equal colocated serving token for token,
for every transfer engine and pairs of PP sizes; nothing is left behind on either node."""

from __future__ import annotations

import grpc
import pytest

from kvbridge.common.sampling import SamplingParams
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY, clear_cache, in_parallel, pd_generate, start_nodes, stop_nodes, token_prompt, wait_idle

BACKENDS = ("shm", "torch", "grpc")
MAX_NEW = 12


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    """Prefill nodes at pp 1, 2, 3 and decode nodes at pp 1, 2 for every engine, started once."""
    specs = {f"p{pp}": ("prefill", pp) for pp in (1, 2, 3)}
    specs |= {f"d{pp}-{b}": ("decode", pp, b) for pp in (1, 2) for b in BACKENDS}
    nodes = start_nodes(specs)
    yield nodes
    stop_nodes(nodes)


@pytest.fixture(scope="module")
def reference(tiny_model):
    prompts = make_prompts(4, tiny_model.config.vocab_size, seed=41, min_len=3, max_len=70)
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)
    outputs = [c.output_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))]
    return prompts, outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d_pp", [1, 2])
@pytest.mark.parametrize("p_pp", [1, 2, 3])
def test_disaggregated_equals_colocated(fleet, reference, p_pp, d_pp, backend):
    prefill, decode = fleet[f"p{p_pp}"], fleet[f"d{d_pp}-{backend}"]
    prompts, expected = reference
    clear_cache(prefill.address, decode.address)  # (earlier tests sent the same prompts: all would move)
    results = in_parallel(
        lambda ids: pd_generate(prefill.address, decode.address, token_prompt(ids), MAX_NEW), [(p,) for p in prompts]
    )
    for (tokens, responses, prefill_result), want, prompt in zip(results, expected, prompts):
        assert not isinstance(prefill_result, grpc.RpcError), prefill_result
        assert tokens == want
        assert responses[0].transfer.backend == backend and responses[0].transfer.kv_bytes > 0
        assert prefill_result.first_token == want[0] and prefill_result.prompt_tokens == len(prompt)
    for node in (prefill, decode):
        st = wait_idle(node.address)
        assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks)
        assert not any(st.queues.values()), dict(st.queues)


@pytest.mark.parametrize(("p_pp", "d_pp"), [(1, 1), (2, 1), (3, 2)])
def test_a_prompt_prefilled_before_the_decode_node_registers_is_handed_off_at_the_route(fleet, reference, p_pp, d_pp):
    """Registration overlaps prefill: P computes every chunk and its last rank holds the first
    token before D has even asked; the ROUTE decision then pushes it all (pp 3: from every rank)."""
    prefill, decode = fleet[f"p{p_pp}"], fleet[f"d{d_pp}-shm"]
    prompts, expected = reference
    clear_cache(prefill.address, decode.address)
    for prompt, want in zip(prompts, expected):
        tokens, responses, prefill_result = pd_generate(
            prefill.address, decode.address, token_prompt(prompt), MAX_NEW, late=True
        )
        assert not isinstance(prefill_result, grpc.RpcError), prefill_result
        assert tokens == want and prefill_result.first_token == want[0]
        assert responses[0].transfer.kv_bytes > 0
    for node in (prefill, decode):
        st = wait_idle(node.address)
        assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks)
