"""The router's /tokenize, /detokenize and /version against in-test nodes: the ids are those the
nodes' own adapter (common/text/prompts.py prompt_ids) makes with the tokenizer they hand out (the
fakes' byte-level one, and the default model's), text round-trips, and every refusal is an
OpenAI error naming its field; 503 while no tokenizer could be fetched."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

import kvbridge
from kvbridge.common.text.prompts import TRIM_AFTER_TOKENS, encode, prompt_ids
from kvbridge.common.text.tokenizer import CHATML_TEMPLATE, Tokenizer
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import common_pb2
from tests.router import fakes
from tests.router.fakes import wait_until

TEXTS = [
    "Hello, world",
    "Ünïcödé, emoji 🙂 and CJK 漢字",
    "  spaces\tand\nnewlines\n\n",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def call(router, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
    """(status, parsed JSON body); `body` a dict (sent as JSON) or bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=30)
    try:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def tokens(router, body: dict) -> list[int]:
    status, answer = call(router, "POST", "/tokenize", body)
    assert status == 200, answer
    assert answer["count"] == len(answer["tokens"])
    return answer["tokens"]


def text_of(router, ids: list[int]) -> str:
    status, answer = call(router, "POST", "/detokenize", {"tokens": ids})
    assert status == 200, answer
    return answer["prompt"]


def chat_prompt(messages: list[dict], **options) -> common_pb2.Prompt:
    msgs = [common_pb2.ChatMessage(**m) for m in messages]
    return common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=msgs, **options))


def text_prompt(text: str) -> common_pb2.Prompt:
    return common_pb2.Prompt(text=text)


@pytest.fixture
def handed_out(monkeypatch):
    """use(tokenizer): the fakes' GetTokenizer hands out `tokenizer` from now on."""
    return lambda tokenizer: monkeypatch.setattr(fakes, "TOKENIZER", tokenizer)


# ---------------------------------------------------------------- the ids


def test_text_and_chat_get_the_nodes_prompt_ids(fleet):
    router, _ = fleet(colocated=1, kv_events=True)
    tok = fakes.TOKENIZER
    for text in TEXTS:
        status, answer = call(router, "POST", "/tokenize", {"prompt": text})
        ids = prompt_ids(text_prompt(text), tok)
        assert (status, answer) == (200, {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None})
        assert text_of(router, ids) == text
    assert tokens(router, {"model": "fake", "messages": CHAT}) == prompt_ids(chat_prompt(CHAT), tok)
    status, answer = call(router, "POST", "/tokenize", {"prompt": "añ", "return_token_strs": True})
    assert (status, answer["token_strs"]) == (200, [tok.backend.id_to_token(i) for i in answer["tokens"]])
    assert answer["token_strs"] == ["a", "Ã", "±"]  # byte-level: ñ is two bytes


def test_the_default_models_tokenizer_with_every_chat_option(fleet, handed_out, default_model):
    tok = default_model.tokenizer
    handed_out(tok)
    router, _ = fleet(colocated=1, kv_events=True)
    for text in TEXTS:
        ids = tokens(router, {"prompt": text})
        assert ids == prompt_ids(text_prompt(text), tok) == tok.encode(text)
        assert text_of(router, ids) == text
    assert tokens(router, {"messages": CHAT}) == prompt_ids(chat_prompt(CHAT), tok)
    closed = tokens(router, {"messages": CHAT, "add_generation_prompt": False})
    assert closed == prompt_ids(chat_prompt(CHAT, add_generation_prompt=False), tok)
    assert tokens(router, {"messages": CHAT}) == closed + tok.encode("<|im_start|>assistant\n")
    answer = [*CHAT, {"role": "assistant", "content": "It is"}]
    continued = tokens(router, {"messages": answer, "continue_final_message": True, "add_generation_prompt": False})
    assert continued == prompt_ids(chat_prompt(answer, continue_final_message=True), tok)
    assert text_of(router, continued).endswith("<|im_start|>assistant\nIt is")
    kwargs = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}, "add_special_tokens": False}
    assert tokens(router, kwargs) == prompt_ids(
        chat_prompt(CHAT, chat_template_kwargs='{"enable_thinking": false}'), tok
    )


def test_add_special_tokens_false_leaves_out_the_bos(fleet, handed_out):
    byte_level = fakes.TOKENIZER
    tok = Tokenizer(byte_level.backend, CHATML_TEMPLATE, "<|endoftext|>", "<|im_end|>", add_bos=True)
    handed_out(tok)
    router, _ = fleet(colocated=1, kv_events=True)
    bos = tok.token_id("<|endoftext|>")
    assert tokens(router, {"prompt": "hi"}) == [bos, *byte_level.encode("hi")] == prompt_ids(text_prompt("hi"), tok)
    assert tokens(router, {"prompt": "hi", "add_special_tokens": True})[0] == bos
    assert tokens(router, {"prompt": "hi", "add_special_tokens": False}) == byte_level.encode("hi")
    assert text_of(router, [bos, *byte_level.encode("hi")]) == "<|endoftext|>hi"  # special tokens are kept


@pytest.mark.parametrize("add_bos", [False, True])
def test_the_adapters_encode_gives_the_tokenizers_own_ids(add_bos):
    """common/text/prompts.py encode (the tokenizers library's batch call: it lets go of the GIL) against
    Tokenizer.encode (its single call), with and without a BOS, past TRIM_AFTER_TOKENS too."""
    tok = Tokenizer(fakes.TOKENIZER.backend, CHATML_TEMPLATE, "<|endoftext|>", "<|im_end|>", add_bos=add_bos)
    long = "".join(TEXTS) * 3000  # ~250,000 ids
    assert len(tok.encode(long)) > TRIM_AFTER_TOKENS
    for text in [*TEXTS, "<|endoftext|>starts with the BOS", long]:
        for special in (True, False):
            assert encode(tok, text, special) == tok.encode(text, add_special_tokens=special)


def test_a_long_prompt_is_tokenized_whole(fleet):
    router, _ = fleet(colocated=1, kv_events=True, max_context=1 << 14)  # prompts up to 512 KiB
    text = "the quick brown fox " * 20_000  # 400 KB (its ids as JSON: about 2 MB)
    status, answer = call(router, "POST", "/tokenize", {"prompt": text})
    assert (status, answer["count"], answer["max_model_len"]) == (200, len(text), 1 << 14)  # (one id per byte)
    assert text_of(router, answer["tokens"]) == text


@pytest.mark.parametrize("special", [True, False])
def test_a_text_that_cannot_fit_the_context_by_its_bytes_is_not_tokenized(fleet, special):
    router, _ = fleet(colocated=1, kv_events=True)  # a context of 64 tokens: prompts up to 64 x 32 bytes
    assert call(router, "POST", "/tokenize", {"prompt": "x" * 2048, "add_special_tokens": special})[0] == 200
    status, answer = call(router, "POST", "/tokenize", {"prompt": "x" * 2049, "add_special_tokens": special})
    message = "prompt.text has 2049 bytes; a prompt that fits the context of 64 tokens has at most 2048"
    assert (status, answer) == (400, error(message, "prompt"))


def test_a_chat_that_cannot_fit_the_context_by_its_bytes_or_its_rendered_bytes_is_not_tokenized(fleet):
    router, _ = fleet(colocated=1, kv_events=True)  # prompts up to 2048 bytes, as sent and as rendered
    empty = {"role": "user", "content": ""}  # 4 bytes; rendered by the fakes' ChatML template: 28
    status, answer = call(router, "POST", "/tokenize", {"messages": [empty] * 600})
    message = "prompt.chat has 2400 bytes; a prompt that fits the context of 64 tokens has at most 2048"
    assert (status, answer) == (400, error(message, "messages"))
    status, answer = call(router, "POST", "/tokenize", {"messages": [empty] * 100})  # 100 x 28 + the reply's 22
    message = (
        "prompt.chat renders to 2822 bytes through the chat template; a prompt that fits the context of 64 "
        "tokens has at most 2048"
    )
    assert (status, answer) == (400, error(message, "messages"))
    assert len(tokens(router, {"messages": [empty] * 72})) == 72 * 8 + 11  # (2038 bytes rendered: tokenized)


# ---------------------------------------------------------------- refusals


def error(message: str, param: str | None, kind: str = "invalid_request_error", code: str = "invalid_argument"):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/tokenize", b"{nope", None, "the body is not valid JSON"),
        ("/tokenize", b"[1]", None, "the body must be a JSON object, got [1]"),
        ("/tokenize", {}, "prompt", "prompt must be a string (or send messages), got null"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt", "prompt must be a string (or send messages), got [1, 2]"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages", "give prompt or messages, not both"),
        ("/tokenize", {"messages": []}, "messages", "messages must be a non-empty list, got []"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role must be"),
        ("/tokenize", {"prompt": "a", "model": 3}, "model", "model must be a string, got 3"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "must be a boolean"),
        ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs", "must be a boolean, got 1"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens", "not supported"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template", "not supported"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": "no"}, "add_generation_prompt", "a boolean"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": 1}, "continue_final_message", "a boolean"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
        (
            "/tokenize",
            {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs",
            "prompt.chat.chat_template_kwargs cannot set 'messages'",
        ),
        (
            "/tokenize",
            {"messages": CHAT, "chat_template_kwargs": {"x": "y" * 9000}},
            "chat_template_kwargs",
            "chat_template_kwargs must be an object of at most 8192 characters",
        ),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True},
            "continue_final_message",
            "needs the last message's role to be assistant, got 'user'",
        ),
        (
            "/tokenize",
            {
                "messages": [*CHAT, {"role": "assistant", "content": "4"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            "continue_final_message",
            "continue_final_message needs add_generation_prompt: false",
        ),
        ("/detokenize", {}, "tokens", "tokens must be a list of token ids, got null"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens", "tokens must be a list of token ids"),
        ("/detokenize", {"tokens": [1, True]}, "tokens", "tokens must be a list of token ids"),
        ("/detokenize", {"tokens": [5, 259]}, "tokens", "tokens[1] = 259 is not in the vocabulary (ids 0..258)"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "tokens[0] = -1 is not in the vocabulary (ids 0..258)"),
        ("/detokenize", {"tokens": [1], "model": ["x"]}, "model", "model must be a string"),
    ],
)
def test_bad_bodies_get_400_naming_the_field(fleet, path, body, param, says):
    router, _ = fleet(colocated=1, kv_events=True)
    status, answer = call(router, "POST", path, body)
    assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, param, "invalid_argument"), answer
    assert says in answer["error"]["message"]


def test_an_unknown_model_is_404_and_a_body_over_the_limit_413(fleet):
    router, _ = fleet(colocated=1, kv_events=True, router={"max_body_bytes": 1000})
    message = "model 'other' is not served here"
    for path, body in (
        ("/tokenize", {"prompt": "a", "model": "other"}),
        ("/detokenize", {"tokens": [], "model": "other"}),
    ):
        assert call(router, "POST", path, body) == (404, error(message, "model", "not_found_error", "not_found"))
    status, answer = call(router, "POST", "/tokenize", {"prompt": "x" * 1000})
    assert (status, answer) == (413, error("body over 1000 bytes", None))
    assert call(router, "POST", "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


def test_503_until_a_tokenizer_could_be_fetched(fleet):
    router, nodes = fleet(colocated=1, kv_events=True)
    fake = nodes["colocated"][0]
    fake.tokenizer_fail = grpc.StatusCode.UNAVAILABLE
    message = "no tokenizer of model 'fake' at the router yet (none could be fetched from its nodes); retry later"
    unavailable = (503, error(message, None, "server_error", "unavailable"))
    assert call(router, "POST", "/tokenize", {"prompt": "a"}) == unavailable
    assert call(router, "POST", "/detokenize", {"tokens": [5]}) == unavailable
    assert fake.tokenizer_calls >= 1
    fake.tokenizer_fail = None  # the next fetch (health_retry_s later) gets it
    assert wait_until(lambda: call(router, "POST", "/tokenize", {"prompt": "a"})[0] == 200)
    assert call(router, "POST", "/detokenize", {"tokens": tokens(router, {"prompt": "ab"})}) == (200, {"prompt": "ab"})


def test_503_while_no_node_hands_out_a_tokenizer(fleet):
    router, _ = fleet(colocated=1)  # no KVEvents: nothing to fetch from
    status, answer = call(router, "POST", "/tokenize", {"prompt": "a"})
    assert (status, answer["error"]["code"]) == (503, "unavailable")
    assert "no tokenizer of model 'fake'" in answer["error"]["message"]


# ---------------------------------------------------------------- /version, methods, the API key


def test_version_methods_and_the_api_key(fleet):
    router, _ = fleet(colocated=1, kv_events=True)
    assert call(router, "GET", "/version") == (200, {"version": kvbridge.__version__})
    status, answer = call(router, "GET", "/tokenize")
    assert (status, answer["error"]["code"]) == (405, "method_not_allowed")
    status, answer = call(router, "POST", "/version", {})
    assert (status, answer["error"]["code"]) == (405, "method_not_allowed")
    router.http.api_key = "sesame"  # (read per request)
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        status, answer = call(router, "POST", path, body)
        assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
        assert call(router, "POST", path, body, {"Authorization": "Bearer sesame"})[0] == 200
    assert call(router, "GET", "/version") == (200, {"version": kvbridge.__version__})


# ---------------------------------------------------------------- once per request


def chat_request(messages: list[dict]):
    req = fakes.make_request()
    req.prompt.CopyFrom(chat_prompt(messages))
    return req


@pytest.mark.parametrize("roles", [{"colocated": 1}, {"prefill": 1, "decode": 1}])
def test_the_nodes_get_the_ids_the_router_made(fleet, roles):
    """A text or chat prompt is tokenized once, at the router: the node (P and D alike) gets the
    ids the nodes' own adapter makes, not the text to tokenize again."""
    router, nodes = fleet(kv_events=True, **roles)
    stub = fakes.router_stub(router)
    for prompt in (text_prompt(TEXTS[1]), chat_prompt(CHAT)):
        req = fakes.make_request()
        req.prompt.CopyFrom(prompt)
        assert [t for r in stub.Generate(req, timeout=30) for t in r.token_ids] == [100, 101, 102, 103]
    expected = [prompt_ids(text_prompt(TEXTS[1]), fakes.TOKENIZER), prompt_ids(chat_prompt(CHAT), fakes.TOKENIZER)]
    for node in (n for group in nodes.values() for n in group):
        assert [list(r.prompt.token_ids.ids) for r in node.requests] == expected


def test_without_the_nodes_tokenizer_the_text_goes_on_as_text(fleet):
    """The router sends ids only when the node serves the model whose tokenizer made them; with
    no tokenizer at hand (every fetch fails) the node gets the prompt as sent."""
    router, nodes = fleet(colocated=1, kv_events=True)
    [node] = nodes["colocated"]
    node.tokenizer_fail = grpc.StatusCode.UNAVAILABLE
    req = chat_request(CHAT)
    assert len(list(fakes.router_stub(router).Generate(req, timeout=30))) == 5
    assert node.requests[-1].prompt == req.prompt


def test_a_node_of_another_model_gets_the_prompt_as_sent():
    """Two nodes, two models: the router's one tokenizer is that of the node it fetched it from;
    only that node gets ids, the other the prompt as sent."""
    nodes = [fakes.FakeNode("colocated", fakes.Rooms(), kv_events=True) for _ in range(2)]
    nodes[1].fingerprint = "another model"
    addresses = tuple(n.address for n in nodes)
    router = start_router(RouterConfig(port=0, http_port=0, colocated=addresses, routing="round_robin"))
    try:
        stub = fakes.router_stub(router)
        for _ in range(6):  # (in turn: three each)
            assert len(list(stub.Generate(chat_request(CHAT), timeout=30))) == 5
    finally:
        router.stop(grace_s=0)
        for n in nodes:
            n.stop()
    ids = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=prompt_ids(chat_prompt(CHAT), fakes.TOKENIZER)))
    assert sorted(n.tokenizer_calls for n in nodes) == [0, 1]
    for node in nodes:
        sent = [r.prompt for r in node.requests]
        assert len(sent) == 3 and sent == [ids if node.tokenizer_calls else chat_prompt(CHAT)] * 3
