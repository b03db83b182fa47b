"""OpenAI JSON <-> kvbridge.v1 translation, without any server."""

from __future__ import annotations

import contextlib
import json

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.router.failures import RouteError
from kvbridge.router.openai_api import BadRequest, error_body, parse_request
from kvbridge.router.reply import Reply
from kvbridge.v1 import common_pb2, generation_pb2


def parse(chat: bool = False, **body):
    return parse_request(json.dumps(body).encode(), chat=chat)


def whole(req, resps, prompts=None, **kw) -> dict:
    """The non-streamed answer to `req` (stream unset) made of `resps` (of prompt 0, or `prompts`)."""
    reply = Reply(req, "r", "m", created=1, **kw)
    for i, r in enumerate(resps):
        assert reply.add(r, prompts[i] if prompts else 0) is None  # (kept, not a chunk)
    return json.loads("".join(reply.final()))


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


def test_unset_fields_take_openai_defaults():
    for r in (parse(prompt=[1, 2]), parse(chat=True, messages=[{"role": "user", "content": "x"}])):
        s = r.request.sampling
        # temperature 1.0 (sampled); max_new_tokens 0: the rest of the context, resolved at the node
        assert s == common_pb2.SamplingParams(temperature=1.0)
    assert parse(prompt="x", temperature=0).request.sampling.temperature == 0
    assert parse(prompt="x", temperature=None).request.sampling.temperature == 1.0


def test_min_tokens_and_the_output_neutral_fields_are_accepted():
    s = parse(prompt="x", max_tokens=9, min_tokens=9, ignore_eos=False).request.sampling
    assert (s.min_tokens, s.max_new_tokens) == (9, 9)
    assert parse(prompt="x", min_tokens=3).request.sampling.min_tokens == 3  # without max_tokens: checked at the node
    neutral = {"user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "priority": 1,
               "parallel_tool_calls": True, "stream_options": {"include_usage": False}, "request_id": "r"}  # fmt: skip
    at_default = {"echo": False, "best_of": 1, "logprobs": None, "presence_penalty": 0.0, "frequency_penalty": 0,
                  "repetition_penalty": 1.0, "length_penalty": 1, "min_p": 0, "top_a": 0, "typical_p": 1.0,
                  "logit_bias": {}, "tools": [], "tool_choice": "none", "functions": [], "function_call": "auto",
                  "response_format": {"type": "text"}, "skip_special_tokens": True,
                  "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "guided_json": None,
                  "use_beam_search": False, "bad_words": [], "suffix": "", "modalities": ["text"]}  # fmt: skip
    parse(prompt="x", **neutral, **at_default, add_special_tokens=True)
    parse(chat=True, messages=[{"role": "user", "content": "x"}], **neutral, **at_default, top_logprobs=0,
          add_generation_prompt=True, continue_final_message=False, add_special_tokens=False, chat_template_kwargs={},
          stop_token_ids=[2])  # fmt: skip


BOTH = [
    ("best_of", 2), ("length_penalty", 0.9), ("use_beam_search", True),
    ("top_a", 0.2), ("typical_p", 0.9), ("logits_processors", ["m.f"]),
    ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["a", "b"]),
    ("guided_grammar", "root ::= x"), ("guided_whitespace_pattern", " "),
    ("return_tokens_as_token_ids", True), ("return_token_ids", True), ("vllm_xargs", {"a": 1}),
    ("structural_tag", "{}"), ("structured_outputs", {"regex": "a"}),
    ("regex", "a"), ("json_schema", "{}"), ("ebnf", "x"), ("stop_regex", ["a"]),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}), ("functions", [{"name": "f"}]),
    ("function_call", {"name": "f"}), ("suffix", "end"),
    ("spaces_between_special_tokens", False),
    ("truncate_prompt_tokens", 5), ("prompt_embeds", "AAAA"), ("reasoning_effort", "high"), ("verbosity", "low"),
    ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]), ("web_search_options", {}),
    ("spaces_between_special_tokens", 1),  # the JSON type counts: 1 is not true
]  # fmt: skip
CHAT_ONLY = [("echo", True), ("add_special_tokens", True), ("chat_template", "{{ x }}"), ("documents", [{"text": "d"}])]
COMPLETION_ONLY = [("add_special_tokens", False), ("top_logprobs", 3)]


@pytest.mark.parametrize(
    ("chat", "name", "value"),
    [(c, n, v) for c in (False, True) for n, v in BOTH]
    + [(True, n, v) for n, v in CHAT_ONLY]
    + [(False, n, v) for n, v in COMPLETION_ONLY],
)
def test_every_unimplemented_output_changing_field_is_refused_by_name(chat, name, value):
    body = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    with pytest.raises(BadRequest) as err:
        parse(chat=chat, **body, **{name: value})
    assert str(err.value).startswith(f"{name} is not supported, got ") and err.value.param == name


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
        (False, {"prompt": ["a", ""]}, "prompt", "prompt[1] is empty"),
        (False, {"prompt": ["a", [1, 2], [7, True]]}, "prompt", "prompt[2] must be a non-empty string"),
        (False, {"prompt": ["a"] * 65}, "prompt", "prompt lists 65 prompts; at most 64"),
        (False, {"prompt": ["a", ["b"]]}, "prompt", 'or token-id list (or a list of them), got ["b"]'),
        (False, {"prompt": [1, -1]}, "prompt", "out of range: -1"),
        (False, {"prompt": [True]}, "prompt", "got [true]"),
        (False, {"prompt": "x", "n": 0}, "n", "n must be an integer in [1, 16], got 0"),
        (False, {"prompt": "x", "n": 17}, "n", "n must be an integer in [1, 16], got 17"),
        (False, {"prompt": ["x"] * 20, "n": 13}, "n", "20 prompts x n=13 is 260 choices; at most 256"),
        (True, {"messages": [{"role": "user", "content": "q"}], "n": 2.0}, "n", "in [1, 16], got 2.0"),
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
        (True, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo", "echo is not supported"),
        (False, {"prompt": "x", "echo": 1}, "echo", "echo must be a boolean, got 1"),
        (False, {"prompt": "x", "model": 5}, "model", "model must be a string, got 5"),
        (False, {"prompt": "x", "min_tokens": -1}, "min_tokens", "min_tokens must be an integer in [0, 4294967295]"),
        (False, {"prompt": "x", "min_tokens": "3"}, "min_tokens", 'got "3"'),
        (
            False,
            {"prompt": "x", "max_tokens": 4, "min_tokens": 5},
            "min_tokens",
            "min_tokens (5) must be <= max_tokens (4)",
        ),
        (True, {"messages": []}, "messages", "messages must be a non-empty list"),
        (True, {"messages": [{"role": "tool", "content": "x"}]}, "messages", "messages[0].role must be"),
        (True, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "text parts"),
        (True, {"messages": ["hi"]}, "messages", 'messages[0] must be an object, got "hi"'),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "logprobs": 3},
            "logprobs",
            "logprobs must be a boolean, got 3",
        ),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "top_logprobs must be an integer in [0, 20], got 21",
        ),
        (False, {"prompt": "x", "logprobs": True}, "logprobs", "logprobs must be an integer in [0, 20], got true"),
        (
            False,
            {"prompt": "x", "presence_penalty": 2.5},
            "presence_penalty",
            "presence_penalty must be a number in [-2, 2], got 2.5",
        ),
        (
            False,
            {"prompt": "x", "frequency_penalty": "1"},
            "frequency_penalty",
            'frequency_penalty must be a number in [-2, 2], got "1"',
        ),
        (
            False,
            {"prompt": "x", "repetition_penalty": 0},
            "repetition_penalty",
            "repetition_penalty must be a number in (0, 2], got 0",
        ),
        (False, {"prompt": "x", "min_p": 1.5}, "min_p", "min_p must be a number in [0, 1], got 1.5"),
        (False, {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", 'logit_bias keys must be token ids, got "a"'),
        (
            False,
            {"prompt": "x", "logit_bias": {"5": 101}},
            "logit_bias",
            "logit_bias[5] must be a number in [-100, 100], got 101",
        ),
        (
            False,
            {"prompt": "x", "bad_words": ["ok", ""]},
            "bad_words",
            'bad_words must be a list of non-empty strings, got ["ok", ""]',
        ),
        (
            False,
            {"prompt": "x", "allowed_token_ids": []},
            "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of token ids, got []",
        ),
        (
            False,
            {"prompt": "x", "skip_special_tokens": 0},
            "skip_special_tokens",
            "skip_special_tokens must be a boolean, got 0",
        ),
        (
            False,
            {"prompt": "x", "response_format": {"type": "yaml"}},
            "response_format",
            "response_format.type must be text, json_object or json_schema",
        ),
        (
            False,
            {"prompt": "x", "response_format": {"type": "json_schema"}},
            "response_format",
            "response_format.json_schema.schema must be an object, got null",
        ),
        (
            True,
            {
                "messages": [{"role": "user", "content": "x"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            "continue_final_message",
            "continue_final_message needs add_generation_prompt: false",
        ),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
            "chat_template_kwargs",
            "chat_template_kwargs must be an object",
        ),
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
    "seed", "stop", "n", "stream", "stream_options", "stop_token_ids", "ignore_eos", "min_tokens", "echo", "logprobs",
    "tools", "tool_choice", "response_format", "skip_special_tokens", "chat_template_kwargs", "presence_penalty",
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
    assert not s.max_new_tokens or s.min_tokens <= s.max_new_tokens
    assert r.request.prompt.WhichOneof("kind") in (("chat",) if chat else ("text", "token_ids"))


@settings(max_examples=500, deadline=None)  # 500 byte strings
@given(raw=st.binary(max_size=64))
def test_any_bytes_parse_or_are_a_bad_request(raw):
    with contextlib.suppress(BadRequest):  # anything else fails the test
        parse_request(raw, chat=False)


def responses(*texts: str, finish: str = "length", cached: int = 0) -> list[generation_pb2.GenerateResponse]:
    out = [generation_pb2.GenerateResponse(rid="r", token_ids=[i], text=t) for i, t in enumerate(texts)]
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=len(texts), cached_tokens=cached)
    out.append(generation_pb2.GenerateResponse(rid="r", finish_reason=finish, usage=usage))
    return out


def test_chat_stream_chunks_then_usage():
    reply = Reply(parse(chat=True, messages=[{"role": "user", "content": "q"}], stream=True,
                        stream_options={"include_usage": True}), "r", "m", created=1)  # fmt: skip
    chunks = [c for c in (reply.add(r) for r in responses("He", "", "llo")) if c is not None]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": "He"}, {"content": "llo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert chunks[0]["id"] == "chatcmpl-r" and chunks[0]["object"] == "chat.completion.chunk"
    assert all(c["usage"] is None for c in chunks)
    assert reply.usage_chunk()["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}
    }  # fmt: skip
    out = whole(parse(chat=True, messages=[{"role": "user", "content": "q"}]), responses("He", "", "llo"))
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}


def test_completion_final_body():
    reply = Reply(parse(prompt="q"), "r", "m", created=1)
    for r in responses("a", "b", finish="stop", cached=2):
        reply.add(r)
    assert reply.usage_chunk() is None
    assert json.loads("".join(reply.final())) == {
        "id": "cmpl-r",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 2}},
    }  # fmt: skip


def test_cache_salt_is_a_non_empty_string_of_at_most_256_bytes():
    assert parse(prompt="x", cache_salt="tenant-a").request.cache_salt == "tenant-a"
    assert parse(chat=True, messages=[{"role": "user", "content": "x"}], cache_salt="é" * 128).request.cache_salt
    assert parse(prompt="x").request.cache_salt == ""
    for bad in ("", 5, ["a"]):
        with pytest.raises(BadRequest, match=r"^cache_salt must be a non-empty string, got ") as err:
            parse(prompt="x", cache_salt=bad)
        assert err.value.param == "cache_salt"
    with pytest.raises(BadRequest, match=r"^cache_salt is 258 UTF-8 bytes; at most 256$") as err:
        parse(prompt="x", cache_salt="é" * 129)
    assert err.value.param == "cache_salt"


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


def test_sampling_controls_map_to_the_wire():
    s = parse(
        prompt="x", logprobs=3, prompt_logprobs=2, presence_penalty=-0.5, frequency_penalty=1.25,
        repetition_penalty=1.5, min_p=0.05, logit_bias={"5": -100, "17": 2.5}, bad_words=["foo bar", "baz"],
        allowed_token_ids=[9, 4, 9], skip_special_tokens=False, include_stop_str_in_output=True,
        response_format={"type": "json_object"},
    ).request.sampling  # fmt: skip
    assert (s.logprobs, s.prompt_logprobs, s.presence_penalty, s.frequency_penalty) == (3, 2, -0.5, 1.25)
    assert (s.repetition_penalty, round(s.min_p, 6)) == (1.5, 0.05)
    assert dict(s.logit_bias) == {5: -100.0, 17: 2.5}
    assert list(s.bad_words) == ["foo bar", "baz"] and list(s.allowed_token_ids) == [9, 4, 9]
    assert (s.skip_special_tokens, s.include_stop_str_in_output, s.structured.json_object) == (False, True, True)
    plain = parse(prompt="x").request.sampling
    assert not plain.HasField("logprobs") and not plain.HasField("skip_special_tokens")
    assert parse(prompt="x", no_stop_trim=True).request.sampling.include_stop_str_in_output
    assert parse(prompt="x", logprobs=0).request.sampling.logprobs == 0  # (0: the token's own, no alternatives)
    assert parse(prompt="x", logprobs=0).request.sampling.HasField("logprobs")

    chat = parse(chat=True, messages=[{"role": "user", "content": "q"}], logprobs=True, top_logprobs=4)
    assert chat.request.sampling.logprobs == 4
    assert not parse(chat=True, messages=[{"role": "user", "content": "q"}], logprobs=False).request.sampling.HasField(
        "logprobs"
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    assert json.loads(parse(prompt="x", response_format=fmt).request.sampling.structured.json_schema) == schema


def test_chat_template_options_map_to_the_wire():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    c = parse(chat=True, messages=msgs, continue_final_message=True, add_generation_prompt=False,
              chat_template_kwargs={"enable_thinking": False, "n": 3}).request.prompt.chat  # fmt: skip
    assert (c.add_generation_prompt, c.continue_final_message) == (False, True)
    assert json.loads(c.chat_template_kwargs) == {"enable_thinking": False, "n": 3}
    plain = parse(chat=True, messages=msgs).request.prompt.chat
    assert not plain.HasField("add_generation_prompt") and not plain.continue_final_message
    assert not parse(chat=True, messages=msgs, add_generation_prompt=False).request.prompt.chat.add_generation_prompt


def _lp(token_id, token, logprob, top):
    return common_pb2.TokenLogprob(
        token_id=token_id, token=token, logprob=logprob, top_ids=[t[0] for t in top],
        top_tokens=[t[1] for t in top], top_logprobs=[t[2] for t in top],
    )  # fmt: skip


def test_logprobs_in_chat_and_completion_answers():
    a = _lp(7, "Hé", -0.25, [(7, "Hé", -0.25), (8, "x", -2.0)])
    b = _lp(9, "!", -1.5, [(3, "?", -0.5), (9, "!", -1.5)])
    first = generation_pb2.GenerateResponse(token_ids=[7], text="Hé", logprobs=[a])
    last = generation_pb2.GenerateResponse(token_ids=[9], text="!", logprobs=[b], finish_reason="length")

    chat_req = {"messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 2}
    chat = Reply(parse(chat=True, stream=True, **chat_req), "r", "m", created=1)
    c1, c2 = chat.add(first), chat.add(last)
    entry_a = {
        "token": "Hé",
        "logprob": -0.25,
        "bytes": [72, 195, 169],
        "top_logprobs": [
            {"token": "Hé", "logprob": -0.25, "bytes": [72, 195, 169]},
            {"token": "x", "logprob": -2.0, "bytes": [120]},
        ],
    }
    entry_b = {"token": "!", "logprob": -1.5, "bytes": [33], "top_logprobs": [
        {"token": "?", "logprob": -0.5, "bytes": [63]}, {"token": "!", "logprob": -1.5, "bytes": [33]}]}  # fmt: skip
    assert c1["choices"][0]["logprobs"] == {"content": [entry_a], "refusal": None}
    assert c2["choices"][0]["logprobs"] == {"content": [entry_b], "refusal": None}
    assert whole(parse(chat=True, **chat_req), [first, last])["choices"][0]["logprobs"] == {
        "content": [entry_a, entry_b], "refusal": None
    }  # fmt: skip

    stream = Reply(parse(prompt="q", logprobs=2, stream=True), "r", "m", created=1)
    s1, s2 = stream.add(first), stream.add(last)
    assert s1["choices"][0]["logprobs"] == {
        "tokens": ["Hé"], "token_logprobs": [-0.25], "top_logprobs": [{"Hé": -0.25, "x": -2.0}], "text_offset": [0]
    }  # fmt: skip
    assert s2["choices"][0]["logprobs"]["text_offset"] == [2]  # after "Hé"
    assert whole(parse(prompt="q", logprobs=2), [first, last])["choices"][0]["logprobs"] == {
        "tokens": ["Hé", "!"], "token_logprobs": [-0.25, -1.5],
        "top_logprobs": [{"Hé": -0.25, "x": -2.0}, {"?": -0.5, "!": -1.5}], "text_offset": [0, 2],
    }  # fmt: skip
    plain = Reply(parse(prompt="q", stream=True), "r", "m", created=1)
    assert plain.add(first)["choices"][0]["logprobs"] is None
    assert whole(parse(prompt="q"), [first, last])["choices"][0]["logprobs"] is None


def test_echo_puts_the_prompt_and_its_logprobs_first():
    head = common_pb2.TokenLogprob(token_id=1, token="Hi")  # the prompt's first token: no logprob
    second = _lp(2, " you", -3.0, [(5, " there", -1.0)])
    out = _lp(9, "!", -1.5, [(9, "!", -1.5)])
    resp = generation_pb2.GenerateResponse(
        token_ids=[9], text="!", logprobs=[out], prompt_logprobs=[head, second], finish_reason="length"
    )
    body = {"prompt": "Hi you", "echo": True, "logprobs": 1, "max_tokens": 1}
    req = parse(**body, stream=True)
    assert (req.echo, req.request.sampling.prompt_logprobs, req.request.sampling.logprobs) == (True, 1, 1)
    reply = Reply(req, "r", "m", created=1, echo=["Hi you"])
    chunk = reply.add(resp)
    assert chunk["choices"][0]["text"] == "Hi you!"
    want = {
        "tokens": ["Hi", " you", "!"], "token_logprobs": [None, -3.0, -1.5],
        "top_logprobs": [None, {" there": -1.0}, {"!": -1.5}], "text_offset": [0, 2, 6],
    }  # fmt: skip
    assert chunk["choices"][0]["logprobs"] == want
    out = whole(parse(**body), [resp], echo=["Hi you"])["choices"][0]
    assert (out["text"], out["logprobs"]) == ("Hi you!", want)
    assert not parse(prompt="Hi", echo=True).request.sampling.HasField("prompt_logprobs")  # (text only)
    plain = Reply(parse(prompt="Hi", echo=True, stream=True), "r", "m", created=1, echo=["Hi"])
    assert plain.add(generation_pb2.GenerateResponse(token_ids=[9], text="!"))["choices"][0]["text"] == "Hi!"


def test_prompt_logprobs_as_vllm_shows_them():
    head = common_pb2.TokenLogprob(token_id=1, token="Hi")
    second = _lp(2, " you", -3.0, [(5, " there", -1.0), (2, " you", -3.0)])
    second.rank = 2
    resp = generation_pb2.GenerateResponse(
        token_ids=[9], text="!", prompt_logprobs=[head, second], finish_reason="stop"
    )
    req = parse(prompt=[1, 2], prompt_logprobs=2)
    assert req.request.sampling.prompt_logprobs == 2 and not req.request.sampling.HasField("logprobs")
    want = [None, {"2": {"logprob": -3.0, "rank": 2, "decoded_token": " you"},
                   "5": {"logprob": -1.0, "rank": 1, "decoded_token": " there"}}]  # fmt: skip
    stream = Reply(parse(prompt=[1, 2], prompt_logprobs=2, stream=True), "r", "m", created=1)
    assert stream.add(resp)["choices"][0]["prompt_logprobs"] == want
    out = whole(req, [resp])["choices"][0]
    assert (out["prompt_logprobs"], out["logprobs"], out["text"]) == (want, None, "!")
    assert "prompt_logprobs" not in whole(parse(prompt="q"), [resp])["choices"][0]


def test_choices_of_a_prompt_list_are_numbered_prompt_times_n_plus_index():
    reply = Reply(parse(prompt=["a", "b"], n=2, logprobs=1, stream=True), "r", "m", created=1)
    lp = _lp(9, "!", -1.5, [(9, "!", -1.5)])
    resps, prompts = [], []
    for prompt, index, text, completion in ((1, 1, "D", 3), (0, 0, "A", 1), (1, 0, "C", 2), (0, 1, "B", 4)):
        resp = generation_pb2.GenerateResponse(index=index, token_ids=[9], text=text, logprobs=[lp],
                                               finish_reason="length")  # fmt: skip
        resp.usage.prompt_tokens, resp.usage.completion_tokens = 5 + prompt, completion
        resp.usage.cached_tokens = 4 if index == 0 else 0
        chunk = reply.add(resp, prompt)
        assert chunk["choices"][0]["index"] == prompt * 2 + index and chunk["choices"][0]["text"] == text
        resps.append(resp)
        prompts.append(prompt)
    reply.check_complete()
    out = whole(parse(prompt=["a", "b"], n=2, logprobs=1), resps, prompts)
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "A"), (1, "B"), (2, "C"), (3, "D")]
    assert out["usage"] == {"prompt_tokens": 11, "completion_tokens": 10, "total_tokens": 21,
                            "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip


def test_a_choice_out_of_range_or_missing_is_data_loss():
    reply = Reply(parse(prompt="a", n=2), "r", "m", created=1)
    with pytest.raises(RouteError) as e:
        reply.add(generation_pb2.GenerateResponse(index=2, text="x"))
    assert e.value.code == grpc.StatusCode.DATA_LOSS and "choice 2 of a request of n=2" in e.value.message
    reply.add(generation_pb2.GenerateResponse(index=0, text="x", finish_reason="stop"))
    assert reply.usage is None  # (not every choice ended)
    with pytest.raises(RouteError) as e:
        reply.check_complete()
    assert e.value.code == grpc.StatusCode.DATA_LOSS and "without choice 1 of 2" in e.value.message


def test_a_long_whole_answer_is_the_json_of_every_response():
    lps = [_lp(9 + i % 7, f"é{i}", -0.5 - i, [(3, "?", -0.25)]) for i in range(700)]  # past 2 x JOIN_EVERY
    resps = [generation_pb2.GenerateResponse(token_ids=[9], text=f"é{i}\n", logprobs=[lp]) for i, lp in enumerate(lps)]
    resps.append(generation_pb2.GenerateResponse(finish_reason="stop", usage=common_pb2.Usage(completion_tokens=700)))
    text = "".join(f"é{i}\n" for i in range(700))
    out = whole(parse(prompt="q", logprobs=1), resps)
    assert out["choices"][0]["text"] == text and out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["logprobs"] == {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{"?": -0.25}] * 700,
        "text_offset": [sum(len(x.token) for x in lps[:i]) for i in range(700)],
    }
    messages = [{"role": "user", "content": "q"}]
    out = whole(parse(chat=True, messages=messages, logprobs=True, top_logprobs=1), resps)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert [e["token"] for e in out["choices"][0]["logprobs"]["content"]] == [lp.token for lp in lps]


def test_a_whole_answer_past_max_bytes_is_invalid_argument_naming_the_limit():
    reply = Reply(parse(prompt="q"), "r", "m", created=1, max_bytes=100)
    for _ in range(10):  # 10 x 10 bytes: at the limit, not past it
        reply.add(generation_pb2.GenerateResponse(token_ids=[9], text="abcdefghij"))
    with pytest.raises(RouteError) as e:
        reply.add(generation_pb2.GenerateResponse(token_ids=[9], text="k"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message == (
        'the answer exceeds --max-answer-bytes (100 bytes) of a non-streamed answer; ask for it with "stream": true'
    )
    # prompt logprobs count once for every choice that shows them
    entry = common_pb2.TokenLogprob(token_id=2, token="ab", logprob=-1.0, rank=1)  # 58 bytes of JSON, and ", "
    one = Reply(parse(prompt=[1, 2], prompt_logprobs=1), "r", "m", created=1, max_bytes=100)
    one.add(generation_pb2.GenerateResponse(token_ids=[9], prompt_logprobs=[entry]))  # 60 bytes
    two = Reply(parse(prompt=[1, 2], prompt_logprobs=1, n=2), "r", "m", created=1, max_bytes=100)
    with pytest.raises(RouteError):
        two.add(generation_pb2.GenerateResponse(token_ids=[9], prompt_logprobs=[entry]))  # 2 x 60 bytes
    stream = Reply(parse(prompt="q", stream=True), "r", "m", created=1, max_bytes=100)
    for _ in range(100):  # (a stream keeps nothing: no limit)
        assert stream.add(generation_pb2.GenerateResponse(token_ids=[9], text="abcdefghij")) is not None
