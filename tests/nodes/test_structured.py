"""Structured output on real nodes: 50 seeded generations over three schemas, colocated and
disaggregated (P pp 1 -> D pp 2, P pp 2 -> D pp 1), all parse and validate, and each equals the
colocated run of the same seed token for token (the decode node rebuilds the grammar's state
from the first token the prefill node sampled). Bad schemas are refused by every node."""

from __future__ import annotations

import http.client
import json

import grpc
import jsonschema
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams, to_proto
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.pd import TINY, in_parallel, pd_generate, signed_route, start_nodes, stop_nodes, token_prompt, wait_idle

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


def ref_chain(n: int) -> str:
    """The schema that overflowed llguidance's stack (n = 1500: 65 KB, JSON nesting 4): $defs a0..a{n-1},
    a_i = {"allOf": [{"$ref": a_{i+1}}]}, the last an integer."""
    defs = {f"a{i}": {"allOf": [{"$ref": f"#/$defs/a{i + 1}"}]} for i in range(n - 1)}
    schema = {"$defs": {**defs, f"a{n - 1}": {"type": "integer"}}, "$ref": "#/$defs/a0"}
    return json.dumps(schema, separators=(",", ":"))


DEEP = "json_schema nests subschemas up to 2000 deep, following its $refs (each counted once); at most 256"
BOUNDS = [  # (schema, what the refusal says): past two of common/text/schema_bounds.py's limits
    (ref_chain(1500), "json_schema has more than 2048 subschemas; at most 2048"),
    (ref_chain(1000), DEEP),
]


def bad_schema_calls(fleet, schema: str) -> list:
    """Generate on the colocated node, Prefill on a prefill node and Generate on a decode node, each
    with `schema`."""
    sampling = to_proto(SamplingParams())
    sampling.structured.json_schema = schema
    prompt = token_prompt([5, 6, 7])
    route = signed_route(9, fleet["p1"].address)
    return [
        lambda: list(generation_pb2_grpc.GenerationStub(rpc.make_channel(fleet["c1"].address)).Generate(
            generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=30)),
        lambda: prefill_pb2_grpc.PrefillStub(rpc.make_channel(fleet["p1"].address)).Prefill(
            prefill_pb2.PrefillRequest(rid="bad-schema", room=7, prompt=prompt, sampling=sampling), timeout=30),
        lambda: list(generation_pb2_grpc.GenerationStub(rpc.make_channel(fleet["d1"].address)).Generate(
            generation_pb2.GenerateRequest(rid="bad-schema-d", prompt=prompt, sampling=sampling, prefill=route),
            timeout=30)),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ('{"type": "object", "properties": ', "json_schema is not valid JSON: Expecting value"),
        ("[1, 2]", "json_schema must be a JSON object (a schema), got a JSON array"),
        ('{"type": "nosuchtype"}', "Invalid type: nosuchtype"),
        ('{"type": "integer", "minimum": 5, "maximum": 1}', "Unsatisfiable schema"),
        *BOUNDS,
    ],
    ids=["not-json", "array", "bad-type", "unsatisfiable", "1500-refs", "1000-refs-deep"],
)
def test_every_node_refuses_a_bad_schema_naming_the_problem(fleet, closing_bias, schema, says):
    for call in bad_schema_calls(fleet, schema):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured.json_schema: " in e.value.details() and says in e.value.details()
    for name, pp in (("c1", 1), ("p1", 1), ("d1", 1)):
        assert [r.kv_pages_used for r in wait_idle(fleet[name].address).ranks] == [0] * pp
    # every node still serves
    params, expected = params_for(0, closing_bias)
    responses = colocated(fleet["c1"].address, [5, 6, 7, 10], params)
    check("".join(r.text for r in responses), expected)
    tokens, responses, prefill_result = pd_generate(
        fleet["p1"].address, fleet["d1"].address, token_prompt([5, 6, 7, 10]), 0, sampling=to_proto(params)
    )
    assert not isinstance(prefill_result, grpc.RpcError), prefill_result
    assert tokens == [t for r in colocated(fleet["c1"].address, [5, 6, 7, 10], params) for t in r.token_ids]


def test_the_router_refuses_what_the_nodes_refuse_on_http_and_grpc_and_serves_on(fleet, closing_bias):
    """The router checked response_format's schema on HTTP but not a gRPC Generate's: the reported
    schema killed the router (HTTP) and both nodes of the pair (gRPC). Now each path refuses it."""
    router = start_router(
        RouterConfig(port=0, http_port=0, prefill=(fleet["p1"].address,), decode=(fleet["d1"].address,),
                     health_retry_s=0.1)
    )  # fmt: skip
    try:
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
        for schema, says in BOUNDS:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(schema)}}
            body = {"model": "tiny-random", "prompt": [5, 6, 7], "max_tokens": 4, "response_format": fmt}
            status, reply = http_post(router.http_port, body)
            assert status == 400, reply
            assert reply["error"]["message"] == f"response_format.json_schema.schema: {says}"
            sampling = to_proto(SamplingParams())
            sampling.structured.json_schema = schema
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(generation_pb2.GenerateRequest(prompt=token_prompt([5, 6, 7]), sampling=sampling),
                                   timeout=30))  # fmt: skip
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == f"sampling.structured.json_schema: {says}"
        params, expected = params_for(1, closing_bias)  # a schema within the bounds: served both ways
        request = generation_pb2.GenerateRequest(prompt=token_prompt([5, 6, 7, 11]), sampling=to_proto(params))
        answers = list(stub.Generate(request, timeout=120))
        check("".join(r.text for r in answers), expected)
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": expected}}
        body = {"model": "tiny-random", "prompt": [5, 6, 7, 11], "max_tokens": 400, "seed": 1, "temperature": 1.0,
                "logit_bias": {str(t): b for t, b in params.logit_bias}, "response_format": fmt}  # fmt: skip
        status, reply = http_post(router.http_port, body)
        assert status == 200, reply
        check(reply["choices"][0]["text"], expected)
    finally:
        router.stop(grace_s=0)


def http_post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_structured_output_and_ignore_eos_are_exclusive():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured output"):
        SamplingParams(json_object=True, ignore_eos=True)
