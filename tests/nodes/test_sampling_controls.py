"""Sampling controls and logprobs on real nodes: every penalty, mask and logprob a request asks for
is the same colocated at pp 1 and pp 2 and disaggregated P pp x D pp, token for token (logprobs to
1e-4), as the one-process engine computes them."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams, to_proto
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY, in_parallel, pd_generate, start_nodes, stop_nodes, token_prompt, wait_idle

MAX_NEW = 10
CASES = {
    "greedy-logprobs": SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=5),
    "seeded-min_p-logprobs": SamplingParams(
        max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.9, seed=7, min_p=0.2, logprobs=0
    ),
    "presence-frequency": SamplingParams(
        max_new_tokens=MAX_NEW, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
    ),
    "repetition-greedy": SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.9, logprobs=2),
    "repetition-seeded": SamplingParams(
        max_new_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, seed=3, repetition_penalty=0.6
    ),
    "logit_bias": SamplingParams(
        max_new_tokens=MAX_NEW, ignore_eos=True, logit_bias=((5, 4.0), (6, 3.5), (7, -100.0)), logprobs=1
    ),
    "prompt-logprobs": SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=4, logprobs=2),
    "allowed-seeded": SamplingParams(
        max_new_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, seed=11, allowed_token_ids=tuple(range(40, 52))
    ),
}


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    nodes = start_nodes(
        {"p1": ("prefill", 1), "p2": ("prefill", 2), "d1": ("decode", 1, "shm"), "d2": ("decode", 2, "shm")}
    )
    nodes["c2"] = start_node("colocated", NodeConfig(TINY, PPConfig(pp_size=2)))
    yield nodes
    stop_nodes(nodes)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Per case: the one-process engine's (outputs, logprobs) for each prompt."""
    prompts = make_prompts(3, tiny_model.config.vocab_size, seed=5, min_len=3, max_len=40)
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)
    return prompts, {name: llm.generate(prompts, params) for name, params in CASES.items()}


def colocated(addr: str, prompt: list[int], params: SamplingParams) -> list[generation_pb2.GenerateResponse]:
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(addr))
    req = generation_pb2.GenerateRequest(prompt=token_prompt(prompt), sampling=to_proto(params))
    return list(stub.Generate(req, timeout=120))


def same_logprobs(got, want: list, k: int) -> None:
    assert [lp.token_id for lp in got] == [w.token for w in want]
    for lp, w in zip(got, want):
        assert lp.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert list(lp.top_ids) == [t for t, _ in w.top] and len(lp.top_ids) == k
        assert list(lp.top_logprobs) == pytest.approx([v for _, v in w.top], abs=1e-4)
        assert lp.rank == w.rank


def check(responses, completion, params: SamplingParams, prompt: list[int], prompt_logprobs=None) -> None:
    """`prompt_logprobs`: where they came from (disaggregated: the PrefillResponse), else the first response."""
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == completion.output_ids
    got = [lp for r in responses for lp in r.logprobs]
    if params.logprobs is None:
        assert got == []
    else:
        same_logprobs(got, completion.logprobs, params.logprobs)
    if prompt_logprobs is None:
        prompt_logprobs = responses[0].prompt_logprobs
        assert not any(r.prompt_logprobs for r in responses[1:])
    if params.prompt_logprobs is None:
        assert list(prompt_logprobs) == []
        return
    head, rest = prompt_logprobs[0], prompt_logprobs[1:]
    assert head.token_id == prompt[0] and not head.HasField("logprob")
    assert len(completion.prompt_logprobs) == len(prompt) - 1
    same_logprobs(rest, completion.prompt_logprobs, params.prompt_logprobs)


def test_the_one_process_engine_applies_each_control(reference, tiny_model):
    """Each case changes the output from the plain run the way its rule says (the rules themselves
    are checked against transformers' logits in tests/engine/test_logits_reference.py)."""
    _prompts, runs = reference
    vocab = tiny_model.config.vocab_size
    for c in runs["allowed-seeded"]:
        assert set(c.output_ids) <= set(range(40, 52))
    for c in runs["logit_bias"]:
        assert 7 not in c.output_ids
    greedy = [c.output_ids for c in runs["greedy-logprobs"]]
    # the repetition penalty lowers the prompt's tokens too: it breaks into the tiny model's text
    assert [c.output_ids for c in runs["repetition-greedy"]] != greedy
    # presence and frequency penalties lower only tokens already generated: an output that repeats
    # none is the greedy one; where greedy loops (the tiny model in float32) they break into it
    penalized = [c.output_ids for c in runs["presence-frequency"]]
    for out, plain in zip(penalized, greedy):
        if len(set(plain)) == len(plain):
            assert out == plain
    if any(len(set(plain)) < len(plain) for plain in greedy):
        assert penalized != greedy
    for c in runs["greedy-logprobs"]:
        assert len(c.logprobs) == MAX_NEW and all(len(lp.top) == 5 for lp in c.logprobs)
        assert all(lp.top[0][0] == lp.token for lp in c.logprobs)  # greedy: the token is the most likely
        assert all(0 <= t < vocab for lp in c.logprobs for t, _ in lp.top)


@pytest.mark.parametrize("case", list(CASES))
def test_colocated_pp2_equals_the_engine(fleet, reference, case):
    prompts, runs = reference
    params = CASES[case]
    results = in_parallel(lambda p: colocated(fleet["c2"].address, p, params), [(p,) for p in prompts])
    for responses, completion, prompt in zip(results, runs[case], prompts):
        check(responses, completion, params, prompt)


@pytest.mark.parametrize(("p_pp", "d_pp"), [(1, 1), (2, 2), (1, 2), (2, 1)])
@pytest.mark.parametrize("case", list(CASES))
def test_disaggregated_equals_the_engine(fleet, reference, case, p_pp, d_pp):
    """The first token (and its logprobs) comes from the prefill node, the rest from the decode
    node, whose last rank learns the first token (APPEND) for the penalties."""
    prompts, runs = reference
    params = CASES[case]
    prefill, decode = fleet[f"p{p_pp}"], fleet[f"d{d_pp}"]
    results = in_parallel(
        lambda p: pd_generate(prefill.address, decode.address, token_prompt(p), MAX_NEW, sampling=to_proto(params)),
        [(p,) for p in prompts],
    )
    for (_tokens, responses, prefill_result), completion, prompt in zip(results, runs[case], prompts):
        assert not isinstance(prefill_result, grpc.RpcError), prefill_result
        assert not any(r.prompt_logprobs for r in responses)  # (the router adds the prefill node's)
        check(responses, completion, params, prompt, prefill_result.prompt_logprobs)
    for node in (prefill, decode):
        assert [r.kv_pages_used for r in wait_idle(node.address).ranks] == [0] * len(wait_idle(node.address).ranks)


def test_token_ids_outside_the_vocabulary_are_refused(fleet):
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(fleet["c2"].address))
    for params, field in (
        (SamplingParams(allowed_token_ids=(3, 10**6)), "allowed_token_ids"),
        (SamplingParams(logit_bias=((10**6, 1.0),)), "logit_bias"),
    ):
        req = generation_pb2.GenerateRequest(prompt=token_prompt([5, 6, 7]), sampling=to_proto(params))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling.{field} holds token id 1000000, outside the vocabulary [0, 320)" in e.value.details()


def test_the_new_wire_fields_round_trip_and_malformed_ones_are_refused():
    from kvbridge.engine.batch import ForwardBatch
    from kvbridge.engine.logits import Logprob, logprob_from_proto, logprob_to_proto
    from kvbridge.pipeline.log import ADMIT, APPEND, STEP, Admitted, Appended, LogEntry, Message
    from kvbridge.v1 import common_pb2

    params = SamplingParams(logit_bias=((5, 1.5),), bad_words=("ab",), bad_words_ids=((97, 98),), logprobs=3,
                            prompt_logprobs=0, allowed_token_ids=(1, 2), json_object=True)  # fmt: skip
    batch = ForwardBatch(("a", "b"), (0, 7), (5, 1), ((3, 4), (9, 2)), (), (True, True), scored=(True, False))
    entries = (
        LogEntry(0, ADMIT, "a", params, Admitted(prompt=(1, 2, 3))),
        LogEntry(1, APPEND, "a", None, Appended((7,))),
    )
    msg = Message(STEP, entries, batch)
    assert Message.decode(msg.encode()) == msg
    bad = json.loads(msg.encode())
    bad["batch"][5] = [True]  # scored for one request of two
    with pytest.raises(ValueError, match=r"malformed pipeline message: .*different lengths"):
        Message.decode(json.dumps(bad).encode())

    lp = Logprob(7, -0.5, ((7, -0.5), (9, -1.25)), 1)
    assert logprob_from_proto(logprob_to_proto(lp), 320, 2) == lp
    for broken, says in (
        (common_pb2.TokenLogprob(token_id=400, logprob=-1.0), "token id 400 is outside the vocabulary [0, 320)"),
        (common_pb2.TokenLogprob(token_id=7, logprob=0.5), "logprobs must be numbers <= 0"),
        (common_pb2.TokenLogprob(token_id=7), "logprobs must be numbers <= 0"),
        (common_pb2.TokenLogprob(token_id=7, logprob=-1.0, top_ids=[1]), "1 alternatives with 0 logprobs; 0 asked for"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            logprob_from_proto(broken, 320, 0)
