"""Fault injection for tests and drills; off unless `--fault-inject` is given.

    --fault-inject transfer_fail=0.05,transfer_delay_ms=200,rank1:step_delay_ms=50,seed=7

Each item is KEY=VALUE, optionally for one rank only (`rankN:KEY=VALUE`), so that a
failure can hit one rank of a pipeline and not the others. Keys:

- step_delay_ms: every forward step on the rank takes this much longer (a slow stage);
- transfer_delay_ms: a rank reports its KV transfer of a request done this much later
  (prefill: pushes landed; decode: pages arrived), holding the request in `transferring`;
- transfer_fail: probability that a request's KV transfer fails on the rank (prefill ranks
  fail their pushes; decode ranks fail the arrival), with reason "injected transfer failure";
- drop_notice: probability that a prefill rank never sends a request's "all pages sent"
  notice (a lost message: the hand-off hangs until the transfer timeout ends it);
- consensus_fail_after: the rank's consensus channel breaks at its N-th status change of its own:
  that change and every later one never reach the ring, and the channel fails at its next round
  (a broken control ring: the rank ends, so the node fails its streams and exits; a request
  that needed the change cannot complete first, however fast the host);
- seed: the random stream of the probabilities (per rank: seed + rank).

Rank processes call `init(spec, rank)` once; the code paths ask `current()`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

KEYS = {
    "step_delay_ms": float, "transfer_delay_ms": float, "transfer_fail": float, "drop_notice": float,
    "consensus_fail_after": int, "seed": int,
}  # fmt: skip
PROBABILITIES = ("transfer_fail", "drop_notice")
INJECTED = "injected transfer failure"


@dataclass
class Faults:
    step_delay_ms: float = 0.0
    transfer_delay_ms: float = 0.0
    transfer_fail: float = 0.0
    drop_notice: float = 0.0
    consensus_fail_after: int = 0  # 0 = never
    seed: int = 0
    rng: random.Random = field(default_factory=random.Random, repr=False)

    @property
    def active(self) -> bool:
        return bool(
            self.step_delay_ms or self.transfer_delay_ms or self.transfer_fail or self.drop_notice
            or self.consensus_fail_after
        )  # fmt: skip

    def after_step(self) -> None:
        if self.step_delay_ms:
            time.sleep(self.step_delay_ms / 1000)

    def fail_transfer(self) -> bool:
        """Whether this request's transfer fails here (one draw per request and rank)."""
        return self.transfer_fail > 0 and self.rng.random() < self.transfer_fail

    def lose_notice(self) -> bool:
        return self.drop_notice > 0 and self.rng.random() < self.drop_notice

    def report_done(self, report: Callable[[], None]) -> None:
        """Report a finished transfer now, or transfer_delay_ms later (from a timer thread)."""
        if not self.transfer_delay_ms:
            report()
            return
        timer = threading.Timer(self.transfer_delay_ms / 1000, report)
        timer.daemon = True
        timer.start()


def parse(spec: str, rank: int) -> Faults:
    """The faults of `rank` under `spec`; ValueError naming the bad item."""
    values: dict[str, float | int] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        target, _, kv = item.rpartition(":")
        key, eq, raw = kv.partition("=")
        if not eq or key not in KEYS:
            raise ValueError(f"--fault-inject: bad item {item!r} (KEY=VALUE, keys: {', '.join(KEYS)})")
        if target and not (target.startswith("rank") and target[4:].isdigit()):
            raise ValueError(f"--fault-inject: bad rank in {item!r} (write rankN:KEY=VALUE)")
        try:
            value = KEYS[key](raw)
        except ValueError:
            raise ValueError(f"--fault-inject: {key} must be a number, got {raw!r}") from None
        if key in PROBABILITIES and not 0 <= value <= 1:
            raise ValueError(f"--fault-inject: {key} is a probability in [0, 1], got {raw!r}")
        if key.endswith("_ms") and value < 0:
            raise ValueError(f"--fault-inject: {key} must be >= 0, got {raw!r}")
        if not target or int(target[4:]) == rank:
            values[key] = value
    faults = Faults(**values)
    faults.rng.seed(faults.seed * 1_000_003 + rank)
    return faults


_current = Faults()


def init(spec: str, rank: int) -> Faults:
    global _current
    _current = parse(spec, rank)
    return _current


def current() -> Faults:
    return _current
