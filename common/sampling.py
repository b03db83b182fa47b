"""Sampling parameters: one dataclass, one set of rules (`SamplingParams.validate`), and the one
checked conversion from the wire (`from_proto`). The router and the nodes use the same, so a
request the router lets through is one every node takes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvbridge.v1 import common_pb2

# Smallest non-greedy temperature: the sampler divides the logits by it, and below this a large
# logit overflows float32 (inf, then NaN probabilities). 0 is greedy.
MIN_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16  # a stop string is searched for in every token's new text


@dataclass(frozen=True)
class SamplingParams:
    # 0 = unset: the node makes it the rest of the context, at most EngineConfig.max_default_tokens (resolved())
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None  # same seed + same prompt = same output, alone or batched
    stop: tuple[str, ...] = ()  # generation ends when the text contains one of these (excluded)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS tokens
    ignore_eos: bool = False
    # EOS and stop_token_ids cannot be sampled, and stop strings do not count, until this many tokens are out
    min_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field and its value."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 1 (or 0: the rest of the context), got {self.max_new_tokens}")
        if self.min_tokens < 0 or (self.max_new_tokens and self.min_tokens > self.max_new_tokens):
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        t = self.temperature
        if not t >= 0:  # (NaN too)
            raise ValueError(f"temperature must be >= 0, got {t}")
        if t > 0 and not MIN_TEMPERATURE <= t < math.inf:
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {t}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        empty = [i for i, s in enumerate(self.stop) if not s]
        if empty:
            raise ValueError(f"stop[{empty[0]}] is empty (it would match at once)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def resolved(self, prompt_tokens: int, max_context: int, max_default_tokens: int) -> SamplingParams:
        """With max_new_tokens unset (0): the rest of the context after the prompt, at most
        max_default_tokens (0: no cap), at least min_tokens. Set: unchanged."""
        if self.max_new_tokens:
            return self
        n = max(max_context - prompt_tokens, 1)
        if max_default_tokens:
            n = min(n, max_default_tokens)
        return replace(self, max_new_tokens=max(n, self.min_tokens))


def from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The wire's sampling parameters, checked; ValueError names the field ("sampling.top_p ...")."""
    try:
        return SamplingParams(
            max_new_tokens=msg.max_new_tokens,  # 0: unset, the node resolves it (SamplingParams.resolved)
            temperature=msg.temperature,
            top_p=msg.top_p or 1.0,  # 0: unset
            top_k=msg.top_k,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            min_tokens=msg.min_tokens,
        )
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from None


def to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg
