"""min_tokens and ignore_eos on every path: the colocated LLM, PP nodes at pp 1 and 2, prefill pp 1/2 x
decode pp 1/2 through real nodes, and the router's streamed OpenAI chat.

tiny-random's greedy output contains its EOS (id 2) for some prompts: the cases are built from those,
so that ignore_eos and min_tokens change the output. The colocated LLM is checked against the rule
computed from teacher-forced logits (LLM.score), every other path against the colocated LLM.
"""

from __future__ import annotations

import http.client
import json
import secrets
from dataclasses import replace

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams, to_proto
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.pipeline.group import RankGroup
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY, in_parallel, signed_route, start_nodes, stop_nodes, token_prompt, wait_idle

MAX_NEW = 24
EOS = 2  # tiny-random's <|im_end|>


@pytest.fixture(scope="module")
def llm(tiny_model):
    assert tiny_model.config.eos_token_ids == (EOS,)
    return make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)


def greedy_by_the_rule(llm, prompt: list[int], p: SamplingParams) -> tuple[list[int], str]:
    """(tokens, finish reason) of greedy decoding from teacher-forced logits, one token at a time:
    EOS (unless ignore_eos) and stop_token_ids masked while fewer than min_tokens are out."""
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    out: list[int] = []
    while len(out) < p.max_new_tokens:
        logits = llm.score(prompt + out)[-1].clone()
        if len(out) < p.min_tokens:
            logits[sorted(stops)] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            return out, "stop"
    return out, "length"


def eos_prompts(llm, n: int) -> list[tuple[list[int], list[int]]]:
    """n (prompt, greedy output with ignore_eos) pairs whose output has EOS among its first 16 tokens."""
    prompts = make_prompts(64, llm.model.config.vocab_size, seed=0, min_len=3, max_len=40)
    runs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    found = [(p, c.output_ids) for p, c in zip(prompts, runs) if EOS in c.output_ids[:16]]
    assert len(found) >= n, f"only {len(found)} of 64 prompts reach EOS"
    return found[:n]


@pytest.fixture(scope="module")
def cases(llm) -> list[tuple[list[int], SamplingParams]]:
    """(prompt, params) whose outputs depend on ignore_eos / min_tokens."""
    found = eos_prompts(llm, 3)
    out = []
    for prompt, run in found:
        j = run.index(EOS)
        out += [
            (prompt, SamplingParams(max_new_tokens=MAX_NEW)),  # ends at that EOS
            (prompt, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)),  # runs past it
            (prompt, SamplingParams(max_new_tokens=MAX_NEW, min_tokens=j + 2)),  # held back past it
        ]
    prompt, run = found[0]
    # a stop token that greedy decoding picks first: the prefill node's token 0 is held back too
    out.append((prompt, SamplingParams(max_new_tokens=MAX_NEW, min_tokens=5, stop_token_ids=(run[0],))))
    out.append((prompt, SamplingParams(max_new_tokens=MAX_NEW, min_tokens=MAX_NEW)))
    # sampled (seeded): the two likeliest tokens of each step, the greedy run's first four as stop tokens
    stops = tuple(sorted(set(run[:4])))
    sampled = [SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=2, seed=s, stop_token_ids=stops)
               for s in range(40)]  # fmt: skip
    early = [sp for sp, c in zip(sampled, llm.generate([prompt] * 40, sampled)) if len(c.output_ids) < 6]
    assert len(early) >= 2, "no seed stops early"
    out += [(prompt, replace(sp, min_tokens=8)) for sp in early[:2]]
    return out


@pytest.fixture(scope="module")
def expected(llm, cases) -> list[tuple[list[int], str]]:
    return [(c.output_ids, c.finish_reason) for c in llm.generate([p for p, _ in cases], [sp for _, sp in cases])]


def test_colocated_follows_the_rule(llm, cases, expected):
    for (prompt, p), (ids, finish) in zip(cases, expected):
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
        assert not stops & set(ids[: p.min_tokens]), p
        if p.greedy:
            assert (ids, finish) == greedy_by_the_rule(llm, prompt, p), p
        if p.ignore_eos:
            assert len(ids) == MAX_NEW and finish == "length" and EOS in ids
    plain, ignoring, held = expected[:3]
    assert plain[0][-1] == EOS and plain[1] == "stop" and len(plain[0]) < MAX_NEW
    assert ignoring[0][: len(plain[0])] == plain[0]  # the same tokens, then on past the EOS
    assert len(held[0]) > len(plain[0]) and held[0][: len(plain[0]) - 1] == plain[0][:-1]
    *_, sampled_a, sampled_b = zip(cases, expected)
    for (_, p), (ids, _) in (sampled_a, sampled_b):
        assert len(ids) > p.min_tokens  # where the same seed without min_tokens stopped before 6


def test_min_tokens_is_checked():
    with pytest.raises(ValueError, match="min_tokens must be in"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens must be in"):
        SamplingParams(min_tokens=-1)
    unset = SamplingParams(max_new_tokens=0, min_tokens=500)  # unset: resolved at the node
    assert unset.resolved(10, 4096, 128).max_new_tokens == 500
    assert SamplingParams(max_new_tokens=0).resolved(10, 4096, 128).max_new_tokens == 128
    assert SamplingParams(max_new_tokens=0).resolved(4000, 4096, 128).max_new_tokens == 96
    assert SamplingParams(max_new_tokens=0).resolved(10, 4096, 0).max_new_tokens == 4086
    assert SamplingParams(max_new_tokens=7).resolved(10, 4096, 128).max_new_tokens == 7


def test_unset_max_new_tokens_is_the_rest_of_the_context_capped(tiny_model):
    llm = make_llm(tiny_model, max_context=40, max_default_tokens=16)
    short, long = llm.generate([[5] * 10, [5] * 30], SamplingParams(max_new_tokens=0, ignore_eos=True))
    assert (len(short.output_ids), len(long.output_ids)) == (16, 10)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_pp_node_equals_colocated(hard_timeout, cases, expected, pp_size):
    config = EngineConfig(model="tiny-random", page_size=TINY.page_size, kv_cache_tokens=8192,
                          chunked_prefill_size=TINY.chunked_prefill_size)  # fmt: skip
    node = RankGroup(config, PPConfig(pp_size=pp_size), progress=False)
    try:
        got = node.generate([p for p, _ in cases], [sp for _, sp in cases])
    finally:
        node.shutdown()
    assert [(c.output_ids, c.finish_reason) for c in got] == expected


# ---------------------------------------------------------------- disaggregated


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    specs = {"p1": ("prefill", 1), "p2": ("prefill", 2), "d1": ("decode", 1, "shm"), "d2": ("decode", 2, "shm")}
    nodes = start_nodes(specs)
    yield nodes
    stop_nodes(nodes)


def pd_run(p_addr: str, d_addr: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """What the router does for one request (D.Generate and P.Prefill at once): (tokens, finish reason)."""
    rid, room = secrets.token_hex(8), secrets.randbits(63)
    sampling = to_proto(params)
    prefill = prefill_pb2_grpc.PrefillStub(rpc.make_channel(p_addr)).Prefill.future(
        prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=token_prompt(prompt), sampling=sampling), timeout=120
    )
    req = generation_pb2.GenerateRequest(
        rid=rid,
        prompt=token_prompt(prompt),
        sampling=sampling,
        prefill=signed_route(room, p_addr),
    )
    responses = list(generation_pb2_grpc.GenerationStub(rpc.make_channel(d_addr)).Generate(req, timeout=120))
    first = prefill.result()
    assert not isinstance(first, grpc.RpcError)
    tokens = [t for r in responses for t in r.token_ids]
    assert first.first_token == tokens[0]
    return tokens, responses[-1].finish_reason


@pytest.mark.parametrize("d_pp", [1, 2])
@pytest.mark.parametrize("p_pp", [1, 2])
def test_disaggregated_equals_colocated(fleet, cases, expected, p_pp, d_pp):
    prefill, decode = fleet[f"p{p_pp}"], fleet[f"d{d_pp}"]
    got = in_parallel(lambda p, sp: pd_run(prefill.address, decode.address, p, sp), cases)
    assert got == expected
    for node in (prefill, decode):
        st = wait_idle(node.address)
        assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks)


# ---------------------------------------------------------------- the router's streamed OpenAI chat


def stream_chat(port: int, body: dict) -> tuple[str, str, int]:
    """(text, finish_reason, usage.completion_tokens) of a streamed chat completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    text, finish, usage = "", "", None
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    conn.close()
    return text, finish, usage["completion_tokens"]


def test_streamed_chat_through_the_router_with_p_and_d(llm, fleet):
    tok = llm.tokenizer
    chats = ([{"role": "user", "content": f"question {i}"}] for i in range(100))
    runs = ((m, llm.generate([tok.encode(tok.apply_chat_template(m))], SamplingParams(max_new_tokens=32))[0])
            for m in chats)  # fmt: skip
    messages, plain = next((m, c) for m, c in runs if c.finish_reason == "stop" and len(c.output_ids) < 16)
    prompt = tok.encode(tok.apply_chat_template(messages))
    bodies = [
        {"max_tokens": 32},
        {"max_tokens": 32, "ignore_eos": True},
        {"max_tokens": 32, "min_tokens": len(plain.output_ids) + 4},
    ]
    want = []
    for b in bodies:
        p = SamplingParams(max_new_tokens=32, ignore_eos=b.get("ignore_eos", False), min_tokens=b.get("min_tokens", 0))
        [c] = llm.generate([prompt], p)
        want.append((c.text, c.finish_reason, len(c.output_ids)))
    assert want[1][1:] == ("length", 32) and want[0][1] == "stop" and want[2][2] > want[0][2]
    nodes = fleet
    router = start_router(
        RouterConfig(port=0, http_port=0, prefill=(nodes["p1"].address, nodes["p2"].address),
                     decode=(nodes["d1"].address, nodes["d2"].address), health_retry_s=0.1)
    )  # fmt: skip
    try:
        for _ in range(2):  # the router picks the least loaded pair: both rounds spread over the pairs
            got = [stream_chat(router.http_port, {"messages": messages, "temperature": 0, **b}) for b in bodies]
            assert got == want
    finally:
        router.stop(grace_s=0)


def test_stop_token_ids_outside_the_vocabulary_are_not_masked():
    import torch

    from kvbridge.engine.request import Request
    from kvbridge.engine.sampler import sample

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    req = Request("r", [1], SamplingParams(min_tokens=2, stop_token_ids=(1, 10**9)), None)
    assert sample(logits, [req], eos_token_ids=(3,))[0] == [2]  # 1 and EOS 3 held back; 10**9 is no row
    assert sample(logits, [req], eos_token_ids=(3,))[0] == [2]
    assert sample(logits, [req], eos_token_ids=(3,))[0] == [1]  # min_tokens are out
    assert logits[0, 1] == 3.0  # the caller's logits are left as they were
