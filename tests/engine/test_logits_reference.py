"""Sampling controls and logprobs against an independent reference: transformers' logits for the
same tokens (fp32, the default model), with each rule written out here step by step.

At every step the reference runs the whole sequence through transformers, applies the request's
rule to the last row in plain Python, and takes the argmax (greedy) or draws with the engine's
per-token generator (seeded: the draw itself is the one thing shared, so that a rule that differs
shows as a different token). Logprobs are transformers' log-softmax at each position, to 1e-4.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM
from kvbridge.engine.sampler import token_generator

pytest.importorskip("transformers")  # (the hf_default fixture: tests/conftest.py)

STEPS = 8
REPEATING = {"repetition-greedy", "presence-frequency-greedy", "repetition-seeded", "penalties-seeded"}
QUESTIONS = {
    "capital": "What is the capital of France? Answer in one word.",
    "repeat": "Count from 1 to 20, separated by commas.",  # (penalties have repeats to act on)
}


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(EngineConfig(dtype="float32"), model=default_model, progress=False)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.tokenizer
    return {k: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for k, q in QUESTIONS.items()}


def last_logits(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float().tolist()


def log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    z = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - z for x in row]


def apply_rule(row: list[float], p: SamplingParams, prompt: list[int], outputs: list[int]) -> list[float]:
    """vLLM's order: allowed tokens, logit bias, bad words, penalties."""
    row = list(row)
    if p.allowed_token_ids:
        row = [x if i in p.allowed_token_ids else -math.inf for i, x in enumerate(row)]
    for token, bias in p.logit_bias:
        row[token] += bias
    for word in p.bad_words_ids:
        if len(word) == 1 or outputs[-(len(word) - 1) :] == list(word[:-1]):
            row[word[-1]] = -math.inf
    for token in set(prompt) | set(outputs):
        if p.repetition_penalty != 1:
            row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(outputs):
        row[token] -= p.frequency_penalty * outputs.count(token) + p.presence_penalty
    return row


def draw(row: list[float], p: SamplingParams, index: int) -> int:
    if p.greedy:
        return max(range(len(row)), key=row.__getitem__)
    scaled = [x / p.temperature for x in row]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    if p.min_p:
        weights = [w if w >= p.min_p else 0.0 for w in weights]  # (relative to the top token's, which is 1)
    if p.top_k:
        kth = sorted(scaled, reverse=True)[p.top_k - 1]
        weights = [w if x >= kth else 0.0 for w, x in zip(weights, scaled)]
    probs = torch.tensor(weights, dtype=torch.float32)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=token_generator(p.seed, index)).item())


def reference(model, prompt: list[int], p: SamplingParams) -> list[int]:
    outputs: list[int] = []
    for i in range(STEPS):
        row = apply_rule(last_logits(model, prompt + outputs), p, prompt, outputs)
        outputs.append(draw(row, p, i))
    return outputs


def cases(tok) -> dict[str, SamplingParams]:
    paris = tok.encode(" Paris", add_special_tokens=False)
    common = {"max_new_tokens": STEPS, "ignore_eos": True}
    return {
        "repetition-greedy": SamplingParams(**common, repetition_penalty=1.6),
        "presence-frequency-greedy": SamplingParams(**common, presence_penalty=1.5, frequency_penalty=1.0),
        "logit_bias-greedy": SamplingParams(**common, logit_bias=((paris[0], -100.0), (tok.encode("London")[0], 8.0))),
        "allowed-greedy": SamplingParams(**common, allowed_token_ids=tuple(range(1000, 1100))),
        "bad_words-greedy": SamplingParams(**common, bad_words=("Paris",)),
        "min_p-seeded": SamplingParams(**common, temperature=1.0, min_p=0.1, seed=5),
        "repetition-seeded": SamplingParams(**common, temperature=0.8, top_k=40, repetition_penalty=1.3, seed=9),
        "penalties-seeded": SamplingParams(
            **common, temperature=0.5, presence_penalty=1.0, frequency_penalty=2.0, seed=2
        ),
        "bias-allowed-seeded": SamplingParams(
            **common, temperature=1.0, seed=4, allowed_token_ids=tuple(range(300, 400)), logit_bias=((350, 3.0),)
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "repetition-greedy",
        "presence-frequency-greedy",
        "logit_bias-greedy",
        "allowed-greedy",
        "bad_words-greedy",
        "min_p-seeded",
        "repetition-seeded",
        "penalties-seeded",
        "bias-allowed-seeded",
    ],
)
def test_each_control_picks_the_token_the_rule_picks_on_transformers_logits(llm, hf_default, prompts, case):
    params = cases(llm.tokenizer)[case]
    prompt = prompts["repeat" if case in REPEATING else "capital"]
    if params.bad_words:
        params = params.with_bad_words_ids(lambda t: llm.tokenizer.encode(t, add_special_tokens=False))
    [ours] = llm.generate([prompt], params)
    want = reference(hf_default, prompt, params)
    assert ours.output_ids == want
    plain = llm.generate([prompt], SamplingParams(max_new_tokens=STEPS, ignore_eos=True, seed=params.seed,
                                                  temperature=params.temperature))[0]  # fmt: skip
    assert ours.output_ids != plain.output_ids  # the control changed the output: the test can tell
    if case == "bad_words-greedy":
        assert "Paris" in plain.text and "Paris" not in ours.text


def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(llm, hf_default, prompts):
    prompt = prompts["capital"]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    [ours] = llm.generate([prompt], params)
    seq = prompt + ours.output_ids
    with torch.no_grad():
        table = torch.log_softmax(hf_default(torch.tensor([seq])).logits[0].float(), dim=-1)
    for i, lp in enumerate(ours.logprobs):  # output token i sits at len(prompt) + i, predicted one row earlier
        row = table[len(prompt) + i - 1]
        assert lp.token == seq[len(prompt) + i]
        assert lp.logprob == pytest.approx(row[lp.token].item(), abs=1e-4)
        top = row.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert lp.rank == int((row > row[lp.token]).sum()) + 1
    assert len(ours.prompt_logprobs) == len(prompt) - 1
    for j, lp in enumerate(ours.prompt_logprobs):  # prompt token j + 1
        row = table[j]
        assert lp.token == prompt[j + 1]
        assert lp.logprob == pytest.approx(row[lp.token].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
