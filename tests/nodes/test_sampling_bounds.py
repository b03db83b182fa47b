"""Each sampling size over its limit (tests/sampling_bounds.py) sent straight to a node, not through
the router: Generate on a colocated node, Prefill on a prefill node, Generate on a decode node (its
route to that prefill node) are INVALID_ARGUMENT naming the field and the limit, and the nodes serve
on. A request at every limit at once is served, token for token as the one-process engine samples it,
colocated and disaggregated. bad_words' token sequences are bounded too (the node's tokenizer makes them)."""

from __future__ import annotations

import secrets

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOKENS,
    SamplingError,
    SamplingParams,
    from_proto,
)
from kvbridge.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.conftest import make_llm
from tests.pd import TINY, pd_generate, signed_route, start_nodes, stop_nodes, token_prompt, wait_idle
from tests.sampling_bounds import OVER_LIMITS, OverLimit, at_the_limits, sampling_of

PROMPT = list(range(5, 25))
MAX_NEW = 8
TEXT_VOCAB = 259  # tiny-random's tokenizer: 256 bytes and 3 special tokens (its logits have 320 rows)


@pytest.fixture(scope="module")
def nodes(hard_timeout, colocated_node):
    made = start_nodes({"p": ("prefill", 1), "d": ("decode", 1, "shm")})
    yield colocated_node, made["p"], made["d"]
    stop_nodes(made)


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("where", ["colocated", "prefill", "decode"])
@pytest.mark.parametrize("case", OVER_LIMITS, ids=lambda c: c.name)
def test_a_size_over_its_limit_straight_to_a_node_is_invalid_argument(nodes, where, case: OverLimit):
    c, p, d = nodes
    prompt, sampling = token_prompt(PROMPT), case.sampling(MAX_NEW)
    if where == "prefill":
        req = prefill_pb2.PrefillRequest(rid="over", room=secrets.randbits(62) + 1, prompt=prompt, sampling=sampling)
        got = refusal(lambda: prefill_pb2_grpc.PrefillStub(rpc.make_channel(p.address)).Prefill(req, timeout=30))
    else:
        req = generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling)
        if where == "decode":
            req.prefill.CopyFrom(signed_route(secrets.randbits(62) + 1, p.address))
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel((c if where == "colocated" else d).address))
        got = refusal(lambda: list(stub.Generate(req, timeout=30)))
    assert got == (grpc.StatusCode.INVALID_ARGUMENT, "sampling." + case.problem)


@pytest.fixture(scope="module")
def at_limits(tiny_model) -> tuple[generation_pb2.GenerateRequest, list[int]]:
    """A request with every size at its limit (seeded sampling, so that the masks decide a lot), and
    the tokens the one-process engine samples for it."""
    sampling = sampling_of(at_the_limits(TEXT_VOCAB), MAX_NEW)
    sampling.temperature, sampling.seed = 1.0, 7
    tok = tiny_model.tokenizer
    params = from_proto(sampling).with_bad_words_ids(lambda t: tok.encode(t, add_special_tokens=False))
    [want] = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size).generate([PROMPT], params)
    assert len(want.output_ids) == MAX_NEW and max(want.output_ids) < TEXT_VOCAB
    return generation_pb2.GenerateRequest(prompt=token_prompt(PROMPT), sampling=sampling), want.output_ids


def test_every_size_at_its_limit_is_served_colocated_as_the_engine_samples_it(nodes, at_limits):
    c, _, _ = nodes
    req, want = at_limits
    responses = list(generation_pb2_grpc.GenerationStub(rpc.make_channel(c.address)).Generate(req, timeout=120))
    assert [t for r in responses for t in r.token_ids] == want
    assert responses[-1].finish_reason == "length"


def test_every_size_at_its_limit_is_served_disaggregated_as_the_engine_samples_it(nodes, at_limits):
    _, p, d = nodes
    req, want = at_limits
    tokens, responses, result = pd_generate(p.address, d.address, req.prompt, MAX_NEW, sampling=req.sampling)
    assert not isinstance(result, grpc.RpcError), result
    assert (tokens, responses[-1].finish_reason) == (want, "length")
    for node in (p, d):
        assert [r.kv_pages_used for r in wait_idle(node.address).ranks] == [0]


def test_bad_words_token_sequences_are_bounded_at_the_node():
    one = SamplingParams(bad_words=("ab",))
    with pytest.raises(SamplingError) as err:
        one.with_bad_words_ids(lambda text: [7] * (MAX_BAD_WORD_TOKENS + len(text)))
    assert err.value.field == "bad_words"
    assert (
        str(err.value)
        == f"sampling.bad_words: a word is {MAX_BAD_WORD_TOKENS + 3} tokens; at most {MAX_BAD_WORD_TOKENS}"
    )
    many = SamplingParams(bad_words=tuple(f"w{i}" for i in range(MAX_BAD_WORDS)))
    per_word = MAX_BAD_WORDS_TOKENS // (2 * MAX_BAD_WORDS) + 1  # every sequence within its own limit
    with pytest.raises(SamplingError) as err:
        many.with_bad_words_ids(lambda text: [len(text), *map(ord, text)] + [1] * (per_word - 1 - len(text)))
    total = 2 * MAX_BAD_WORDS * per_word
    assert str(err.value) == f"sampling.bad_words: {total} tokens in all; at most {MAX_BAD_WORDS_TOKENS}"
    assert one.with_bad_words_ids(lambda text: [ord(ch) for ch in text]).bad_words_ids == ((97, 98), (32, 97, 98))
