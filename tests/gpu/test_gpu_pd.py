"""Disaggregated serving on one GPU: a prefill node and a decode node of two pipeline ranks each,
every rank on the same GPU (bf16), give a colocated node's greedy tokens on that GPU, and the KV
moves by cuda_ipc; on the default model and on tiny-random (the --quick case). On CPU: tiny-random
in the CPU's default dtype, bf16 on AVX-512, by shm.
Requests go one at a time: a bf16 matmul on a GPU may round differently at another batch size,
and batching invariance is not what is checked here."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.engine import kernels
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.engine.weights import load_model
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.conftest import make_prompts
from tests.engine.test_hf_parity import CHAT_PROMPTS
from tests.pd import TINY, pd_generate, start_nodes, stop_nodes, token_prompt, wait_idle

HARD_TIMEOUT_S = 180  # (a hang dumps every thread's stack before gpu_check.sh's 330 s, not its --quick 100 s)
MAX_NEW = 16
TIMEOUTS = {"bootstrap_timeout_s": 45.0, "prealloc_timeout_s": 45.0, "transfer_timeout_s": 45.0}  # fail, not hang
CONFIGS = {  # case (tests/gpu/conftest.py) -> every node's engine
    "cuda": EngineConfig(device="cuda", page_size=16, kv_cache_tokens=8192, chunked_prefill_size=32, **TIMEOUTS),
    "cuda-tiny": dataclasses.replace(TINY, device="cuda", **TIMEOUTS),
    "cpu": dataclasses.replace(TINY, device="cpu"),
}
EXPECTED = {  # case -> (the backend the decode node picks, the pools' dtype)
    "cuda": ("cuda_ipc", "bfloat16"),
    "cuda-tiny": ("cuda_ipc", "bfloat16"),
    "cpu": ("shm", "bfloat16" if kernels.bf16_linear() else "float32"),
}
PAIRS = [(2, 2), (1, 1)]  # (prefill pp, decode pp); on a GPU pp 1 tells a pipeline fault from a hand-off fault
PAIRS_ON = {"cuda": PAIRS, "cuda-tiny": PAIRS, "cpu": PAIRS[:1]}  # (tests/nodes/test_pd.py has pp 1 -> 1 on CPU)


def prompts_for(case: str) -> list[list[int]]:
    config = CONFIGS[case]
    model = load_model(config.model, progress=False)
    if config.model == TINY.model:
        return make_prompts(3, model.config.vocab_size, seed=7, min_len=5, max_len=60)
    tok = model.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in CHAT_PROMPTS[:4]]


@pytest.fixture(scope="module")
def fleet(case, hard_timeout):
    """A colocated node (pp 1), and the prefill and decode nodes (auto backend) of the case's pairs."""
    config = CONFIGS[case]
    colocated = start_node("colocated", NodeConfig(config, PPConfig()))
    try:
        specs = {f"p{p}": ("prefill", p, config) for p, _ in PAIRS_ON[case]}
        specs |= {f"d{d}": ("decode", d, "auto", config) for _, d in PAIRS_ON[case]}
        nodes = start_nodes(specs, config) | {"colocated": colocated}
    except BaseException:
        colocated.stop()
        raise
    yield nodes
    stop_nodes(nodes)


@pytest.fixture(scope="module")
def reference(case, fleet):
    """The prompts and the colocated node's greedy tokens for each, one request at a time."""
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(fleet["colocated"].address))
    sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    prompts, outputs = prompts_for(case), []
    for ids in prompts:
        req = generation_pb2.GenerateRequest(prompt=token_prompt(ids), sampling=sampling)
        outputs.append([t for r in stub.Generate(req, timeout=60) for t in r.token_ids])
    return prompts, outputs


@pytest.mark.parametrize(("p_pp", "d_pp"), PAIRS, ids=[f"p{p}-d{d}" for p, d in PAIRS])
def test_disaggregated_on_one_device_equals_colocated(case, fleet, reference, p_pp, d_pp):
    if (p_pp, d_pp) not in PAIRS_ON[case]:
        pytest.skip(f"pp {p_pp} -> {d_pp} on {case} is tests/nodes/test_pd.py's")
    prefill, decode = fleet[f"p{p_pp}"], fleet[f"d{d_pp}"]
    backend, dtype = EXPECTED[case]
    for prompt, want in zip(*reference):
        assert len(want) == MAX_NEW
        ids = token_prompt(prompt)
        tokens, responses, prefill_result = pd_generate(prefill.address, decode.address, ids, MAX_NEW, timeout=60)
        assert not isinstance(prefill_result, grpc.RpcError), prefill_result
        assert tokens == want
        assert responses[0].transfer.backend == backend and responses[0].transfer.kv_bytes > 0
        assert prefill_result.first_token == want[0] and prefill_result.prompt_tokens == len(prompt)
    layout = prefill_pb2_grpc.BootstrapStub(rpc.make_channel(prefill.address)).GetLayout(
        prefill_pb2.GetLayoutRequest(nonce=bytes(16)), timeout=10
    )
    assert layout.layout.dtype == dtype
    for node in (prefill, decode):
        st = wait_idle(node.address)
        assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks)
        assert not any(st.queues.values()), dict(st.queues)
