"""Against the independent reference: Hugging Face transformers, fp32, same weights.

Greedy tokens must be identical and teacher-forced logits within 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM
from kvbridge.engine.weights import load_model
from tests.conftest import make_prompts

transformers = pytest.importorskip("transformers")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers.",
    "How do I boil an egg?",
    "Translate 'good morning' to Spanish.",
    "What is 12 times 7?",
    "Give me a fun fact about octopuses.",
]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.long
def test_default_model_greedy_equals_transformers_on_8_chat_prompts(default_model, hf_default):
    llm = LLM(EngineConfig(dtype="float32"), model=default_model, progress=False)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in CHAT_PROMPTS]
    ours = llm.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))
    for prompt, c in zip(prompts, ours):
        assert c.output_ids == hf_greedy(hf_default, prompt, 48)
    assert "Paris" in ours[0].text
    seq = prompts[0] + ours[0].output_ids
    torch.testing.assert_close(llm.score(seq), hf_logits(hf_default, seq), atol=1e-3, rtol=0)


def random_llama(tmp_path, **overrides):
    cfg = transformers.LlamaConfig(
        **{
            "vocab_size": 301,
            "hidden_size": 72,
            "intermediate_size": 100,
            "num_hidden_layers": 3,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "initializer_range": 0.15,
            **overrides,
        }
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"attention_bias": True}, id="gqa-odd-sizes-qkv-bias"),
        pytest.param({"tie_word_embeddings": True, "rope_theta": 500000.0, "num_key_value_heads": 6}, id="tied-theta"),
        pytest.param(
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            id="llama3-rope-scaling",
        ),
    ],
)
def test_random_hf_llama_equals_transformers(tmp_path, overrides):
    hf = random_llama(tmp_path, **overrides)
    model = load_model(str(tmp_path), progress=False)
    assert model.tokenizer is None  # save_pretrained wrote no tokenizer: token-id prompts only
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.config.rope_theta == overrides.get("rope_theta", 10000.0)
    assert model.config.rope_scaling.kind == overrides.get("rope_scaling", {}).get("rope_type", "default")
    llm = LLM(EngineConfig(dtype="float32", page_size=4, chunked_prefill_size=16), model=model, progress=False)
    prompts = make_prompts(4, 301, seed=11, min_len=5, max_len=120)
    ours = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for prompt, c in zip(prompts, ours):
        assert c.output_ids == hf_greedy(hf, prompt, 24)
        seq = prompt + c.output_ids
        torch.testing.assert_close(llm.score(seq), hf_logits(hf, seq), atol=1e-3, rtol=0)
