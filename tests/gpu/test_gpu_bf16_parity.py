"""bf16 against Hugging Face transformers on the same device: the default model, and tiny-random (the
--quick case, on CUDA).

bf16 logits carry rounding errors of a fraction of a logit, so greedy tokens of two correct bf16
implementations may part where the top two candidates are that close. The truth is fp32: HF
transformers' fp32 logits on CPU, which tests/engine/test_hf_parity.py shows our fp32 engine matches
within 1e-3. HF gets the weights our loader read (the GGUF reading is that test's subject). Per chat
prompt, on our greedy output teacher-forced:
- our bf16 logits are no further from fp32 than HF's bf16 logits are (mean error within 1.5x of HF's,
  max error within 2x);
- every token we chose is fp32's top token, or trails it by no more than HF's own worst bf16 error on
  that sequence (a near-tie);
- our greedy output equals HF bf16's greedy output up to the first place they part, and that place
  is such a near-tie.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM
from tests.engine.test_hf_parity import CHAT_PROMPTS
from tests.gpu.conftest import on_cuda

transformers = pytest.importorskip("transformers")

CASES = {  # case (tests/gpu/conftest.py) -> (device, the session fixture of the model, new tokens, prompts)
    "cuda": ("cuda", "default_model", 32, len(CHAT_PROMPTS)),
    "cuda-tiny": ("cuda", "tiny_model", 32, len(CHAT_PROMPTS)),
    "cpu": ("cpu", "default_model", 12, 2),  # (on CPU: the code path, at a fraction of the cost)
}


def hf_from(model) -> torch.nn.Module:
    """HF's LlamaForCausalLM in fp32 on CPU, holding `model`'s weights."""
    c = model.config
    assert c.rope_scaling.kind == "default" and not c.attention_bias
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    hf = transformers.LlamaForCausalLM(config)
    result = hf.load_state_dict(model.weights, strict=False)
    tied = ["lm_head.weight"] if c.tie_word_embeddings else []  # (a tied head is the embedding)
    assert (result.missing_keys, result.unexpected_keys) == (tied, [])
    hf.tie_weights()
    return hf.eval()


def logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids], device=hf.device)).logits[0].float().cpu()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@dataclass(frozen=True)
class Run:
    """One chat prompt's greedy runs, and logits [output tokens, vocab] teacher-forced on our output."""

    output: list[int]  # our bf16 greedy tokens
    text: str  # ... detokenized
    theirs: list[int]  # HF bf16's greedy tokens
    fp32: torch.Tensor  # HF fp32 on CPU: the truth
    ours: torch.Tensor  # our bf16 engine (LLM.score)
    hf16: torch.Tensor  # HF bf16

    @property
    def tie(self) -> float:
        """HF bf16's worst error on these rows: two tokens closer than this in fp32 are a near-tie."""
        return (self.hf16 - self.fp32).abs().max().item()


@pytest.fixture(scope="module")
def runs(case, request) -> list[Run]:
    device, model_fixture, n, num_prompts = CASES[case]
    model = request.getfixturevalue(model_fixture)  # (tiny-random alone where the default model is not installed)
    hf32 = hf_from(model)
    hf16 = copy.deepcopy(hf32).to(device=device, dtype=torch.bfloat16)
    # as from_pretrained(dtype=bfloat16) leaves it: RoPE frequencies in fp32 (.to() cast them too)
    hf16.model.rotary_emb.inv_freq = hf32.model.rotary_emb.inv_freq.to(device)
    llm = LLM(EngineConfig(model=model.source, device=device, dtype="bfloat16"), model=model, progress=False)
    tok = llm.tokenizer
    questions = CHAT_PROMPTS[:num_prompts]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    out = []
    for prompt, c in zip(prompts, llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))):
        seq = prompt + c.output_ids
        gen = slice(len(prompt) - 1, len(seq) - 1)  # the rows that predict our output tokens
        out.append(
            Run(
                c.output_ids,
                c.text,
                hf_greedy(hf16, prompt, n),
                logits(hf32, seq)[gen],
                llm.score(seq).float().cpu()[gen],
                logits(hf16, seq)[gen],
            )
        )
    return out


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(runs):
    for r in runs:
        ours_err, hf_err = (r.ours - r.fp32).abs(), (r.hf16 - r.fp32).abs()
        assert ours_err.mean() <= 1.5 * hf_err.mean(), (ours_err.mean(), hf_err.mean())
        assert ours_err.max() <= 2 * hf_err.max(), (ours_err.max(), hf_err.max())


def margins(fp32: torch.Tensor, tokens: list[int]) -> list[float]:
    """Per row: how far the fp32 logit of the chosen token trails the row's top logit (0: it is the top)."""
    chosen = fp32.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return (fp32.max(dim=1).values - chosen).tolist()


def test_every_greedy_token_is_fp32_top_or_a_near_tie(runs):
    for r in runs:
        assert [(i, m) for i, m in enumerate(margins(r.fp32, r.output)) if m > r.tie] == [], r.tie


def test_greedy_equals_transformers_bf16_up_to_a_near_tie(runs):
    for r in runs:
        split = next((i for i, (a, b) in enumerate(zip(r.output, r.theirs)) if a != b), None)
        if split is not None:
            row = r.fp32[split]  # (the rows before `split` hold the same prefix for both)
            assert abs(row[r.output[split]] - row[r.theirs[split]]).item() <= r.tie, (split, r.output, r.theirs)


@pytest.mark.parametrize("case", [on_cuda("cuda", quick=False), "cpu"], indirect=True)  # the default model's
def test_the_first_answer_names_paris(runs):
    assert "Paris" in runs[0].text
