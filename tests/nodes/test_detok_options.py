"""skip_special_tokens and include_stop_str_in_output on a colocated node over gRPC: both change the
text a client receives, the streamed deltas joined are the final text, and it is the colocated
engine's (engine/llm.py) text for the same request.

tiny-random's greedy output reaches its EOS (<|im_end|>, id 2) for some prompts: the case is one of
those, run with ignore_eos (the EOS mid-output) and without (the EOS ends it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams, to_proto
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY

MAX_NEW = 24
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def llm(tiny_model):
    return make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)


@pytest.fixture(scope="module")
def case(llm, tiny_model) -> tuple[list[int], list[int], int]:
    """(prompt, greedy output with ignore_eos, index of its first EOS): an EOS after some text."""
    [eos] = tiny_model.config.eos_token_ids
    prompts = make_prompts(64, tiny_model.config.vocab_size, seed=0, min_len=3, max_len=40)
    runs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for prompt, c in zip(prompts, runs):
        j = c.output_ids.index(eos) if eos in c.output_ids else -1
        # some plain text before the EOS, for a stop string to be taken from
        if 4 <= j < 16 and any(ch.isalnum() for ch in llm.tokenizer.decode(c.output_ids[:j])):
            return prompt, c.output_ids, j
    raise AssertionError("no greedy output reaches EOS after some text")


def generate(addr: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[str], str]:
    """(tokens, text deltas, finish reason) as a client of the node receives them."""
    req = generation_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=prompt)), sampling=to_proto(params)
    )
    responses = list(generation_pb2_grpc.GenerationStub(rpc.make_channel(addr)).Generate(req, timeout=60))
    return [t for r in responses for t in r.token_ids], [r.text for r in responses], responses[-1].finish_reason


def test_both_options_change_the_text_a_client_receives(colocated_node, llm, case):
    prompt, run, j = case
    tok = llm.tokenizer
    base = SamplingParams(max_new_tokens=MAX_NEW)
    head = tok.decode(run[:j], skip_special_tokens=False)  # the text before the EOS
    stop = next(ch for ch in head if ch.isalnum())  # a stop string from that text
    at = head.index(stop)
    mid = replace(base, ignore_eos=True)  # the EOS mid-output
    cases = [  # params, (tokens, text) the client must get
        (mid, (run, tok.decode(run))),
        (replace(mid, skip_special_tokens=False), (run, tok.decode(run, skip_special_tokens=False))),
        (base, (run[: j + 1], tok.decode(run[:j]))),
        (replace(base, skip_special_tokens=False), (run[: j + 1], head)),
        (replace(base, skip_special_tokens=False, include_stop_str_in_output=True), (run[: j + 1], head + IM_END)),
        (replace(base, stop=(stop,)), (None, head[:at])),
        (replace(base, stop=(stop,), include_stop_str_in_output=True), (None, head[: at + len(stop)])),
    ]
    texts = []
    for params, (tokens, want) in cases:
        got_tokens, deltas, reason = generate(colocated_node.address, prompt, params)
        [ref] = llm.generate([prompt], params)  # the colocated engine's
        text, ending = "".join(deltas), "length" if params.ignore_eos else "stop"
        assert (text, reason) == (ref.text, ref.finish_reason) == (want, ending), params
        assert got_tokens == ref.output_ids and (tokens is None or got_tokens == tokens), params
        # streamed with its tokens: the last delta adds at most an unfinished character, after the
        # bytes held back while the text ended in U+FFFD (how many deltas carry the rest depends on
        # how fast the client reads: tokens queued meanwhile go as one)
        assert len(deltas[-1].rstrip("\ufffd")) <= 1, (params, deltas)
        texts.append(text)
    # each option changed the text
    assert IM_END in texts[1] and IM_END not in texts[0] and texts[0] != texts[1]
    assert texts[4] == texts[3] + IM_END and IM_END not in texts[3]
    assert texts[6] == texts[5] + stop
