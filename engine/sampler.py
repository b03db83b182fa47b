"""Next-token sampling: greedy, temperature, top-k, top-p; min_tokens holds back stop tokens.

A request's token index is `req.num_sampled` (0 for the first output token). While it is below
min_tokens, the logits of the model's EOS ids (unless ignore_eos) and of the request's
stop_token_ids are set to -inf before sampling, greedy or not, as vLLM does. The EOS ids come
from the model's config, passed in by each sampling rank.

Each request's logits first go through its sampling controls (engine/logits.py: allowed tokens,
logit bias, bad words, structured output, penalties); min_p applies after the temperature.

The randomness of a request's n-th token comes from (seed, n) alone, not from a
generator's running state, so the same seeded request samples the same tokens alone or
batched, on one process or a pipeline, and when its first token is sampled by a prefill
node and the rest by a decode node.
"""

from __future__ import annotations

import logging

import torch

from kvbridge.engine.logits import Logprob, held_back, logprobs_of, outputs_of, process
from kvbridge.engine.request import Request

__all__ = ["Sampler", "held_back", "sample", "token_generator"]
log = logging.getLogger("kvbridge.sampler")


class Sampler:
    """A sampling rank's sampler: the model's EOS ids and, for structured output, the grammars
    compiled for its tokenizer (engine/grammar.py, made on first use)."""

    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer=None, vocab_size: int = 0):
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._grammars = None

    @property
    def grammars(self):
        if self._grammars is None:
            from kvbridge.engine.grammar import GrammarCompiler

            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer; this model has none")
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def prepare(self, req: Request) -> None:
        """The request arrived at this rank: its grammar compiles in the background meanwhile."""
        if req.params.structured:
            self.grammars.compile(req.params)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[Logprob | None]]:
        for req in requests:
            if req.params.structured and req.grammar is None:  # (its outputs so far: a decode node's first token)
                try:
                    req.grammar = self.grammars.matcher(req.params, outputs_of(req))
                except ValueError as e:  # (a peer's first token the grammar does not allow): it ends now
                    log.warning("%s: its grammar could not go on (%s): it ends with EOS", req.rid, e)
                    req.grammar = EndNow(self.eos_token_ids)
        return sample(logits, requests, self.eos_token_ids)


class EndNow:
    """A grammar that cannot go on: EOS is the only token it allows."""

    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos = list(eos_token_ids)
        self.done = True

    def mask(self, row: torch.Tensor) -> None:
        keep = row[self.eos].clone()
        row.fill_(float("-inf"))
        row[self.eos] = keep

    def accept(self, token: int) -> None:
        pass


def sample(
    logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...] = ()
) -> tuple[list[int], list[Logprob | None]]:
    """logits: [S, vocab] float32, one row per request, in order. Returns the tokens, and for each
    request that asked for logprobs (params.logprobs) its token's (else None)."""
    raw = logits
    logits = process(logits, requests, eos_token_ids)
    tokens = logits.argmax(dim=-1).tolist()
    for i, req in enumerate(requests):
        if not req.params.greedy:
            tokens[i] = _sample_row(logits[i], req)
        if req.grammar is not None:
            try:
                req.grammar.accept(tokens[i])
            except ValueError as e:  # (no allowed token was left to draw from)
                log.warning("%s: its grammar refused token %d (%s): it ends with EOS", req.rid, tokens[i], e)
                req.grammar = EndNow(eos_token_ids)
        req.num_sampled += 1
    wanted = [i for i, req in enumerate(requests) if req.params.logprobs is not None]
    logprobs: list[Logprob | None] = [None] * len(requests)
    if wanted:
        ks = [requests[i].params.logprobs for i in wanted]
        for i, lp in zip(wanted, logprobs_of(raw[wanted], [tokens[i] for i in wanted], ks)):
            logprobs[i] = lp
    return tokens, logprobs


def token_generator(seed: int, index: int) -> torch.Generator:
    mixed = (seed ^ (index * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1)
    return torch.Generator().manual_seed(mixed)


def _sample_row(logits: torch.Tensor, req: Request) -> int:
    p = req.params
    if not torch.isfinite(logits).any():  # (its masks allow nothing, e.g. allowed_token_ids outside its grammar)
        return int(logits.argmax())
    logits = logits.cpu() / p.temperature
    if p.min_p:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
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
