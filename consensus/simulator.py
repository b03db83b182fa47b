"""A deterministic discrete-event simulator of one pipeline's consensus: simulated clock, seeded.

`RingSimulation` runs the real `RingDriver`s of every rank over simulated links (random
per-hop delay, FIFO), against a seeded workload (`consensus.scenario`): requests
register, settle READY or FAILED on each rank at random times, fail late, get aborted.
Rank 0's scheduler runs one loop iteration per stage time; a READY decision is
*admitted* at the first iteration boundary at or after rank 0 holds it.

It records every rank's applied log, every round's reports and decisions, when each
(stream, rid) became READY on each rank and settled, when rank 0 decided and admitted
it. The same core runs the seed's schedule as a baseline (`consensus.baseline`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvbridge.consensus.audit import RoundRecord
from kvbridge.consensus.driver import RingDriver, StepResult
from kvbridge.consensus.roles import Leader, make_role
from kvbridge.consensus.scenario import RequestPlan
from kvbridge.consensus.state import RankState
from kvbridge.consensus.types import LocalStatus, Report, Ruling, Stream, Verdict

Key = tuple[Stream, str]  # (stream, rid)


@dataclass(frozen=True)
class Timing:
    """Simulated costs, in milliseconds."""

    stage_ms: float = 50.0  # compute time of one pipeline stage: one loop iteration of every rank
    hop_ms: float = 0.2  # median one-way delay of a small control message to the next rank (gloo, TCP)
    hop_jitter: float = 0.5  # each hop takes hop_ms * uniform(1 - hop_jitter, 1 + hop_jitter)
    proc_ms: float = 0.02  # a control thread's time to handle one message or wake-up

    def __post_init__(self) -> None:
        if self.stage_ms <= 0 or self.hop_ms < 0 or not 0 <= self.hop_jitter <= 1 or self.proc_ms < 0:
            raise ValueError(f"bad timing: {self}")
        if self.hop_ms + self.proc_ms <= 0:  # back-to-back rounds would stop the simulated clock
            raise ValueError(f"a hop must take time: hop_ms {self.hop_ms} + proc_ms {self.proc_ms} <= 0")


DEFAULT_TIMING = Timing()


class EventQueue:
    """The simulated clock: callbacks at times (ms); ties run by priority, then in scheduling order."""

    def __init__(self):
        self.now = 0.0  # current simulated time, ms
        self.num_events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, int, Callable, tuple]] = []
        self._count = 0

    def at(self, t: float, fn: Callable, *args, prio: int = 1) -> None:
        assert t >= self.now, f"scheduling at {t} < now {self.now}"
        heapq.heappush(self._heap, (t, prio, self._count, fn, args))
        self._count += 1

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, max_events: int) -> bool:
        """Run until nothing is left (True) or `max_events` ran (False)."""
        while self._heap:
            if self.num_events >= max_events:
                return False
            t, _, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            self.num_events += 1
            fn(*args)
        return True


class Environment:
    """Plays request plans against the ranks' states, as their KV engines and queues would.

    Calls `wake(rank)` after changing a rank's local view and `abort(rid)` at abort times;
    the simulation calls `on_applied` with every decision a rank applies."""

    def __init__(self, plans: Iterable[RequestPlan], states: Sequence[RankState], queue: EventQueue, wake, abort):
        self.plans = {p.rid: p for p in plans}  # rid -> plan
        self.states = states  # by rank
        self.queue = queue
        self.wake: Callable[[int], None] = wake
        self.abort: Callable[[str], None] = abort
        self.ready_at: dict[Key, list[float | None]] = {}  # when the stage became READY on each rank
        self.settled: dict[Key, float] = {}  # earliest time it was READY on every rank at once, or FAILED on one

    def start(self) -> None:
        for p in self.plans.values():
            for rank, lag in enumerate(p.register_lag_ms):
                self.queue.at(p.arrival_ms + lag, self.register, rank, p.rid, 0)
            if p.abort_ms is not None:
                self.queue.at(p.abort_ms, self.abort, p.rid)

    def register(self, rank: int, rid: str, stage: int) -> None:
        plan = self.plans[rid]
        if self.states[rank].set_local(plan.path[stage], rid, LocalStatus.PENDING):
            self.queue.after(plan.stages[stage].settle_ms[rank], self.settle, rank, rid, stage)
            self.wake(rank)

    def settle(self, rank: int, rid: str, stage: int) -> None:
        plan, st = self.plans[rid], self.states[rank]
        stream, sp = plan.path[stage], plan.stages[stage]
        if st.status(stream, rid) is None:  # decided meanwhile: this rank's engine no longer polls it
            return
        key, now = (stream, rid), self.queue.now
        if sp.failed_rank == rank:
            st.set_local(stream, rid, LocalStatus.FAILED)
            self.settled[key] = min(self.settled.get(key, now), now)
        else:
            st.set_local(stream, rid, LocalStatus.READY)
            self.ready_at.setdefault(key, [None] * len(self.states))[rank] = now
            if all(s.status(stream, rid) == LocalStatus.READY for s in self.states):
                self.settled.setdefault(key, now)
            if sp.late_fail is not None and sp.late_fail[0] == rank:
                self.queue.after(sp.late_fail[1], self.fail_late, rank, rid, stage)
        self.wake(rank)

    def fail_late(self, rank: int, rid: str, stage: int) -> None:
        stream = self.plans[rid].path[stage]
        if self.states[rank].status(stream, rid) is None:
            return
        self.states[rank].set_local(stream, rid, LocalStatus.FAILED)
        now = self.queue.now
        self.settled[(stream, rid)] = min(self.settled.get((stream, rid), now), now)
        self.wake(rank)

    def on_applied(self, rank: int, decisions: Iterable[Ruling]) -> None:
        """A READY decision moves the request on to its next stage, on this rank."""
        for d in decisions:
            if d.verdict != Verdict.READY or d.rid not in self.plans:
                continue
            path = self.plans[d.rid].path
            stage = path.index(d.stream) + 1
            if stage < len(path):
                self.register(rank, d.rid, stage)


@dataclass(frozen=True)
class SimResult:
    """What a run recorded. Times in ms of simulated time."""

    pp_size: int  # ranks
    states: tuple[RankState, ...]  # final per-rank states, logs included
    rounds: tuple[RoundRecord, ...]  # every concluded round, in order
    round_started: Mapping[int, float]  # round id -> when rank 0 started it
    ready_at: Mapping[Key, tuple[float | None, ...]]  # (stream, rid) -> when it became READY on each rank
    settled: Mapping[Key, float]  # (stream, rid) -> when it was READY everywhere or FAILED somewhere
    decided_at: Mapping[Key, float]  # (stream, rid) -> when rank 0 decided it READY
    admitted_at: Mapping[Key, float]  # (stream, rid) -> the first rank-0 loop iteration boundary after that
    quiescent: bool  # everything happened and the ring is empty (False: stopped at max_events)
    end_ms: float  # simulated time of the last event
    num_events: int  # events run
    num_messages: int  # control messages sent

    @property
    def logs(self) -> tuple[tuple[Ruling, ...], ...]:
        return tuple(st.log for st in self.states)

    def latencies(self, until: str = "admitted") -> list[float]:
        """For each READY decision: ms from every rank locally READY to rank 0 `until` ('decided'/'admitted')."""
        when = self.admitted_at if until == "admitted" else self.decided_at
        out = []
        for key, t in when.items():
            ready = self.ready_at.get(key)
            if ready is not None and None not in ready:
                out.append(t - max(ready))
        return out


class _Simulation:
    """The shared core: clock, states, environment, recording. Subclasses wire a protocol."""

    def __init__(self, plans: Sequence[RequestPlan], pp_size: int, timing: Timing, seed: int):
        self.pp_size, self.timing = pp_size, timing
        self.rng = random.Random(seed)
        self.queue = EventQueue()
        self.states = tuple(RankState(r, pp_size) for r in range(pp_size))
        self.env = Environment(plans, self.states, self.queue, self._wake, self._abort)
        self.phase = self.rng.uniform(0.0, timing.stage_ms)  # rank 0's loop boundaries: phase + j * stage_ms
        self.rounds: list[RoundRecord] = []
        self.round_started: dict[int, float] = {}
        self.decided_at: dict[Key, float] = {}
        self.admitted_at: dict[Key, float] = {}
        self.num_messages = 0
        self._reports: dict[int, dict[int, Report]] = {}  # round id -> rank -> report, until it concludes

    def run(self, max_events: int = 2_000_000) -> SimResult:
        self.env.start()
        drained = self.queue.run(max_events)
        return SimResult(
            self.pp_size,
            self.states,
            tuple(self.rounds),
            dict(self.round_started),
            {k: tuple(v) for k, v in self.env.ready_at.items()},
            dict(self.env.settled),
            dict(self.decided_at),
            dict(self.admitted_at),
            drained and not self._busy(),
            self.queue.now,
            self.queue.num_events,
            self.num_messages,
        )

    def next_boundary(self, t: float) -> float:
        """The first rank-0 loop iteration boundary at or after t."""
        period = self.timing.stage_ms
        return self.phase + math.ceil((t - self.phase) / period - 1e-9) * period

    def _record(self, rank: int, res: StepResult) -> None:
        now = self.queue.now
        if res.started is not None:
            self.round_started[res.started] = now
        if res.report is not None:
            self._reports.setdefault(res.report.round_id, {})[rank] = res.report
        if rank == 0 and res.finished is not None:
            by_rank = self._reports.pop(res.finished)
            reports = tuple(by_rank[r] for r in sorted(by_rank))
            first = self.states[0].applied_seq - len(res.decisions)
            self.rounds.append(RoundRecord(res.finished, reports, first, res.decisions))
            for d in res.decisions:
                if d.verdict == Verdict.READY:
                    self.decided_at[(d.stream, d.rid)] = now
                    self.admitted_at[(d.stream, d.rid)] = self.next_boundary(now)
        if rank != 0:
            leader = self.states[0]
            for d in res.decisions:  # agreement while in flight: every applied decision is rank 0's
                assert leader.decision(d.seq) == d, f"rank {rank} applied {d}, rank 0 has {leader.decision(d.seq)}"
        self.env.on_applied(rank, res.decisions)

    def _wake(self, rank: int) -> None:
        raise NotImplementedError

    def _abort(self, rid: str) -> None:
        raise NotImplementedError

    def _busy(self) -> bool:
        raise NotImplementedError


class _SimLink:
    """Rank `rank`'s ends of the simulated ring; implements Transport."""

    def __init__(self, sim: RingSimulation, rank: int):
        self.sim, self.rank = sim, rank
        self.inbox: deque[bytes] = deque()  # delivered, not yet received

    def send(self, payload: bytes) -> None:
        self.sim.send(self.rank, payload)

    def recv(self, timeout: float | None) -> bytes | None:
        return self.inbox.popleft() if self.inbox else None


class RingSimulation(_Simulation):
    """Ours: rounds back to back on a control channel of their own; one hop costs a small message's delay."""

    def __init__(self, plans: Sequence[RequestPlan], pp_size: int, timing: Timing = DEFAULT_TIMING, seed: int = 0):
        super().__init__(plans, pp_size, timing, seed)
        self.links = tuple(_SimLink(self, r) for r in range(pp_size))
        self.drivers = tuple(
            RingDriver(make_role(st), self.links[st.rank] if pp_size > 1 else None) for st in self.states
        )
        self._last_arrival = [0.0] * pp_size  # by receiving rank: keeps each link FIFO
        self._leader_idle = True  # rank 0 returned idle and waits for a local change

    @property
    def leader(self) -> Leader:
        return self.drivers[0].role

    def send(self, rank: int, payload: bytes) -> None:
        to = (rank + 1) % self.pp_size
        t = self.timing
        delay = t.hop_ms * self.rng.uniform(1.0 - t.hop_jitter, 1.0 + t.hop_jitter)
        arrival = max(self.queue.now + delay, self._last_arrival[to])
        self._last_arrival[to] = arrival
        self.num_messages += 1
        self.queue.at(arrival, self._deliver, to, payload)

    def _deliver(self, rank: int, payload: bytes) -> None:
        self.links[rank].inbox.append(payload)
        self.queue.after(self.timing.proc_ms, self._step, rank)

    def _step(self, rank: int) -> None:
        res = self.drivers[rank].step(timeout=0)
        self._record(rank, res)
        if rank == 0:
            if res.idle:
                self._leader_idle = True
            elif res.finished is not None:  # back to back: start the next round right away
                self.queue.after(self.timing.proc_ms, self._step, 0)

    def _wake(self, rank: int) -> None:
        if rank == 0 and self._leader_idle:
            self._leader_idle = False
            self.queue.after(self.timing.proc_ms, self._step, 0)

    def _abort(self, rid: str) -> None:
        d = self.drivers[0].abort(rid)
        if d is not None:
            self._wake(0)

    def _busy(self) -> bool:
        return self.leader.round_in_flight is not None or any(link.inbox for link in self.links)
