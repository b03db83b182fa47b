"""OpenAI JSON <-> kvbridge.v1 translation, without any server."""

from __future__ import annotations

import contextlib
import json

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.v1 import common_pb2, generation_pb2
from router.openai_api import BadRequest, Reply, error_body, parse_request


def parse(chat: bool = False, **body):
    return parse_request(json.dumps(body).encode(), chat=chat)


def test_completion_fields_map_to_the_request():
    r = parse(
        model="m",
        prompt="hello",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=3,
        stop=["\n", "END"],
        stream=True,
        stream_options={"include_usage": True},
        stop_token_ids=[2],
        ignore_eos=True,
        user="ignored",
    )
    assert (r.model, r.stream, r.include_usage, r.chat) == ("m", True, True, False)
    s = r.request.sampling
    assert r.request.prompt.text == "hello"
    assert (s.max_new_tokens, s.top_k, s.seed, list(s.stop), list(s.stop_token_ids)) == (7, 40, 3, ["\n", "END"], [2])
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9) and s.ignore_eos
    assert not r.request.rid and not r.request.HasField("prefill")


def test_unset_fields_leave_the_server_defaults():
    s = parse(prompt=[1, 2]).request.sampling
    assert s == common_pb2.SamplingParams()


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([5, 6], common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[5, 6]))),
        (["hi"], common_pb2.Prompt(text="hi")),
        ([[7]], common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[7]))),
    ],
)
def test_prompt_forms(prompt, expected):
    assert parse(prompt=prompt).request.prompt == expected


def test_chat_messages_and_content_parts():
    r = parse(
        chat=True,
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ],
        max_completion_tokens=5,
        max_tokens=9,
        stop="x",
        top_k=-1,
    )
    msgs = [(m.role, m.content) for m in r.request.prompt.chat.messages]
    assert msgs == [("system", "be brief"), ("user", "ab"), ("assistant", "")]
    assert r.request.sampling.max_new_tokens == 5 and list(r.request.sampling.stop) == ["x"]
    assert r.request.sampling.top_k == 0


@pytest.mark.parametrize(
    ("chat", "body", "param", "message"),
    [
        (False, b"{", None, "not valid JSON"),
        (False, b"[1]", None, "must be a JSON object, got [1]"),
        (False, b"\xff", None, "not valid JSON"),
        (False, b"[" * 100000, None, "not valid JSON"),
        (False, {"prompt": ""}, "prompt", "prompt is empty"),
        (False, {"prompt": []}, "prompt", "got []"),
        (False, {"prompt": ["a", "b"]}, "prompt", "one prompt"),
        (False, {"prompt": [1, -1]}, "prompt", "out of range: -1"),
        (False, {"prompt": [True]}, "prompt", "got [true]"),
        (False, {"prompt": "x", "n": 2}, "n", "n must be 1 (one choice per request), got 2"),
        (False, {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be an integer in [1, 4294967295]"),
        (False, {"prompt": "x", "max_tokens": 1.5}, "max_tokens", "got 1.5"),
        (False, {"prompt": "x", "temperature": -0.1}, "temperature", "in [0, 2], got -0.1"),
        (False, b'{"prompt": "x", "temperature": NaN}', "temperature", "got nan"),
        (False, {"prompt": "x", "temperature": "hot"}, "temperature", 'got "hot"'),
        (False, {"prompt": "x", "top_p": 0}, "top_p", "top_p must be a number in (0, 1], got 0"),
        (False, {"prompt": "x", "top_k": -2}, "top_k", "got -2"),
        (False, {"prompt": "x", "seed": -1}, "seed", "got -1"),
        (False, {"prompt": "x", "seed": 2**64}, "seed", "got 18446744073709551616"),
        (False, {"prompt": "x", "stop": [""]}, "stop", "stop must be a non-empty string"),
        (False, {"prompt": "x", "stop": ["a"] * 17}, "stop", "17 strings"),
        (False, {"prompt": "x", "stream": "yes"}, "stream", 'got "yes"'),
        (False, {"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options", "include_usage"),
        (False, {"prompt": "x", "echo": True}, "echo", "echo is not supported"),
        (False, {"prompt": "x", "logprobs": 2}, "logprobs", "logprobs is not supported"),
        (False, {"prompt": "x", "model": 5}, "model", "model must be a string, got 5"),
        (True, {"messages": []}, "messages", "messages must be a non-empty list"),
        (True, {"messages": [{"role": "tool", "content": "x"}]}, "messages", "messages[0].role must be"),
        (True, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "text parts"),
        (True, {"messages": ["hi"]}, "messages", 'messages[0] must be an object, got "hi"'),
        (True, {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs", "not supported"),
    ],
)
def test_bad_bodies_are_rejected_naming_the_field(chat, body, param, message):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(BadRequest) as err:
        parse_request(raw, chat=chat)
    assert message in str(err.value)
    assert err.value.param == param


def json_values(max_leaves: int = 8):
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    return st.recursive(
        scalars,
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
        max_leaves=max_leaves,
    )


FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "n", "stream", "stream_options", "stop_token_ids", "ignore_eos", "echo", "logprobs",
]  # fmt: skip


def bodies(chat: bool):
    """A valid body with up to two fields replaced by arbitrary JSON, or arbitrary JSON."""
    base = {"model": "m", "max_tokens": 4}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    mutated = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=2).map(lambda d: base | d)
    return st.tuples(st.just(chat), mutated | JSON)


JSON = json_values()


@settings(max_examples=600, deadline=None)  # 600 bodies
@given(case=bodies(True) | bodies(False))
def test_any_json_body_parses_or_is_a_bad_request(case):
    chat, body = case
    try:
        r = parse_request(json.dumps(body).encode(), chat=chat)
    except BadRequest as e:
        assert str(e)
        return
    s = r.request.sampling  # what passed is in range
    assert 0 <= s.temperature <= 2 and 0 <= s.top_p <= 1 and s.max_new_tokens >= 0
    assert r.request.prompt.WhichOneof("kind") in (("chat",) if chat else ("text", "token_ids"))


@settings(max_examples=500, deadline=None)  # 500 byte strings
@given(raw=st.binary(max_size=64))
def test_any_bytes_parse_or_are_a_bad_request(raw):
    with contextlib.suppress(BadRequest):  # anything else fails the test
        parse_request(raw, chat=False)


def responses(*texts: str, finish: str = "length") -> list[generation_pb2.GenerateResponse]:
    out = [generation_pb2.GenerateResponse(rid="r", token_ids=[i], text=t) for i, t in enumerate(texts)]
    out.append(
        generation_pb2.GenerateResponse(
            rid="r", finish_reason=finish, usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=len(texts))
        )
    )
    return out


def test_chat_stream_chunks_then_usage():
    reply = Reply(parse(chat=True, messages=[{"role": "user", "content": "q"}], stream_options={"include_usage": True}),
                  "r", "m", created=1)  # fmt: skip
    chunks = [c for c in (reply.add(r) for r in responses("He", "", "llo")) if c is not None]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": "He"}, {"content": "llo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert chunks[0]["id"] == "chatcmpl-r" and chunks[0]["object"] == "chat.completion.chunk"
    assert all(c["usage"] is None for c in chunks)
    assert reply.usage_chunk()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert reply.final()["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}


def test_completion_final_body():
    reply = Reply(parse(prompt="q"), "r", "m", created=1)
    for r in responses("a", "b", finish="stop"):
        reply.add(r)
    assert reply.usage_chunk() is None
    assert reply.final() == {
        "id": "cmpl-r",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_status_codes_map_to_http(code, status):
    got, body = error_body(code, "why", "p")
    assert got == status
    assert body["error"]["message"] == "why" and body["error"]["code"] == code.name.lower()
    assert body["error"]["param"] == "p"
