"""RingDriver: runs one rank's role over a transport, one step per call.

A rank's control thread calls `step` in a loop, rounds back to back:

    driver = RingDriver(make_role(state), transport, guard=state_lock)
    while running:
        result = driver.step(timeout=0.05)
        hand_over(result.decisions)            # rank 0: issued; others: applied
        if result.idle:                        # rank 0 only: nothing to agree on
            wake.wait(idle_wait_s)             # set by whoever calls set_local / abort

- rank 0: with no round on the ring, starts one (sends it to rank 1), then waits up to
  `timeout` for the result and concludes it. When it has no live rid and no decision to
  ship it starts nothing and returns `idle=True` at once, so the loop does not spin.
- rank k > 0: waits up to `timeout` for a round, applies its decisions, merges, forwards.

The driver reads and writes the state only inside `guard` (a lock shared with the
thread that calls `set_local`/`abort`), and never holds it while it waits on the
transport. With pp_size == 1 rank 0 concludes its own proposal; no transport is needed.

Rank k applies a decision one ring traversal after rank 0 issued it. Work that rank 0
sends down another channel because of decision s (a microbatch with an admitted request)
should carry s + 1 (rank 0's `state.applied_seq` then); rank k steps until its own
`state.applied_seq` reaches it before acting on that work.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from kvbridge.consensus.codec import RoundMsg
from kvbridge.consensus.roles import Follower, Leader, Role
from kvbridge.consensus.state import RankState
from kvbridge.consensus.transport import Transport
from kvbridge.consensus.types import Report, Ruling


@dataclass(frozen=True)
class StepResult:
    """What one `step` did on one rank."""

    decisions: tuple[Ruling, ...] = ()  # issued (rank 0) or applied (rank k) in this step, in seq order
    started: int | None = None  # round id this step started (rank 0)
    finished: int | None = None  # round id this step concluded (rank 0) or relayed (rank k)
    report: Report | None = None  # this rank's contribution to a round during this step
    idle: bool = False  # rank 0: nothing on the ring and nothing to agree on; wait for a local change


class RingDriver:
    """Drives `role` (Leader on rank 0, Follower elsewhere) over `transport`."""

    def __init__(self, role: Role, transport: Transport | None, *, guard: AbstractContextManager | None = None):
        if transport is None and role.state.pp_size > 1:
            raise ValueError(f"pp_size {role.state.pp_size} needs a transport")
        self.role = role  # this rank's role, chosen once
        self.transport = transport  # this rank's ends of the ring (None when pp_size == 1)
        self.guard = guard if guard is not None else nullcontext()  # held around every state access

    @property
    def state(self) -> RankState:
        return self.role.state

    def step(self, timeout: float | None = None) -> StepResult:
        """One step of this rank's role; waits at most `timeout` seconds on the transport."""
        if isinstance(self.role, Leader):
            return self._lead(self.role, timeout)
        return self._follow(self.role, timeout)

    def abort(self, rid: str) -> Ruling | None:
        """Rank 0: abort `rid` everywhere (it rides the next round)."""
        if not isinstance(self.role, Leader):
            raise RuntimeError(f"only rank 0 aborts; this is rank {self.state.rank}")
        with self.guard:
            return self.role.abort(rid)

    def _lead(self, leader: Leader, timeout: float | None) -> StepResult:
        started, report = None, None
        if leader.round_in_flight is None:  # only this thread starts and concludes rounds
            with self.guard:
                proposal = leader.propose()
                if proposal is None:
                    return StepResult(idle=True)
                msg, report = proposal
                started = msg.round_id
                if self.transport is None:  # a ring of one: rank 0 is also the last rank
                    decisions = leader.conclude(msg.without_decisions())
                    return StepResult(decisions, started, started, report, idle=not decisions)
            self.transport.send(msg.encode())
        raw = self.transport.recv(timeout)
        if raw is None:
            return StepResult(started=started, report=report)
        result = RoundMsg.decode(raw)
        with self.guard:
            decisions = leader.conclude(result)
        return StepResult(decisions, started, result.round_id, report)

    def _follow(self, follower: Follower, timeout: float | None) -> StepResult:
        raw = self.transport.recv(timeout)
        if raw is None:
            return StepResult()
        msg = RoundMsg.decode(raw)
        with self.guard:
            out, report = follower.relay(msg)
        self.transport.send(out.encode())
        return StepResult(msg.decisions, finished=msg.round_id, report=report)


def run_round(drivers: Sequence[RingDriver]) -> StepResult:
    """One whole round on a single-threaded in-memory ring: rank 0, ranks 1..P-1, rank 0 again.

    Returns rank 0's result: the decisions of the round (or idle)."""
    first = drivers[0].step(timeout=0)
    if first.idle or first.finished is not None:
        return first
    for d in drivers[1:]:
        relayed = d.step(timeout=0)
        assert relayed.finished == first.started, f"rank {d.state.rank} relayed {relayed.finished}, not {first.started}"
    last = drivers[0].step(timeout=0)
    assert last.finished == first.started, f"round {first.started} did not come back to rank 0"
    return StepResult(last.decisions, first.started, last.finished, first.report)
