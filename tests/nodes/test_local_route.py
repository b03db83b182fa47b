"""A decode node's local route (router/local_prefill.py), the node's side in the default run: it
computes a prompt itself only on a route the router signed over this request's rid, and gives the
tokens the engine alone gives, a migration's continuation and n > 1 choices included, with
--decode-step-target-ms on (its steps priced by what they measurably take) and off. The router's
side with a real, busy prefill node: tests/nodes/test_local_prefill.py (long)."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY, fleet_signed, start_nodes, stop_nodes, token_prompt, wait_idle

HARD_TIMEOUT_S = 180
MAX_NEW = 12


@pytest.fixture(scope="module", params=[0.0, 1.0], ids=["budget-off", "budget-on"])
def fleet(request, hard_timeout):
    # budget on: 1 ms is under a decode step here, so a prompt beside decodes takes 4 tokens a step
    engine = replace(TINY, decode_step_target_ms=request.param, decode_step_min_prefill=4)
    nodes = start_nodes({"d": ("decode", 1, "auto", engine)})
    yield nodes
    stop_nodes(nodes)


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_a_decode_node_computes_a_prompt_only_on_a_signed_local_route(tiny_model, fleet):
    d = fleet["d"].address
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(d))
    [ids] = make_prompts(1, tiny_model.config.vocab_size, seed=43, min_len=11, max_len=11)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    [expected] = make_llm(tiny_model, chunked_prefill_size=16).generate([ids], greedy)

    def generate(rid: str, route, **fields):
        sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, n=fields.pop("n", 1))
        request = generation_pb2.GenerateRequest(
            rid=rid, prompt=token_prompt(ids), sampling=sampling, prefill=route, **fields
        )
        return list(stub.Generate(request, timeout=60))

    def local(rid: str) -> generation_pb2.PrefillRoute:  # as the router makes it: over the rid
        return fleet_signed(generation_pb2.PrefillRoute(local=True), rid.encode())

    for route in (generation_pb2.PrefillRoute(local=True), local("another")):  # unsigned; another request's
        with pytest.raises(grpc.RpcError) as refused:
            generate("one", route)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as roomed:
        generate("roomed", fleet_signed(generation_pb2.PrefillRoute(local=True, room=7), b"roomed"))
    assert roomed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "names no room" in roomed.value.details()

    # a stream decoding beside them all along: each prompt's chunks go beside its decodes (under the
    # budget, 4 tokens a step once a decode step is measured over 1 ms)
    sampling = common_pb2.SamplingParams(max_new_tokens=400, ignore_eos=True)
    beside = stub.Generate(
        generation_pb2.GenerateRequest(
            rid="beside", prompt=token_prompt(ids[:3]), sampling=sampling, prefill=local("beside")
        ),
        timeout=120,
    )
    assert tokens(generate("one", local("one"))) == expected.output_ids
    # a migration's continuation (prompt + the tokens sent) goes on where the run was
    assert tokens(generate("two", local("two"), resume_ids=expected.output_ids[:5])) == expected.output_ids[5:]
    # n > 1: the choices fork from choice 0's prompt pages here too (greedy: each the same tokens)
    both = generate("three", local("three"), n=2)
    assert [tokens(r for r in both if r.index == i) for i in (0, 1)] == [expected.output_ids] * 2
    beside.cancel()  # (or it ended: either way its pages are back below)
    st = wait_idle(d)
    assert all(r.kv_pages_used == 0 for r in st.ranks) and not any(st.queues.values())
