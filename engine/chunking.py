"""Dynamic chunked prefill: size each prompt chunk so that every chunk costs about the same.

A chunk of x tokens prefilled on top of L cached tokens attends to L + x keys per query, so
its cost grows with L. With pipeline parallelism a stage that gets a slow chunk stalls the
stages behind it; equal-cost chunks keep the pipeline even. The model of cost:

    f(l) = a l² + b l + c     seconds to prefill a whole l-token sequence from an empty cache

is fitted at start-up from measured prefills (`profile_prefill`, `fit_quadratic`). The
chunk of x tokens after a history of L tokens is taken to cost f(L + x) - f(L), and the
target is the base chunk's cost from an empty cache, T = f(base) - f(0) = a base² + b base.
Solving f(L + x) - f(L) = T gives

    a x² + (2aL + b) x - T = 0,    x* = 2T / (B + sqrt(B² + 4aT)),  B = 2aL + b

(the positive root, written without cancellation). x* = base at L = 0 and shrinks as L
grows. `ChunkPlanner` smooths x* toward the base size, applies a floor and page alignment.

A step that runs beside decodes is bounded by what steps measurably take instead
(`DecodeBudget`, `--decode-step-target-ms`): a profile prices prefill well but not a decode step,
whose cost is mostly the weights streamed once, and a profile taken on a busy host prices every
step high. Each step's seconds, from its scheduling to its tokens, feed `StepCosts`: a step of
decodes alone measures `decode_s`, a step of prompts alone a prompt token's `token_s` (its fixed
cost spread over the tokens), and a mixed step `token_s` from what it took beyond `decode_s` (or,
before any step of decodes alone, `decode_s` from what it took beyond `token_s`), each averaged
with weight 1/4 on the newest. A step with decodes then takes the prompt tokens

    x = (target - decode_s) / token_s     in whole pages,

never fewer than a floor (`--decode-step-min-prefill`), so a prompt always progresses. A wrong
estimate corrects itself: a mixed step that overran raises `token_s` for the next one. With
pipeline parallelism a step's seconds run from its launch to its tokens, through every stage.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.common.progress import Progress

logger = logging.getLogger(__name__)

MIN_FIT_POINTS = 8  # samples left after dropping the warm-up one
# A quadratic term below this share of the latency at the longest profiled length is
# round-off (a fit of linear data lands on either side of 0), not attention cost.
MIN_QUADRATIC_SHARE = 1e-6


@dataclass(frozen=True)
class QuadraticLatency:
    """f(l) = a l² + b l + c: seconds to prefill a whole l-token sequence from an empty cache."""

    a: float  # s/token², > 0: attention's quadratic cost
    b: float  # s/token, >= 0: per-token (MLP, projections) cost
    c: float  # s: fixed cost of a forward pass (launches, sampling); may be < 0 from the fit

    def __call__(self, length: float) -> float:
        return (self.a * length + self.b) * length + self.c

    def chunk_cost(self, history_len: float, chunk: float) -> float:
        """f(L + x) - f(L): seconds to prefill `chunk` tokens after `history_len` cached ones."""
        return self(history_len + chunk) - self(history_len)

    def chunk_for_cost(self, history_len: float, target: float) -> float:
        """The x > 0 with f(L + x) - f(L) = target, i.e. the positive root of a x² + B x - T."""
        b_coef = 2 * self.a * history_len + self.b
        return 2 * target / (b_coef + math.sqrt(b_coef * b_coef + 4 * self.a * target))


def fit_quadratic(lengths: Sequence[int], latencies: Sequence[float]) -> QuadraticLatency:
    """Least-squares fit of f(l) = a l² + b l + c to (length, seconds) samples.

    The first sample is dropped (the first forward pays for warm-up). Raises ValueError when
    fewer than MIN_FIT_POINTS samples remain, the samples do not determine three coefficients,
    or a is not positive (no measurable quadratic cost). A negative b is clamped to 0.
    """
    if len(lengths) != len(latencies):
        raise ValueError(f"{len(lengths)} lengths but {len(latencies)} latencies")
    ls = np.asarray(lengths[1:], dtype=np.float64)
    ts = np.asarray(latencies[1:], dtype=np.float64)
    if len(ls) < MIN_FIT_POINTS:
        raise ValueError(f"too few profile samples: {len(ls)} after the warm-up one (need {MIN_FIT_POINTS})")
    if not (np.all(np.isfinite(ts)) and np.all(ls > 0)):
        raise ValueError(f"bad profile samples: lengths={ls.tolist()} latencies={ts.tolist()}")
    scale = float(ls.max())  # fit in u = l / scale: columns of one magnitude
    u = ls / scale
    coef, _, rank, _ = np.linalg.lstsq(np.column_stack([u * u, u, np.ones_like(u)]), ts, rcond=None)
    if rank < 3:
        raise ValueError(f"profile lengths {sorted(set(ls.tolist()))} cannot determine a quadratic")
    quad, lin, const = (float(v) for v in coef)  # quad = a scale², lin = b scale
    if quad <= MIN_QUADRATIC_SHARE * abs(quad + lin + const):
        share = quad / abs(quad + lin + const)
        raise ValueError(f"fitted a={quad / scale**2:.3e} s/token² is not positive ({share:.1e} of f({scale:.0f}))")
    if lin < 0:
        logger.warning("fitted b=%.3e s/token is negative; using b=0", lin / scale)
        lin = 0.0
    return QuadraticLatency(a=quad / scale**2, b=lin / scale, c=const)


@dataclass(frozen=True)
class ChunkPlanner:
    """How many prompt tokens to prefill next. With `fit` None: fixed chunks of `base`."""

    base: int  # tokens: the chunked-prefill size; the planned chunk at history 0
    page_size: int  # tokens per KV page
    context_len: int  # tokens: no request extends past it
    fit: QuadraticLatency | None = None  # None: dynamic chunking off
    smoothing: float = 0.75  # in [0, 1]: 1 follows x*, 0 keeps `base`; 0.75 is SGLang's default

    def __post_init__(self) -> None:
        if self.base < 1 or self.page_size < 1 or self.context_len < 1:
            raise ValueError(f"bad sizes: base={self.base} page_size={self.page_size} context_len={self.context_len}")
        if not 0.0 <= self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in [0, 1], got {self.smoothing}")

    @classmethod
    def from_profile(
        cls,
        lengths: Sequence[int],
        latencies: Sequence[float],
        base: int,
        page_size: int,
        context_len: int,
        smoothing: float = 0.75,
    ) -> ChunkPlanner:
        """A planner from profile samples; on a bad fit, a warning and fixed chunks."""
        try:
            fit = fit_quadratic(lengths, latencies)
        except ValueError as e:
            logger.warning("dynamic chunking off, fixed chunks of %d tokens: %s", base, e)
            fit = None
        else:
            logger.info("prefill latency f(l) = %.3e l² + %.3e l + %.3e s", fit.a, fit.b, fit.c)
        return cls(base, page_size, context_len, fit, smoothing)

    @property
    def floor(self) -> int:
        return self.base // 4

    @property
    def alignment(self) -> int:
        return max(self.page_size, 64)

    @property
    def target(self) -> float:
        """T = f(base) - f(0): seconds every chunk should cost."""
        assert self.fit is not None
        return self.fit.chunk_cost(0, self.base)

    def next_chunk(self, history_len: int, remaining: int) -> int:
        """Tokens to prefill next, in [1, remaining], for a request with `history_len` tokens
        cached and `remaining` prompt tokens left (history_len + remaining <= context_len, so
        no chunk crosses the context end). The last piece is returned whole, unaligned."""
        if history_len < 0 or remaining < 1 or history_len + remaining > self.context_len:
            raise ValueError(
                f"bad request: history_len={history_len} remaining={remaining} (context {self.context_len})"
            )
        if self.fit is None:
            return min(self.base, remaining)
        return min(self._dynamic_chunk(history_len), remaining)

    def chunks(self, prompt_len: int, history_len: int = 0) -> list[int]:
        """The whole plan for a prompt: next_chunk applied until nothing remains."""
        plan: list[int] = []
        done = 0
        while done < prompt_len:
            plan.append(self.next_chunk(history_len + done, prompt_len - done))
            done += plan[-1]
        return plan

    def _dynamic_chunk(self, history_len: int) -> int:
        """x* smoothed toward base, at least the floor, aligned down; never under one alignment
        unit (so above `base` only when base < alignment; the caller's budget caps it)."""
        assert self.fit is not None
        x = self.fit.chunk_for_cost(history_len, self.target)
        x = self.base + self.smoothing * (x - self.base)  # <= base, as x* <= base
        x = max(int(x + 1e-6), self.floor)  # + 1e-6: round-off must not turn x* = base into base - 1
        return max(x // self.alignment * self.alignment, self.alignment)


@dataclass
class StepCosts:
    """What this engine's steps took lately, measured from each step's scheduling to its tokens
    (`Scheduler.postprocess`): `decode_s`, a step of the running decodes alone, and `token_s`, a
    prompt token beside them, each a moving average with `weight` on the newest (module docstring)."""

    weight: float = 0.25
    decode_s: float | None = None  # None: not measured yet
    token_s: float | None = None

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        if not seconds >= 0:
            return  # (a clock that went back: nothing learned)
        if not prompt_tokens:
            if decodes:
                self.decode_s = self._mix(self.decode_s, seconds)
        elif not decodes:
            self.token_s = self._mix(self.token_s, seconds / prompt_tokens)
        elif self.decode_s is not None:
            self.token_s = self._mix(self.token_s, max(seconds - self.decode_s, 0.0) / prompt_tokens)
        elif self.token_s is not None:
            self.decode_s = self._mix(self.decode_s, max(seconds - self.token_s * prompt_tokens, 0.0))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)


@dataclass(frozen=True)
class DecodeBudget:
    """How many prompt tokens a step may take beside running decodes (module docstring)."""

    costs: StepCosts  # measured; read at each step
    target_s: float  # > 0: a step's seconds while requests decode
    min_tokens: int  # >= 1: prompt tokens a step takes at least, whatever the target
    page_size: int  # >= 1: what the target allows is aligned down to whole pages

    def __post_init__(self) -> None:
        if not self.target_s > 0 or self.min_tokens < 1 or self.page_size < 1:
            raise ValueError(
                f"bad budget: target_s={self.target_s} min_tokens={self.min_tokens} page_size={self.page_size}"
            )

    def tokens_within(self, seconds: float) -> int:
        """The most prompt tokens, in whole pages, that `seconds` pay for (0 until a prompt token's
        cost is measured, or when not a page's worth fits)."""
        token_s = self.costs.token_s
        if seconds <= 0 or token_s is None:
            return 0
        x = int(seconds / token_s + 1e-9) if token_s > 0 else 1 << 62
        return x // self.page_size * self.page_size

    def allowance(self, decodes: int) -> StepAllowance:
        """What one step with this many decodes leaves for its prompt chunks: the target less a
        decode step's measured seconds (none before one is measured, or without decodes)."""
        decode_s = (self.costs.decode_s or 0.0) if decodes else 0.0
        return StepAllowance(self, self.target_s - decode_s)


@dataclass
class StepAllowance:
    """One step's prompt tokens under a `DecodeBudget`: `allowed` for the next chunk, `spend` once
    it is scheduled. The first `min_tokens` of a step are allowed whatever they cost."""

    budget: DecodeBudget
    left_s: float  # the target's seconds the step's chunks may still take (< 0: over already)
    taken: int = 0  # prompt tokens the step holds so far

    def allowed(self) -> int:
        """The most tokens the next chunk may take: what fits the time left, or the rest of the
        step's floor if that is more."""
        return max(self.budget.tokens_within(self.left_s), self.budget.min_tokens - self.taken)

    def spend(self, tokens: int) -> None:
        self.left_s -= tokens * (self.budget.costs.token_s or 0.0)
        self.taken += tokens


def default_profile_lengths(base_chunk: int, context_len: int, count: int = 12, span: int = 4) -> list[int]:
    """`count` prefill lengths up to min(span * base_chunk, context_len): the longest first
    (the warm-up run, dropped by the fit, which also sizes the buffers), then evenly spaced
    lengths from small to the longest."""
    longest = min(span * base_chunk, context_len)
    spread = [longest * k // (count - 1) for k in range(1, count)]
    return [longest, *dict.fromkeys(n for n in spread if n > 0)]


def profile_prefill(run: Callable[[int], float], lengths: Sequence[int], progress: bool = True) -> list[float]:
    """Seconds `run(length)` measured for each length (a whole prefill from an empty cache)."""
    latencies: list[float] = []
    with Progress("profiling prefill latency", len(lengths), enabled=progress) as bar:
        for length in lengths:
            latencies.append(run(length))
            bar.advance()
    return latencies
