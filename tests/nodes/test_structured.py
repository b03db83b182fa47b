"""Structured output on real nodes: 50 seeded generations over three schemas, colocated and
disaggregated (P pp 1 -> D pp 2, P pp 2 -> D pp 1), all parse and validate, and each equals the
colocated run of the same seed token for token (the decode node rebuilds the grammar's state
from the first token the prefill node sampled). Bad schemas are refused by every node."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from common import rpc
from common.sampling import SamplingParams, to_proto
from engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from serving.config import NodeConfig
from tests.pd import TINY, in_parallel, pd_generate, start_nodes, stop_nodes, token_prompt, wait_idle

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "d"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                        "required": ["ok"], "additionalProperties": False}},
    "required": ["id", "inner"],
    "additionalProperties": False,
}  # fmt: skip
SCHEMAS = [PERSON, NESTED, None]  # None: json_object
SEEDS = range(50)


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    nodes = start_nodes(
        {"p1": ("prefill", 1), "p2": ("prefill", 2), "d1": ("decode", 1, "shm"), "d2": ("decode", 2, "shm")}
    )
    nodes["c1"] = start_node("colocated", NodeConfig(TINY, PPConfig()))
    yield nodes
    stop_nodes(nodes)


@pytest.fixture(scope="module")
def closing_bias(tiny_model):
    """The random tiny model with a taste for closing what it opens: logit_bias +6 on the tokens of a
    quote, "}" and "]" (else a free string runs on for hundreds of tokens)."""
    tok = tiny_model.tokenizer
    return tuple(sorted((tok.encode(c, add_special_tokens=False)[0], 6.0) for c in '"}]'))


def params_for(seed: int, bias) -> tuple[SamplingParams, dict]:
    schema = SCHEMAS[seed % len(SCHEMAS)]
    structured = {"json_schema": json.dumps(schema)} if schema else {"json_object": True}
    params = SamplingParams(max_new_tokens=400, temperature=1.0, seed=seed, logit_bias=bias, **structured)
    return params, schema or {"type": "object"}


def check(text: str, schema: dict) -> None:
    value = json.loads(text)
    jsonschema.Draft202012Validator(schema).validate(value)
    assert isinstance(value, dict)


def colocated(addr: str, prompt: list[int], params: SamplingParams) -> list[generation_pb2.GenerateResponse]:
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(addr))
    req = generation_pb2.GenerateRequest(prompt=token_prompt(prompt), sampling=to_proto(params))
    return list(stub.Generate(req, timeout=120))


@pytest.fixture(scope="module")
def colocated_runs(fleet, closing_bias):
    runs = in_parallel(lambda s: colocated(fleet["c1"].address, [5, 6, 7, s + 10], params_for(s, closing_bias)[0]),
                       [(s,) for s in SEEDS])  # fmt: skip
    return {s: r for s, r in zip(SEEDS, runs)}


def test_50_seeded_colocated_generations_parse_and_validate(colocated_runs, closing_bias):
    for seed, responses in colocated_runs.items():
        text = "".join(r.text for r in responses)
        assert responses[-1].finish_reason == "stop", (seed, text)  # the grammar ended it: EOS
        check(text, params_for(seed, closing_bias)[1])
    kinds = {type(json.loads("".join(r.text for r in rs)).get("name")) for rs in colocated_runs.values()}
    assert kinds == {str, type(None)}  # (person objects and the others both came)


@pytest.mark.parametrize(("p_pp", "d_pp"), [(1, 2), (2, 1)])
def test_50_seeded_disaggregated_generations_equal_colocated(fleet, colocated_runs, closing_bias, p_pp, d_pp):
    prefill, decode = fleet[f"p{p_pp}"], fleet[f"d{d_pp}"]

    def one(seed):
        params = to_proto(params_for(seed, closing_bias)[0])
        return pd_generate(prefill.address, decode.address, token_prompt([5, 6, 7, seed + 10]), 0, sampling=params)

    for seed, (tokens, responses, prefill_result) in zip(SEEDS, in_parallel(one, [(s,) for s in SEEDS])):
        assert not isinstance(prefill_result, grpc.RpcError), prefill_result
        assert tokens == [t for r in colocated_runs[seed] for t in r.token_ids]
        check("".join(r.text for r in responses), params_for(seed, closing_bias)[1])
    for node in (prefill, decode):
        assert [r.kv_pages_used for r in wait_idle(node.address).ranks] == [0] * (p_pp if node is prefill else d_pp)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ('{"type": "object", "properties": ', "json_schema is not valid JSON: Expecting value"),
        ("[1, 2]", "json_schema must be a JSON object (a schema), got a JSON array"),
        ('{"type": "nosuchtype"}', "Invalid type: nosuchtype"),
        ('{"type": "integer", "minimum": 5, "maximum": 1}', "Unsatisfiable schema"),
    ],
)
def test_every_node_refuses_a_bad_schema_naming_the_problem(fleet, schema, says):
    sampling = to_proto(SamplingParams())
    sampling.structured.json_schema = schema
    prompt = token_prompt([5, 6, 7])
    calls = [
        lambda: list(generation_pb2_grpc.GenerationStub(rpc.make_channel(fleet["c1"].address)).Generate(
            generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=30)),
        lambda: prefill_pb2_grpc.PrefillStub(rpc.make_channel(fleet["p1"].address)).Prefill(
            prefill_pb2.PrefillRequest(rid="bad-schema", room=7, prompt=prompt, sampling=sampling), timeout=30),
    ]  # fmt: skip
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured.json_schema: " in e.value.details() and says in e.value.details()
    for name in ("c1", "p1"):
        assert [r.kv_pages_used for r in wait_idle(fleet[name].address).ranks] == [0]


def test_structured_output_and_ignore_eos_are_exclusive():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured output"):
        SamplingParams(json_object=True, ignore_eos=True)
