"""Next-token sampling: greedy, temperature, top-k, top-p.

The randomness of a request's n-th token comes from (seed, n) alone, not from a
generator's running state, so the same seeded request samples the same tokens alone or
batched, on one process or a pipeline, and when its first token is sampled by a prefill
node and the rest by a decode node.
"""

from __future__ import annotations

import torch

from engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits: [S, vocab] float32, one row per request, in order."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, req in enumerate(requests):
        if not req.params.greedy:
            tokens[i] = _sample_row(logits[i], req)
        req.num_sampled += 1
    return tokens


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
