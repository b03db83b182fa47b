"""The router refuses each sampling size over its limit (tests/sampling_bounds.py) before any node
sees the request: HTTP 400 whose message names the field and the limit (error.param the field),
gRPC INVALID_ARGUMENT with the nodes' own message; a request at every limit at once goes through.
Text that is not valid Unicode (JSON's lone surrogates) in any text field is a 400 naming it."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.sampling_bounds import OVER_LIMITS, OverLimit, at_the_limits, sampling_of

PROMPT = [1, 2, 3]


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("case", OVER_LIMITS, ids=lambda c: c.name)
def test_a_size_over_its_limit_is_a_400_naming_it_and_no_node_is_called(fleet, case: OverLimit):
    router, nodes = fleet(colocated=1)
    status, body = post(router.http_port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **case.fields})
    assert status == 400
    assert body["error"] == {
        "message": case.problem,
        "type": "invalid_request_error",
        "param": case.field,
        "code": "invalid_argument",
    }
    assert nodes["colocated"][0].requests == []


@pytest.mark.parametrize("case", OVER_LIMITS, ids=lambda c: c.name)
def test_a_size_over_its_limit_is_invalid_argument_over_grpc(fleet, case: OverLimit):
    router, nodes = fleet(colocated=1)
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
    prompt = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=PROMPT))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generation_pb2.GenerateRequest(prompt=prompt, sampling=case.sampling()), timeout=30))
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "sampling." + case.problem)
    assert nodes["colocated"][0].requests == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_size_at_its_limit_at_once_goes_through(fleet, path):
    router, nodes = fleet(colocated=1)
    fields = at_the_limits(vocab=1000)
    prompt = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, body = post(router.http_port, path, {**prompt, "max_tokens": 4, **fields})
    assert status == 200, body
    [sent] = nodes["colocated"][0].requests
    want = sampling_of(fields)
    s = sent.sampling
    assert (list(s.stop), list(s.bad_words), list(s.stop_token_ids)) == (
        list(want.stop), list(want.bad_words), list(want.stop_token_ids)
    )  # fmt: skip
    assert (dict(s.logit_bias), list(s.allowed_token_ids)) == (dict(want.logit_bias), list(want.allowed_token_ids))


SURROGATE = "\ud800"
UNICODE_CASES = [
    ("bad_words", {"prompt": "x", "bad_words": ["ok", "a" + SURROGATE]}, "bad_words[1]", 1),
    ("stop", {"prompt": "x", "stop": SURROGATE}, "stop", 0),
    ("stop", {"prompt": "x", "stop": ["ok", "b" + SURROGATE]}, "stop[1]", 1),
    ("prompt", {"prompt": "a" + SURROGATE}, "prompt", 1),
    ("prompt", {"prompt": ["ok", SURROGATE]}, "prompt[1]", 0),
    ("messages", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content", 0),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages[0].content", 0),
    ("cache_salt", {"prompt": "x", "cache_salt": SURROGATE}, "cache_salt", 0),
    ("logit_bias", {"prompt": "x", "logit_bias": {SURROGATE: 1}}, "logit_bias", None),
]  # fmt: skip


@pytest.mark.parametrize(("param", "body", "name", "index"), UNICODE_CASES)
def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it(fleet, param, body, name, index):
    router, nodes = fleet(colocated=1)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, answer = post(router.http_port, path, {"max_tokens": 2, **body})  # (json.dumps escapes it: \ud800)
    assert status == 400 and answer["error"]["param"] == param, answer
    if index is None:  # a logit_bias key is a token id or nothing
        assert answer["error"]["message"] == 'logit_bias keys must be token ids, got "\\ud800"'
    else:
        assert answer["error"]["message"] == (
            f"{name} is not valid Unicode: unpaired surrogate '\\ud800' at index {index}"
        )  # fmt: skip
    assert nodes["colocated"][0].requests == []
