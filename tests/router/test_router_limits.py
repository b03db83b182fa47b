"""Sizes a client controls, bounded at the router before anything expands them, against in-test
nodes: a chat's message count, a prompt's bytes against the longest context a node serves (HTTP
and gRPC alike: nothing is routed, nor tokenized), and a non-streamed answer's bytes
(--max-answer-bytes: a 400 naming it, the routed requests cancelled at the nodes). An answer's large
parts are made off the router's loop: /health answers meanwhile."""

from __future__ import annotations

import http.client
import json
import random
import threading

import grpc
import pytest

from kvbridge.router import worker
from kvbridge.router.reply import Reply
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


def health(router, timeout: float) -> int | str:
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except TimeoutError:
        return "no answer"
    finally:
        conn.close()


@pytest.mark.parametrize("stream", [True, False])
def test_health_answers_while_an_answers_large_part_is_made(fleet, monkeypatch, stream):
    """The first response of a 2,000-token prompt with prompt_logprobs 20 makes a 1.5 MB event (0.3
    s of Python and JSON, for each choice: n of them). Made on the router's loop, it held /health
    and every other request for as long; now it is made in the worker thread. Here that part is held
    until /health has answered: on the loop, /health could not answer at all."""
    router, _ = fleet(colocated=1, max_context=4096, tokens=3)
    making, answered = threading.Event(), threading.Event()
    add = Reply.add

    def held_add(reply, resp, prompt=0):
        if resp.prompt_logprobs:  # (the large part)
            making.set()
            answered.wait(timeout=30)
        return add(reply, resp, prompt)

    monkeypatch.setattr(Reply, "add", held_add)
    prompt = [random.Random(7).randrange(3, 250) for _ in range(2000)]
    body = {"prompt": prompt, "prompt_logprobs": 20, "max_tokens": 3, "stream": stream}
    out: list = []
    client = threading.Thread(target=lambda: out.append(answer(router, body, stream)))
    client.start()
    try:
        assert making.wait(timeout=30)
        assert health(router, timeout=10) == 200  # (its answer came while the part was being made)
    finally:
        answered.set()
        client.join(timeout=60)
    [(status, choice)] = out
    assert (status, choice["text"], choice["finish_reason"]) == (200, "t0 t1 t2 ", "length")
    entries = choice["prompt_logprobs"]
    assert (len(entries), entries[0]) == (2000, None)
    assert entries[1] == {
        str(prompt[1]): {"logprob": -1 / 1024, "rank": 1, "decoded_token": f"p{prompt[1]}"},
        **{str(3 + j): {"logprob": -j / 8, "rank": 1 + j, "decoded_token": f"a{j}"} for j in range(20)},
    }


def answer(router, body: dict, stream: bool) -> tuple[int, dict]:
    """(status, the answer's one choice): a stream's chunks joined (its text, prompt_logprobs and
    finish_reason) after checking that it ends with [DONE]."""
    status, raw = post_raw(router, "/v1/completions", body)
    if not stream:
        return status, json.loads(raw)["choices"][0]
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    joined = {"text": "".join(c["text"] for c in choices), "finish_reason": choices[-1]["finish_reason"]}
    return status, joined | {"prompt_logprobs": next(c["prompt_logprobs"] for c in choices if "prompt_logprobs" in c)}


def post_raw(router, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_json_pieces_join_to_json_dumps_with_long_lists_in_slices():
    entry = {"a": -0.5, "é": None, "b": [1, 2]}
    obj = {"id": "x", "choices": [{"logprobs": {"top": [entry] * 200, "short": [entry] * 3}, "n": 1.5}], "u": None}
    pieces = list(worker.json_pieces(obj))
    assert "".join(pieces) == json.dumps(obj)
    assert max(map(len, pieces)) == len(", " + json.dumps([entry] * worker.SLICE_ITEMS)[1:-1])
