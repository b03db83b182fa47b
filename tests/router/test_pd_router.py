"""The router in front of prefill and decode fleets: requests spread over every node, the
official openai client works, incompatible pairs fail cleanly, the default model matches."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from safetensors.torch import save_file

from kvbridge import __version__
from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM
from kvbridge.engine.weights import TINY_CONFIG, tiny_random
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY, in_parallel, pd_generate, start_nodes, status, stop_nodes, token_prompt, wait_idle
from tests.router.fakes import wait_until


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    nodes = start_nodes(
        {"p1": ("prefill", 1), "p2": ("prefill", 2), "d1": ("decode", 2, "auto"), "d2": ("decode", 1, "auto")}
    )
    router = start_router(
        RouterConfig(
            port=0, http_port=0, prefill=(nodes["p1"].address, nodes["p2"].address),
            decode=(nodes["d1"].address, nodes["d2"].address),
            local_prefill_max_tokens=0,  # (every prompt through a prefill node: the pairs under test)
        )
    )  # fmt: skip
    yield nodes, router
    router.stop()
    stop_nodes(nodes)


def router_generate(port: int, prompt: common_pb2.Prompt, max_new_tokens: int) -> list[int]:
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{port}"))
    req = generation_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    )
    return [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]


def test_two_prefill_and_two_decode_nodes_share_the_load(tiny_model, fleet):
    nodes, router = fleet
    prompts = make_prompts(12, tiny_model.config.vocab_size, seed=51, min_len=5, max_len=80)
    expected = make_llm(tiny_model, chunked_prefill_size=16).generate(
        prompts, SamplingParams(max_new_tokens=10, ignore_eos=True)
    )
    got = in_parallel(lambda ids: router_generate(router.port, token_prompt(ids), 10), [(p,) for p in prompts])
    assert got == [c.output_ids for c in expected]
    served = {name: wait_idle(node.address).requests_served for name, node in nodes.items()}
    assert all(n > 0 for n in served.values()), served
    assert served["p1"] + served["p2"] == served["d1"] + served["d2"] == 12
    for node in nodes.values():
        st = status(node.address)
        assert all(r.kv_pages_used == 0 for r in st.ranks) and not any(st.queues.values())


def test_openai_client_chat_and_streamed_completion(tiny_model, fleet):
    openai = pytest.importorskip("openai")
    _, router = fleet
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="unused")
    llm = make_llm(tiny_model, chunked_prefill_size=16)
    tok = llm.tokenizer

    chat = client.chat.completions.create(
        model="tiny-random", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello"}]))
    [want] = llm.generate([prompt], SamplingParams(max_new_tokens=8))
    assert chat.choices[0].message.content == want.text
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == len(want.output_ids)

    pieces = [
        c.choices[0].text
        for c in client.completions.create(model="tiny-random", prompt="abc", max_tokens=8, temperature=0, stream=True)
    ]
    [want] = llm.generate([tok.encode("abc")], SamplingParams(max_new_tokens=8))
    assert "".join(pieces) == want.text and len(pieces) > 1


def other_model_dir(tmp_path: Path) -> Path:
    """A different model (another seed) saved as a Hugging Face directory: a different fingerprint."""
    other = tiny_random(seed=1)
    save_file({k: v.contiguous() for k, v in other.weights.items()}, str(tmp_path / "model.safetensors"))
    c = TINY_CONFIG
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "eos_token_id": 2,
    }))  # fmt: skip
    return tmp_path


def test_mismatched_layouts_fail_with_failed_precondition_and_both_keep_serving(fleet, tmp_path):
    nodes, _ = fleet
    odd = start_nodes({
        "page8": ("decode", 1, "auto", replace(TINY, page_size=8)),
        "other": ("decode", 1, "auto", replace(TINY, model=str(other_model_dir(tmp_path)))),
    })  # fmt: skip
    prefill = nodes["p1"]
    try:
        ids = [5, 6, 7, 8, 9]
        for name, message in (
            ("page8", "page size differs: prefill 4, decode 8"),
            ("other", "model fingerprint differs"),
        ):
            tokens, _, err = pd_generate(prefill.address, odd[name].address, token_prompt(ids), 4, timeout=30)
            assert tokens == [] and isinstance(err, grpc.RpcError)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and message in err.details()
        # a decode node of another kvbridge version: the same, naming both versions
        d2 = nodes["d2"].node
        own = d2.layout
        d2.layout = replace(own, kvbridge_version="0.0.9")
        try:
            tokens, _, err = pd_generate(prefill.address, nodes["d2"].address, token_prompt(ids), 4, timeout=30)
        finally:
            d2.layout = own
        assert tokens == [] and err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.details() == f"kvbridge version differs: prefill '{__version__}', decode '0.0.9'"
        # both sides keep serving compatible requests
        tokens, _, result = pd_generate(prefill.address, nodes["d2"].address, token_prompt(ids), 4)
        assert len(tokens) == 4 and result.first_token == tokens[0]
        other_self = odd["other"].node.ranks.model
        assert other_self.fingerprint != nodes["d2"].node.ranks.model.fingerprint
        for node in (prefill, odd["page8"], odd["other"]):
            st = wait_idle(node.address)
            assert all(r.kv_pages_used == 0 for r in st.ranks) and not any(st.queues.values())
    finally:
        stop_nodes(odd)


def post_completion(port: int, ids: list[int]) -> tuple[int, dict]:
    body = json.dumps({"model": "tiny-random", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_pair_whose_layouts_differ_is_the_fleets_fault_not_the_clients(fleet, tiny_model):
    """A decode node refusing its prefill node (page size 8 against 4) has refused the pair, not the
    request: the router tries another pair (that one left out, not either node), and with none left
    answers 503 (UNAVAILABLE) naming both nodes and the mismatch, never a 400 a client would not retry."""
    nodes, _ = fleet
    odd = start_nodes({"page8": ("decode", 1, "auto", replace(TINY, page_size=8))})
    p1, d2, page8 = nodes["p1"].address, nodes["d2"].address, odd["page8"].address
    ids = [5, 6, 7, 8, 9]
    config = RouterConfig(port=0, http_port=0, prefill=(p1,), decode=(page8,), health_retry_s=0.1)
    routers = [start_router(config), start_router(replace(config, decode=(page8, d2), routing="round_robin"))]
    alone, both = routers
    try:
        for r in routers:
            assert wait_until(lambda r=r: all(n.healthy for n in r.pool.nodes))
        got, body = post_completion(alone.http_port, ids)
        why = f"prefill/{p1} and decode/{page8} cannot serve together: page size differs: prefill 4, decode 8"
        assert (got, body["error"]["code"], body["error"]["message"]) == (503, "unavailable", why)
        with pytest.raises(grpc.RpcError) as err:
            router_generate(alone.port, token_prompt(ids), 4)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, why)
        # another decode node: the request's first attempt (round robin: page8) is retried on p1 -> d2
        [want] = make_llm(tiny_model, chunked_prefill_size=16).generate(
            [ids], SamplingParams(max_new_tokens=4, ignore_eos=True)
        )
        before = status(d2).requests_served
        got, body = post_completion(both.http_port, ids)
        assert got == 200 and body["choices"][0]["text"] == want.text
        assert status(d2).requests_served == before + 1
        registry = both.dispatcher.metrics.registry
        assert registry.get_sample_value("kvbridge_router_retries_total", {"reason": "unavailable"}) == 1.0
    finally:
        for r in routers:
            r.stop(grace_s=0)
        stop_nodes(odd)


@pytest.mark.long
def test_default_model_pp2_x_pp2_equals_colocated_on_8_chat_prompts(default_model, hard_timeout):
    config = EngineConfig(kv_cache_tokens=4096, chunked_prefill_size=64)
    nodes = start_nodes(
        {"p": ("prefill", 2)} | {f"d-{b}": ("decode", 2, b) for b in ("shm", "torch", "grpc")}, config=config
    )
    try:
        llm = LLM(config, model=default_model, progress=False)
        tok = llm.tokenizer
        questions = [
            "What is the capital of France?", "Name three colors.", "What is 2+2?", "Say hello in Spanish.",
            "What do bees make?", "Is the sun a star?", "Give me a synonym for happy.", "How many legs has a spider?",
        ]  # fmt: skip
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
        expected = [c.output_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))]
        for backend in ("shm", "torch", "grpc"):
            decode = nodes[f"d-{backend}"]
            results = in_parallel(
                lambda ids, d=decode: pd_generate(nodes["p"].address, d.address, token_prompt(ids), 24),
                [(p,) for p in prompts],
            )
            assert [r[0] for r in results] == expected, backend
            assert {r[1][0].transfer.backend for r in results} == {backend}
        assert "Paris" in tok.decode(expected[0])
        for node in nodes.values():
            st = wait_idle(node.address)
            assert all(r.kv_pages_used == 0 for r in st.ranks) and not any(st.queues.values())
    finally:
        stop_nodes(nodes)
