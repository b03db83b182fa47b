"""Next-token sampling: greedy, temperature, top-k, top-p; min_tokens holds back stop tokens.

A request's token index is `req.num_sampled` (0 for the first output token). While it is below
min_tokens, the logits of the model's EOS ids (unless ignore_eos) and of the request's
stop_token_ids are set to -inf before sampling, greedy or not, as vLLM does. The EOS ids come
from the model's config, passed in by each sampling rank.

The randomness of a request's n-th token comes from (seed, n) alone, not from a
generator's running state, so the same seeded request samples the same tokens alone or
batched, on one process or a pipeline, and when its first token is sampled by a prefill
node and the rest by a decode node.
"""

from __future__ import annotations

import torch

from engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """logits: [S, vocab] float32, one row per request, in order."""
    masked = [(i, ids) for i, req in enumerate(requests) if (ids := held_back(req, eos_token_ids, logits.shape[-1]))]
    if masked:
        logits = logits.clone()  # (the model's output may be an inference-mode tensor: no in-place writes)
        for i, ids in masked:
            logits[i, ids] = float("-inf")
    tokens = logits.argmax(dim=-1).tolist()
    for i, req in enumerate(requests):
        if not req.params.greedy:
            tokens[i] = _sample_row(logits[i], req)
        req.num_sampled += 1
    return tokens


def held_back(req: Request, eos_token_ids: tuple[int, ...], vocab_size: int) -> list[int]:
    """The ids `req` may not sample as its next token: its stop tokens, before min_tokens are out."""
    p = req.params
    if req.num_sampled >= p.min_tokens:
        return []
    ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(eos_token_ids)
    ids = sorted(t for t in ids if 0 <= t < vocab_size)  # stop_token_ids come from clients, unchecked
    return ids if len(ids) < vocab_size else []  # (all of them: nothing could be sampled; they stop it at once)


def token_generator(seed: int, index: int) -> torch.Generator:
    mixed = (seed ^ (index * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1)
    return torch.Generator().manual_seed(mixed)


def _sample_row(logits: torch.Tensor, req: Request) -> int:
    p = req.params
    logits = logits.cpu() / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the tokens strictly more likely already reach top_p
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=token_generator(req.seed, req.num_sampled)).item())
