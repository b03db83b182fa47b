"""Seeded workloads for the simulator: when each request arrives, settles, fails or is aborted, per rank.

A plan is drawn up front from one seed, independent of the protocol's timing, so two
protocols can be run on the very same workload. Each request walks a path of streams
(as its daemon would: prefill bootstrapped then transferred; decode preallocated then
transferred, sometimes retracted after). Every rank registers a stage when it learns of
it (the first on arrival; a later one when it applies the READY decision of the one
before) and settles it a random time later: READY, or FAILED on one rank. Some stages
fail late, on one rank, after they were READY there. Some requests are aborted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvbridge.consensus.types import Stream

PATHS: tuple[tuple[Stream, ...], ...] = (
    (Stream.PREFILL_BOOTSTRAPPED, Stream.PREFILL_TRANSFERRED),
    (Stream.DECODE_PREALLOCATED, Stream.DECODE_TRANSFERRED),
    (Stream.DECODE_PREALLOCATED, Stream.DECODE_TRANSFERRED, Stream.DECODE_RETRACTED),
)


@dataclass(frozen=True)
class Workload:
    """The random workload's knobs. Times in milliseconds of simulated time."""

    num_requests: int = 16  # requests in the run
    arrival_ms: float = 20.0  # arrivals are uniform in [0, arrival_ms)
    register_lag_ms: float = 1.0  # a rank > 0 registers a first stage uniformly up to this long after rank 0
    settle_min_ms: float = 0.5  # a stage settles on a rank uniformly in [settle_min_ms, settle_max_ms]
    settle_max_ms: float = 10.0  # after that rank registered it
    p_fail: float = 0.05  # chance that a stage FAILS on one random rank instead of becoming READY there
    p_late_fail: float = 0.02  # chance that a stage fails on one random rank after it was READY there
    late_fail_max_ms: float = 5.0  # how long after READY, uniformly
    p_abort: float = 0.1  # chance that rank 0 aborts a request
    abort_window_ms: float = 30.0  # the abort comes uniformly within this long after arrival
    paths: tuple[tuple[Stream, ...], ...] = PATHS  # each request walks one of these, chosen uniformly

    def __post_init__(self) -> None:
        if self.num_requests < 0 or not 0 <= self.settle_min_ms <= self.settle_max_ms or not self.paths:
            raise ValueError(f"bad workload: {self}")
        for p in (self.p_fail, self.p_late_fail, self.p_abort):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"probabilities must be in [0, 1], got {p}")


@dataclass(frozen=True)
class StagePlan:
    """How one stage (stream) of one request plays out on every rank."""

    settle_ms: tuple[float, ...]  # by rank: from registering the stage to its settled status there
    failed_rank: int | None  # the rank where it settles FAILED (others: READY), or None
    late_fail: tuple[int, float] | None  # (rank, ms after READY there) of a late failure, or None


@dataclass(frozen=True)
class RequestPlan:
    """One request's whole story."""

    rid: str  # request id (some are non-ASCII, to exercise the wire's utf-8)
    arrival_ms: float  # when rank 0 registers its first stage
    register_lag_ms: tuple[float, ...]  # by rank: how much later that rank registers the first stage (rank 0: 0)
    path: tuple[Stream, ...]  # the streams it walks, in order
    stages: tuple[StagePlan, ...]  # one per stream of the path
    abort_ms: float | None  # when rank 0 aborts it (absolute), or None


def make_plans(workload: Workload, pp_size: int, seed: int) -> tuple[RequestPlan, ...]:
    """The workload's requests for a `pp_size`-rank pipeline, drawn from `seed` alone."""
    rng = random.Random(seed)
    return tuple(_request(workload, pp_size, rng, i) for i in range(workload.num_requests))


def _request(w: Workload, pp_size: int, rng: random.Random, i: int) -> RequestPlan:
    rid = f"réq-{i:04d}" if i % 7 == 3 else f"req-{i:04d}"
    arrival = rng.uniform(0.0, w.arrival_ms)
    lags = (0.0, *(rng.uniform(0.0, w.register_lag_ms) for _ in range(pp_size - 1)))
    path = rng.choice(w.paths)
    stages = tuple(_stage(w, pp_size, rng) for _ in path)
    abort = arrival + rng.uniform(0.0, w.abort_window_ms) if rng.random() < w.p_abort else None
    return RequestPlan(rid, arrival, lags, path, stages, abort)


def _stage(w: Workload, pp_size: int, rng: random.Random) -> StagePlan:
    settle = tuple(rng.uniform(w.settle_min_ms, w.settle_max_ms) for _ in range(pp_size))
    failed = rng.randrange(pp_size) if rng.random() < w.p_fail else None
    late = (rng.randrange(pp_size), rng.uniform(0.0, w.late_fail_max_ms)) if rng.random() < w.p_late_fail else None
    return StagePlan(settle, failed, late)
