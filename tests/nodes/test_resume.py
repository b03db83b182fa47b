"""A migrated request's continuation at the nodes (GenerateRequest/PrefillRequest.resume_ids): a
node given the first k output tokens of a run goes on with exactly the rest of it, colocated and
disaggregated at every P pp x D pp here, greedy and seeded (randomness by token index), its text
continuing the text the client has; bad resume_ids are refused by each node service called
directly; two halves that disagree on them fail, and nothing is left behind."""

from __future__ import annotations

import secrets

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.text.detok import TextStream
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.pd import TINY, signed_route, start_nodes, stop_nodes, token_prompt, wait_idle

PROMPT = [(7 * j) % 250 + 3 for j in range(10)]
N = 24  # output tokens of every run
RESUME_AT = (1, 6, 13, N - 1)  # 10 + 6 = 16: the continuation's prompt ends on a page boundary (page 4)
SAMPLINGS = {
    "greedy": common_pb2.SamplingParams(max_new_tokens=N, ignore_eos=True),
    "seeded": common_pb2.SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=0.9, top_p=0.95, seed=3),
    "stop": common_pb2.SamplingParams(max_new_tokens=N, min_tokens=N, temperature=0.7, seed=9, stop=["zz"]),
}  # ("stop": its seed is the first from 9 whose text suits the stop test: `stop_sampling`)
SHAPES = ("colocated-1", "colocated-2", "1-1", "2-2", "2-1")  # colocated pp, or P pp - D pp


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    nodes = start_nodes(
        {f"p{pp}": ("prefill", pp) for pp in (1, 2)} | {f"d{pp}": ("decode", pp, "shm") for pp in (1, 2)}
    )
    for pp in (1, 2):
        nodes[f"c{pp}"] = start_node("colocated", NodeConfig(TINY, PPConfig(pp_size=pp)))
    yield nodes
    stop_nodes(nodes)


def generate(fleet, shape: str, sampling, resume: list[int] = (), rid: str = "") -> list:
    """The responses of one request served by `shape` (the router's two calls when disaggregated)."""
    rid = rid or secrets.token_hex(6)
    req = generation_pb2.GenerateRequest(rid=rid, prompt=token_prompt(PROMPT), sampling=sampling, resume_ids=resume)
    if shape.startswith("colocated"):
        addr = fleet[f"c{shape[-1]}"].address
        return list(generation_pb2_grpc.GenerationStub(rpc.make_channel(addr)).Generate(req, timeout=60))
    p, d = (fleet[f"{role}{pp}"].address for role, pp in zip("pd", shape.split("-")))
    room = secrets.randbits(63)
    preq = prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=req.prompt, sampling=sampling, resume_ids=resume)
    prefilled = prefill_pb2_grpc.PrefillStub(rpc.make_channel(p)).Prefill.future(preq, timeout=60)
    req.prefill.CopyFrom(signed_route(room, p))
    responses = list(generation_pb2_grpc.GenerationStub(rpc.make_channel(d)).Generate(req, timeout=60))
    assert prefilled.result().first_token == responses[0].token_ids[0]
    return responses


def summary(responses) -> tuple:
    last = responses[-1]
    tokens = [t for r in responses for t in r.token_ids]
    return (
        tokens,
        "".join(r.text for r in responses),
        last.finish_reason,
        last.usage.prompt_tokens,
        last.usage.completion_tokens,
    )


def stop_pair(tokenizer, tokens: list[int], text: str) -> tuple[int, str] | None:
    """The two characters across tokens 12 and 13 as a stop string, and where the text is cut, if
    they occur nowhere before and are whole characters (else the run does not suit the test)."""
    head = tokenizer.decode(tokens[:13])
    cut, stop = len(head), text[len(head) - 1 : len(head) + 1]
    return (cut, stop) if text.startswith(head) and text.find(stop) == cut - 1 and "\ufffd" not in stop else None


@pytest.fixture(scope="module")
def stop_sampling(fleet, tiny_model):
    """SAMPLINGS["stop"] with the first seed from 9 whose run has a stop pair (the model's random
    text depends on the dtype the CPU computes in)."""
    params = common_pb2.SamplingParams()
    params.CopyFrom(SAMPLINGS["stop"])
    for seed in range(9, 60):
        params.seed = seed
        tokens, text, *_ = summary(generate(fleet, "colocated-1", params))
        if stop_pair(tiny_model.tokenizer, tokens, text):
            return params
    pytest.fail("no seed in 9..59 gives a stop pair")


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_continuation_is_the_rest_of_the_run(fleet, tiny_model, stop_sampling, shape, sampling):
    params = stop_sampling if sampling == "stop" else SAMPLINGS[sampling]
    tokens, text, reason, prompt_tokens, completion = summary(generate(fleet, shape, params))
    assert (len(tokens), reason, prompt_tokens, completion) == (N, "length", len(PROMPT), N)
    if sampling == "stop":  # again, with a stop string the text holds only across tokens 12 and 13
        cut, stop = stop_pair(tiny_model.tokenizer, tokens, text)
        params = common_pb2.SamplingParams()
        params.CopyFrom(stop_sampling)
        params.min_tokens = 14  # (EOS held back where it was before; the stop string counts at token 13)
        params.stop[:] = [stop]
        # it ends the output at the first token whose text completes it (14 or later: a byte-level
        # tokenizer's character shows when its last byte does)
        decode = tiny_model.tokenizer.decode
        n = next(n for n in range(14, N + 1) if stop in decode(tokens[:n]))
        full_tokens, full = tokens, text
        tokens, text, reason, *_ = summary(generate(fleet, shape, params))
        assert (tokens, reason, text) == (full_tokens[:n], "stop", full[: cut - 1])
    for k in (k for k in RESUME_AT if k < len(tokens)):
        had = TextStream(tiny_model.tokenizer, tuple(params.stop), params.min_tokens)
        sent = "".join(had.push(t) for t in tokens[:k])  # the text a client of the first attempt had
        got = summary(generate(fleet, shape, params, tokens[:k]))
        assert got == (tokens[k:], text[len(sent) :], reason, len(PROMPT), len(tokens)), k
        assert text.startswith(sent)
    for node in fleet.values():
        st = wait_idle(node.address)
        assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks) and not any(st.queues.values())


@pytest.mark.parametrize("service", ["colocated", "decode", "prefill"])
@pytest.mark.parametrize(
    ("resume", "message"),
    [
        ([5] * 8, "resume_ids has 8 tokens: max_new_tokens=8 leaves none to generate"),
        ([5, 99999], "resume_ids token id 99999 is out of range [0, 320)"),
    ],
)
def test_bad_resume_ids_sent_straight_to_a_node_are_invalid_argument(fleet, service, resume, message):
    sampling = common_pb2.SamplingParams(max_new_tokens=8)
    prompt, rid = token_prompt(PROMPT), secrets.token_hex(6)
    if service == "prefill":
        call = prefill_pb2_grpc.PrefillStub(rpc.make_channel(fleet["p1"].address)).Prefill
        req = prefill_pb2.PrefillRequest(rid=rid, room=7, prompt=prompt, sampling=sampling, resume_ids=resume)
        run = lambda: call(req, timeout=30)  # noqa: E731
    else:
        addr = fleet["c1" if service == "colocated" else "d1"].address
        req = generation_pb2.GenerateRequest(rid=rid, prompt=prompt, sampling=sampling, resume_ids=resume)
        if service == "decode":
            req.prefill.CopyFrom(signed_route(7, fleet["p1"].address))
        run = lambda: list(generation_pb2_grpc.GenerationStub(rpc.make_channel(addr)).Generate(req, timeout=30))  # noqa: E731
    with pytest.raises(grpc.RpcError) as err:
        run()
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    # the node serves on, with nothing held
    assert (
        summary(generate(fleet, "colocated-1" if service == "colocated" else "1-1", SAMPLINGS["greedy"]))[2] == "length"
    )


def test_halves_that_disagree_on_the_resumed_tokens_fail_with_failed_precondition(fleet):
    """P is told 8 resumed tokens (18 tokens: 5 pages), D none (10 tokens: 3 pages): P refuses D's
    registration instead of pushing KV that D would read as another sequence."""
    p, d = fleet["p1"].address, fleet["d1"].address
    rid, room, sampling = secrets.token_hex(6), secrets.randbits(63), SAMPLINGS["greedy"]
    preq = prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=token_prompt(PROMPT), sampling=sampling)
    preq.resume_ids.extend(range(5, 13))
    prefilled = prefill_pb2_grpc.PrefillStub(rpc.make_channel(p)).Prefill.future(preq, timeout=60)
    dreq = generation_pb2.GenerateRequest(rid=rid, prompt=token_prompt(PROMPT), sampling=sampling)
    dreq.prefill.CopyFrom(signed_route(room, p))
    stream = generation_pb2_grpc.GenerationStub(rpc.make_channel(d)).Generate(dreq, timeout=60)
    with pytest.raises(grpc.RpcError) as err:
        prefilled.result()
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"room {room}: the decode node registered 3 pages; the prompt here (18 tokens, 8 of them resumed outputs) "
        "needs 5",
    )
    stream.cancel()  # (what the router does when P fails before D's first response)
    for addr in (p, d):
        st = wait_idle(addr)
        assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks) and not any(st.queues.values())
