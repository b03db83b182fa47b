"""What a node's role adds to rank 0's loop, and the colocated role, which adds nothing.

`Rank0Loop(..., role=PrefillRole(...))`: the loop (pipeline/rank0.py) schedules, runs and
post-processes microbatches; its role, chosen once at start-up, owns the queues a request passes
through before or after the scheduler and the one way a request of that role fails. The loop calls
it at fixed points:

    admit(req, add)      a new request from the front: into the scheduler, or the role's first queue
    handle(msg) -> bool  a message only this role understands (prefill Register, decode Fail, ...)
    tick(now)            once per turn, before scheduling: consensus verdicts, timeouts, moving queues
    evicted(req, pages)  the scheduler preempted req (retracting schedulers only)
    finished(req)->bool  the scheduler finished req (stop, length); True: the role keeps it for now
    fail(req, error, code, reason="error", **event)
                         THE way a live request ends early (abort, timeout, a failed hand-off, an
                         operator, a message that raised): every queue forgets it, every rank is told
    undecided(), queues(), sizes(), problems(), holders(), resting(), transfers_in_flight()
                         what the loop and the invariant checks need to know

A role's queues (prefill_node/queues.py, decode_node/queues.py) each hold requests of one phase and
offer the same small protocol: admit(req), on_verdict(req, ruling), remove(req), expire(now),
check_invariants(), rids().
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvbridge.engine.request import Phase, Request

if TYPE_CHECKING:
    from kvbridge.pipeline.messages import Add
    from kvbridge.pipeline.rank0 import Rank0Loop


# what a request waits for in a phase (a traced request's span of that phase says so); "" = any role
WAITS_FOR = {
    ("", Phase.WAITING): "the scheduler: KV pages and a batch slot",
    ("prefill", Phase.BOOTSTRAP): "the decode node's registration of its room (Bootstrap.Register)",
    ("prefill", Phase.TRANSFERRING): "consensus PREFILL_TRANSFERRED: every prefill rank's pushes landed",
    ("decode", Phase.PREALLOC): "KV pages, then consensus DECODE_PREALLOCATED: every decode rank expects the KV",
    ("decode", Phase.TRANSFERRING): "consensus DECODE_TRANSFERRED: the KV and the first token landed on every rank",
    ("decode", Phase.RETRACTED): "KV pages to resume into (its KV is in host memory)",
    ("decode", Phase.RESUMING): "consensus: its KV copied back on every rank",
}


class Role(Protocol):
    name: str  # "colocated" | "prefill" | "decode": in logs, listings and errors

    def bind(self, loop: Rank0Loop) -> None: ...
    def admit(self, req: Request, add: Add) -> None: ...
    def handle(self, msg: object) -> bool: ...
    def tick(self, now: float) -> None: ...
    def evicted(self, req: Request, pages: list[int]) -> None: ...
    def finished(self, req: Request) -> bool: ...
    def fail(self, req: Request, error: str, code: str, reason: str = "error", **event) -> None: ...
    def undecided(self) -> bool: ...
    def queues(self) -> dict[str, list[str]]: ...
    def holders(self) -> list[Request]: ...
    def resting(self) -> set[str]: ...
    def transfers_in_flight(self) -> int: ...
    def sizes(self) -> dict[str, int]: ...
    def problems(self) -> list[str]: ...


class ColocatedRole:
    """A node that serves whole requests: everything is the scheduler's."""

    name = "colocated"

    def bind(self, loop: Rank0Loop) -> None:
        self.loop = loop

    def admit(self, req: Request, add: Add) -> None:
        self.loop.move(req, Phase.WAITING)
        self.loop.scheduler.add(req)

    def handle(self, msg: object) -> bool:
        return False

    def tick(self, now: float) -> None:
        pass

    def evicted(self, req: Request, pages: list[int]) -> None:
        raise AssertionError("a colocated scheduler recomputes what it preempts")

    def finished(self, req: Request) -> bool:
        return False

    def fail(self, req: Request, error: str, code: str, reason: str = "error", **event) -> None:
        self.loop.end(req, error, code, reason, **event)

    def undecided(self) -> bool:
        return False

    def queues(self) -> dict[str, list[str]]:
        return {}

    def holders(self) -> list[Request]:
        return []

    def resting(self) -> set[str]:
        return set()

    def transfers_in_flight(self) -> int:
        return 0

    def sizes(self) -> dict[str, int]:
        return {}

    def problems(self) -> list[str]:
        return []


def live_rulings(chan, loop: Rank0Loop):
    """(request, ruling) for each consensus ruling taken now whose request is still live here."""
    for ruling in chan.take_decisions():
        req = loop.requests.get(ruling.rid)
        if req is not None:
            yield req, ruling


class Deadlines:
    """Finds a role's requests past their hand-off deadline, looking at most every `every_s`."""

    def __init__(self, every_s: float = 0.1):
        self.every_s, self._next = every_s, 0.0

    def time_to_look(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self.every_s
        return True

    @staticmethod
    def overdue(loop: Rank0Loop, now: float) -> list[Request]:
        return [r for r in loop.requests.values() if r.handoff is not None and r.handoff.deadline <= now]


class PhaseQueue:
    """The requests of a role that wait in one phase (`phases`: the ones a member may be in), in
    arrival order. A role's queues share this protocol: admit, remove (its fail), rids, len, and
    check_invariants; a queue whose members move on a consensus verdict adds on_verdict. Deadlines
    are not the queue's: they are on each request's hand-off record (a prefill request's bootstrap
    deadline runs while it is still in the scheduler's queues), so a role finds expired requests
    in one pass over its live ones."""

    phases: frozenset[Phase] = frozenset()

    def __init__(self) -> None:
        self._members: dict[str, Request] = {}

    def admit(self, req: Request) -> None:
        assert req.phase in self.phases, f"{req.rid} is {req.phase}, not one of {type(self).__name__}'s phases"
        self._members[req.rid] = req

    def remove(self, req: Request) -> bool:
        """Forget `req` (it failed, or moved on); True if it was here."""
        return self._members.pop(req.rid, None) is not None

    def __contains__(self, req: Request) -> bool:
        return self._members.get(req.rid) is req

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self):
        return iter(self._members.values())  # (callers that remove members while iterating copy first)

    def first(self) -> Request | None:
        return next(iter(self._members.values()), None)

    def rids(self) -> list[str]:
        return list(self._members)

    def check_invariants(self) -> list[str]:
        name = type(self).__name__
        wrong = [(rid, r.phase) for rid, r in self._members.items() if r.phase not in self.phases]
        return [f"{rid} is in the {name} in phase {phase}" for rid, phase in wrong]
