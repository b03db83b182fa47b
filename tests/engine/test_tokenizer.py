"""The tokenizer and chat template read from the GGUF, against transformers reading the same file."""

from __future__ import annotations

import pytest

from kvbridge.engine.weights import smollm2_path

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and\ttabs\nand newlines\n\n",
    "Ünïcödé, emoji 🙂 and CJK 漢字",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_encode_equals_transformers_gguf_tokenizer(default_model, hf_tokenizer):
    tok = default_model.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_one_by_one_as_the_smollm_vocabulary_was_trained(default_model):
    tok = default_model.tokenizer
    assert [tok.decode([i]) for i in tok.encode("in 2024")] == ["in", " ", "2", "0", "2", "4"]


def test_chat_template_equals_transformers(default_model, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = default_model.tokenizer.apply_chat_template(messages)
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    assert default_model.config.eos_token_ids == (default_model.tokenizer.token_id("<|im_end|>"),)
