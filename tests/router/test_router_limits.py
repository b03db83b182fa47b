"""Sizes a client controls, bounded at the router before anything expands them, against in-test
nodes: a chat's message count, a prompt's bytes against the longest context a node serves (HTTP
and gRPC alike: nothing is routed, nor tokenized), and a non-streamed answer's bytes
(--max-answer-bytes: a 400 naming it, the routed requests cancelled at the nodes)."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from kvbridge.v1 import common_pb2, generation_pb2
from tests.router.fakes import router_stub, wait_until

EMPTY = {"role": "user", "content": ""}  # 4 bytes as the limits count them (role and content)


def post(router, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def bad_request(message: str, param: str) -> tuple[int, dict]:
    return 400, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                           "code": "invalid_argument"}}  # fmt: skip


def grpc_refusal(router, prompt: common_pb2.Prompt) -> tuple[grpc.StatusCode, str]:
    req = generation_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=2))
    with pytest.raises(grpc.RpcError) as e:
        list(router_stub(router).Generate(req, timeout=30))
    return e.value.code(), e.value.details()


def chat(count: int) -> common_pb2.Prompt:
    messages = [common_pb2.ChatMessage(role="user", content="")] * count
    return common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=messages))


def test_32000_empty_chat_messages_are_refused_by_their_count_before_anything_runs(fleet):
    router, nodes = fleet(colocated=1, kv_events=True, max_context=1 << 12)  # prompts up to 128 KiB
    node = nodes["colocated"][0]
    body = {"messages": [EMPTY] * 32_000, "max_tokens": 2}  # 128,000 bytes: their bytes would pass
    refused = bad_request("messages lists 32000 messages; at most 4096", "messages")
    assert post(router, "/v1/chat/completions", body) == refused
    assert post(router, "/tokenize", {"messages": body["messages"]}) == refused
    assert grpc_refusal(router, chat(32_000)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "prompt.chat has 32000 messages; at most 4096"
    )  # fmt: skip
    assert (node.requests, node.tokenizer_calls) == ([], 0)  # nothing routed, nothing tokenized
    status, answer = post(router, "/v1/chat/completions", {"messages": [EMPTY] * 4096, "max_tokens": 2})
    assert (status, answer["choices"][0]["message"]["content"]) == (200, "t0 t1 ")  # (the limit itself passes)
    assert post(router, "/v1/chat/completions", {"messages": [EMPTY] * 4097, "max_tokens": 2}) == bad_request(
        "messages lists 4097 messages; at most 4096", "messages"
    )


def test_a_prompt_that_cannot_fit_the_context_by_its_size_is_refused_at_the_router(fleet):
    router, nodes = fleet(colocated=1, kv_events=True)  # a context of 64 tokens: prompts up to 2048 bytes
    node = nodes["colocated"][0]
    over = "prompt.text has 2049 bytes; a prompt that fits the context of 64 tokens has at most 2048"
    assert post(router, "/v1/completions", {"prompt": "é" * 1024 + "x", "max_tokens": 2}) == bad_request(over, "prompt")
    assert post(router, "/v1/completions", {"prompt": ["ok", "x" * 2049], "max_tokens": 2}) == bad_request(
        "prompt[1]: " + over, "prompt"
    )
    assert post(router, "/v1/chat/completions", {"messages": [EMPTY] * 600, "max_tokens": 2}) == bad_request(
        "prompt.chat has 2400 bytes; a prompt that fits the context of 64 tokens has at most 2048", "messages"
    )
    assert grpc_refusal(router, common_pb2.Prompt(text="x" * 2049)) == (grpc.StatusCode.INVALID_ARGUMENT, over)
    full = "prompt has 64 tokens; the context holds 64"  # (token ids: counted before anything per token)
    assert post(router, "/v1/completions", {"prompt": [7] * 64, "max_tokens": 2}) == bad_request(full, "prompt")
    ids = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[7] * 64))
    assert grpc_refusal(router, ids) == (grpc.StatusCode.INVALID_ARGUMENT, full)
    assert (node.requests, node.tokenizer_calls) == ([], 0)
    status, answer = post(router, "/v1/completions", {"prompt": "x" * 2048, "max_tokens": 2})
    assert (status, answer["choices"][0]["text"], len(node.requests)) == (200, "t0 t1 ", 1)


@pytest.mark.parametrize(("prompts", "n"), [(1, 1), (2, 2)])
def test_a_non_streamed_answer_past_max_answer_bytes_is_400_naming_it_and_ends_upstream(fleet, prompts, n):
    router, nodes = fleet(colocated=1, tokens=100_000, router={"max_answer_bytes": 4000})
    node = nodes["colocated"][0]
    body = {"prompt": [[1, 2, 3]] * prompts, "n": n}  # every routed request: 100,000 tokens "t0 t1 ..." (~700 KB)
    message = (
        'the answer exceeds --max-answer-bytes (4000 bytes) of a non-streamed answer; ask for it with "stream": true'
    )
    assert post(router, "/v1/completions", body) == bad_request(message, None)
    assert wait_until(lambda: len(node.cancelled) == prompts and router.dispatcher.num_in_flight() == 0)
    assert node.completed == []


def test_answers_within_max_answer_bytes_and_streamed_answers_of_any_size_go_out_whole(fleet):
    router, nodes = fleet(colocated=1, router={"max_answer_bytes": 4000})
    text = "".join(f"t{i} " for i in range(500))  # 2,390 bytes
    status, answer = post(router, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 500})
    assert (status, answer["choices"][0]["text"]) == (200, text)
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=60)
    body = {"prompt": [1, 2, 3], "max_tokens": 2000, "stream": True}  # ~200 KB of events
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    events = [line[6:] for line in resp.read().decode().split("\n\n") if line.startswith("data: ")]
    conn.close()
    chunks = [json.loads(e) for e in events[:-1]]
    assert (resp.status, events[-1]) == (200, "[DONE]")
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(f"t{i} " for i in range(2000))
    assert router.dispatcher.num_in_flight() == 0 and nodes["colocated"][0].cancelled == []
