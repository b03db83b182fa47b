"""The seed's schedule, as a baseline in the same simulator: consensus rides the microbatch loop.

In the seed, every rank's loop iteration (one stage time) carries one hop of each
consensus list: rank 0 reads its queues at the start of iteration j and passes its
(ready, failed) lists on with microbatch j; rank k merges its own when it runs that
microbatch, at iteration j + k (the ranks run staggered by one stage); the last rank
sends the result back to rank 0, which acts on it in iteration j + P - 1 and schedules
the request at the start of iteration j + P. A new list starts every iteration, so up to
P are on the ring at once; decisions go down the ring the same way, one hop per
iteration. The round logic is ours (the same Leader and Follower), pipelined; only the
schedule differs: each hop costs one stage time instead of one small message.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.consensus.codec import RoundMsg
from kvbridge.consensus.driver import StepResult
from kvbridge.consensus.roles import Follower, Leader
from kvbridge.consensus.scenario import RequestPlan
from kvbridge.consensus.simulator import DEFAULT_TIMING, Timing, _Simulation


class MicrobatchSimulation(_Simulation):
    """The seed's schedule: one hop per loop iteration, a new round every iteration."""

    def __init__(self, plans: Sequence[RequestPlan], pp_size: int, timing: Timing = DEFAULT_TIMING, seed: int = 0):
        super().__init__(plans, pp_size, timing, seed)
        self.leader = Leader(self.states[0], max_in_flight=1 << 30)  # one round per iteration, all in flight
        self.followers = {st.rank: Follower(st) for st in self.states[1:]}
        self._looping = False  # rank 0's loop iterates (it stops when there is nothing to agree on)

    def _tick(self) -> None:
        """Start of a rank-0 loop iteration: read the local view, send it on with this microbatch."""
        if not self.leader.wants_round:
            self._looping = False
            return
        msg, report = self.leader.propose()
        self._record(0, StepResult(started=msg.round_id, report=report))
        self._hop_after_iteration(1 % self.pp_size, msg)
        self.queue.after(self.timing.stage_ms, self._tick)

    def _hop_after_iteration(self, to: int, msg: RoundMsg) -> None:
        # prio 0: at an iteration boundary rank 0 takes the returning result before it starts the next round
        self.num_messages += 1
        self.queue.at(self.queue.now + self.timing.stage_ms, self._arrive, to, msg.encode(), prio=0)

    def _arrive(self, rank: int, payload: bytes) -> None:
        msg = RoundMsg.decode(payload)
        if rank == 0:  # with pp_size 1 rank 0 is also the last rank, which drops the decisions
            decisions = self.leader.conclude(msg.without_decisions() if self.pp_size == 1 else msg)
            self._record(0, StepResult(decisions, finished=msg.round_id))
            return
        out, report = self.followers[rank].relay(msg)
        self._record(rank, StepResult(msg.decisions, finished=msg.round_id, report=report))
        self._hop_after_iteration((rank + 1) % self.pp_size, out)

    def _wake(self, rank: int) -> None:
        if rank == 0 and not self._looping:
            self._looping = True
            self.queue.at(self.next_boundary(self.queue.now), self._tick)

    def _abort(self, rid: str) -> None:
        if self.leader.abort(rid) is not None:
            self._wake(0)

    def _busy(self) -> bool:
        return self.leader.round_in_flight is not None
