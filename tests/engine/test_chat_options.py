"""The chat template options of a chat prompt (add_generation_prompt, continue_final_message,
chat_template_kwargs) through the nodes' adapter (common/text/prompts.py prompt_ids), against
transformers' apply_chat_template on the same tokenizer and template; and every refusal."""

from __future__ import annotations

import json

import pytest

from kvbridge.common.text.prompts import MAX_TEMPLATE_KWARGS_BYTES, chat_text, prompt_ids
from kvbridge.common.text.tokenizer import Tokenizer
from kvbridge.engine.weights import smollm2_path
from kvbridge.v1 import common_pb2

transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# reads two variables besides the tokenizer's own, and strips the messages' content
CUSTOM_TEMPLATE = (
    "{% if system_name is defined %}<|im_start|>system\nYou are {{ system_name }}.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if not enable_thinking | default(true) %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def custom(default_model) -> Tokenizer:
    """The default model's vocabulary with CUSTOM_TEMPLATE."""
    tok = default_model.tokenizer
    return Tokenizer(tok.backend, CUSTOM_TEMPLATE, tok.bos_token, tok.eos_token, tok.add_bos)


def chat(messages: list[dict], **options) -> common_pb2.Prompt:
    if isinstance(options.get("chat_template_kwargs"), dict):
        options["chat_template_kwargs"] = json.dumps(options["chat_template_kwargs"])
    msgs = [common_pb2.ChatMessage(**m) for m in messages]
    return common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=msgs, **options))


def check_equal(tok: Tokenizer, hf, messages: list[dict], hf_kwargs: dict, **options) -> str:
    """Our text and ids for the chat with `options` equal transformers' with `hf_kwargs`."""
    prompt = chat(messages, **options)
    ours = chat_text(prompt.chat, tok)
    theirs = hf.apply_chat_template(messages, tokenize=False, **hf_kwargs)
    assert ours == theirs
    ids = prompt_ids(prompt, tok)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=True, **hf_kwargs)["input_ids"]
    assert ids == hf.encode(theirs, add_special_tokens=False)
    return ours


def test_add_generation_prompt_unset_true_and_false_equal_transformers(default_model, hf_tokenizer):
    tok = default_model.tokenizer
    opened = check_equal(tok, hf_tokenizer, QUESTION, {"add_generation_prompt": True})
    assert opened.endswith("<|im_start|>assistant\n")
    assert check_equal(tok, hf_tokenizer, QUESTION, {"add_generation_prompt": True}, add_generation_prompt=True)
    closed = check_equal(tok, hf_tokenizer, QUESTION, {"add_generation_prompt": False}, add_generation_prompt=False)
    assert closed + "<|im_start|>assistant\n" == opened


@pytest.mark.parametrize("answer", ["The capital of France is", "Sure: ", "", "  Well,\n"])
def test_continue_final_message_equals_transformers(default_model, hf_tokenizer, answer):
    tok = default_model.tokenizer
    messages = [*QUESTION, {"role": "assistant", "content": answer}]
    hf_kwargs = {"continue_final_message": True, "add_generation_prompt": False}
    text = check_equal(tok, hf_tokenizer, messages, hf_kwargs, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n" + answer)  # the template keeps the content as is
    # add_generation_prompt false said outright: the same
    check_equal(tok, hf_tokenizer, messages, hf_kwargs, continue_final_message=True, add_generation_prompt=False)


def test_continue_final_message_when_the_template_strips_the_content(custom, hf_tokenizer):
    messages = [*QUESTION, {"role": "assistant", "content": "  Sure:  "}]
    hf_kwargs = {"chat_template": CUSTOM_TEMPLATE, "continue_final_message": True}
    text = check_equal(custom, hf_tokenizer, messages, hf_kwargs, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nSure:")


def test_chat_template_kwargs_reach_the_template_as_in_transformers(custom, hf_tokenizer):
    kwargs = {"system_name": "Ada", "enable_thinking": False}
    hf_kwargs = {"chat_template": CUSTOM_TEMPLATE, "add_generation_prompt": True, **kwargs}
    text = check_equal(custom, hf_tokenizer, QUESTION, hf_kwargs, chat_template_kwargs=kwargs)
    assert text.startswith("<|im_start|>system\nYou are Ada.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = check_equal(
        custom, hf_tokenizer, QUESTION, {"chat_template": CUSTOM_TEMPLATE, "add_generation_prompt": True}
    )
    assert plain.endswith("<|im_start|>assistant\n") and "Ada" not in plain
    # with the options together
    messages = [*QUESTION, {"role": "assistant", "content": "Paris"}]
    hf_kwargs = {"chat_template": CUSTOM_TEMPLATE, "continue_final_message": True, **kwargs}
    text = check_equal(custom, hf_tokenizer, messages, hf_kwargs, continue_final_message=True,
                       chat_template_kwargs=kwargs)  # fmt: skip
    assert text.startswith("<|im_start|>system\nYou are Ada.") and text.endswith("assistant\nParis")


def test_a_kwarg_the_template_does_not_read_changes_nothing(default_model, hf_tokenizer):
    tok = default_model.tokenizer
    check_equal(tok, hf_tokenizer, QUESTION, {"add_generation_prompt": True, "enable_thinking": False},
                chat_template_kwargs={"enable_thinking": False})  # fmt: skip


@pytest.mark.parametrize(
    ("messages", "options", "says"),
    [
        (QUESTION, {"continue_final_message": True}, "role to be assistant, got 'user'"),
        (
            [*QUESTION, {"role": "assistant", "content": "Paris"}],
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message needs add_generation_prompt false",
        ),
        (QUESTION, {"chat_template_kwargs": "{not json"}, "chat_template_kwargs is not JSON"),
        (QUESTION, {"chat_template_kwargs": "[1, 2]"}, "chat_template_kwargs must be a JSON object, got '[1, 2]'"),
        (QUESTION, {"chat_template_kwargs": '"x"'}, "chat_template_kwargs must be a JSON object"),
        (QUESTION, {"chat_template_kwargs": "[" * 5000}, "chat_template_kwargs is not JSON"),
        (
            QUESTION,
            {"chat_template_kwargs": json.dumps({"x": "y" * MAX_TEMPLATE_KWARGS_BYTES})},
            f"chat_template_kwargs has {MAX_TEMPLATE_KWARGS_BYTES + 9} bytes; at most {MAX_TEMPLATE_KWARGS_BYTES}",
        ),
        *[
            (QUESTION, {"chat_template_kwargs": {name: "x"}}, f"chat_template_kwargs cannot set '{name}'")
            for name in ("messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")
        ],
    ],
)
def test_bad_options_are_value_errors_naming_the_field(default_model, messages, options, says):
    with pytest.raises(ValueError, match=r"prompt\.chat\.") as e:
        prompt_ids(chat(messages, **options), default_model.tokenizer)
    assert says in str(e.value)


def test_template_errors_are_value_errors(default_model):
    backend = default_model.tokenizer.backend
    no_content = Tokenizer(backend, "{% for m in messages %}{{ m['role'] }}{% endfor %}", None, None)
    messages = [*QUESTION, {"role": "assistant", "content": "Paris"}]
    with pytest.raises(ValueError, match="does not render the final message's content"):
        prompt_ids(chat(messages, continue_final_message=True), no_content)
    arithmetic = Tokenizer(backend, "{{ n + 1 }}{% for m in messages %}{{ m['content'] }}{% endfor %}", None, None)
    with pytest.raises(ValueError, match="chat template: TypeError"):
        prompt_ids(chat(QUESTION, chat_template_kwargs={"n": "x"}), arithmetic)
    assert (
        prompt_ids(chat(QUESTION, chat_template_kwargs={"n": 1}), arithmetic)
        == backend.encode("2" + QUESTION[0]["content"], add_special_tokens=False).ids
    )
    with pytest.raises(ValueError, match="add_generation_prompt False"):
        default_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="'bos_token' is the tokenizer's own"):
        default_model.tokenizer.apply_chat_template(QUESTION, template_kwargs={"bos_token": "x"})


def test_encode_without_special_tokens_adds_no_bos(default_model):
    tok = default_model.tokenizer
    with_bos = Tokenizer(tok.backend, None, "<|im_start|>", None, add_bos=True)
    bos = tok.token_id("<|im_start|>")
    assert with_bos.encode("hi") == [bos, *tok.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == tok.encode("hi")
