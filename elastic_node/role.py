"""What lets one node change role between requests: rank 0's `ElasticRole` and every rank's
`ElasticAgent`, each holding one object per role and forwarding to the current one.

A switch (pipeline/messages.py SetRole, from the front) waits until nothing is live on rank 0:
no request, no microbatch in flight, no consensus ruling pending, no page resting in a decode
node's quarantine. Then rank 0 decides SWITCH (pipeline/log.py Switched) and every rank, applying
its log in order, swaps its agent at that entry: no rank computes a step of one role after a
step of the other. The pool, the page allocator and its prefix cache stay: a page's KV is a
function of its tokens (and cache salt) whatever role computed or received it.

With `migrate`, the live requests end at once with UNAVAILABLE (a router resumes their streams
elsewhere, router/routed.py); without it, they finish here first. New requests that reach rank 0
while a switch waits are refused (UNAVAILABLE), so the wait ends. A SetRole back to the role the
node has, while a switch waits, withdraws it (its asker is told ABORTED); once the switch is made,
the same SetRole is a switch back like any other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbridge.common.logs import log_event
from kvbridge.common.shown import shown
from kvbridge.engine.batch import ForwardBatch
from kvbridge.engine.request import Request
from kvbridge.pipeline.agent import KVAgent
from kvbridge.pipeline.log import SWITCH, LogEntry, Switched
from kvbridge.pipeline.messages import Add, Answer, Fail, PeerDown, Register, Revoke, Revoked, SetRole
from kvbridge.pipeline.roles import Role

if TYPE_CHECKING:
    from kvbridge.pipeline.rank0 import Rank0Loop

log = logging.getLogger("kvbridge.node")
ROLE_NAMES = ("prefill", "decode", "colocated")


class ElasticAgent(KVAgent):
    """A rank's agents, one per role; the log's SWITCH entry picks the one that acts."""

    def __init__(self, agents: dict[str, KVAgent], role: str, live: Callable[[], int] = lambda: 0):
        self.agents, self.role = agents, role
        self.current = agents[role]
        self.live = live  # requests this rank holds (its loop's): none at a switch

    def on_decision(self, d: LogEntry) -> None:
        if d.kind != SWITCH:
            self.current.on_decision(d)
            return
        # every rank checks what rank 0 checked: a rank that still held a request would compute (or
        # move) its KV under the wrong role; stopping loudly beats that
        held = self.live() + sum(a.holding() for a in self.agents.values())
        if held:
            raise AssertionError(f"SWITCH at log entry {d.seq} with {held} requests live or moving on this rank")
        self.role, self.current = d.info.role, self.agents[d.info.role]

    def after_forward(self, batch: ForwardBatch) -> None:
        self.current.after_forward(batch)

    def on_sampled(self, batch: ForwardBatch, tokens: list[int], logprobs: list) -> None:
        self.current.on_sampled(batch, tokens, logprobs)


class ElasticRole:
    """Rank 0's role objects, one made per switch (fresh queues); `make[name]()` builds one."""

    def __init__(self, make: dict[str, Callable[[], Role]], role: str):
        self.make = make
        self.current: Role = make[role]()
        self.epoch = 0  # switches made since start
        self.pending: SetRole | None = None
        self.asked = self.deadline = 0.0  # when the pending switch was asked for, and when it gives up

    @property
    def name(self) -> str:
        return self.current.name

    def bind(self, loop: Rank0Loop) -> None:
        self.loop = loop
        self._bind()

    def _bind(self) -> None:
        """What the scheduler does differently per role, then the role's own wiring."""
        s, name = self.loop.scheduler, self.current.name
        s.hold_finished = name == "prefill"  # pages outlive the forward: they are still to move
        s.evict = "retract" if name == "decode" else "recompute"  # a decode node cannot recompute a prompt
        s.admissible = None  # (PrefillRole.bind sets its own)
        self.current.bind(self.loop)

    # ---------------------------------------------------------------- what the loop calls

    def admit(self, req: Request, add: Add) -> None:
        self.current.admit(req, add)
        if self.pending is not None:  # (the front refuses them first; these were on their way)
            self.current.fail(req, self._why(self.pending.role), "UNAVAILABLE", reason="abort")

    def handle(self, msg: object) -> bool:
        if isinstance(msg, SetRole):
            self._asked(msg)
        elif self.current.handle(msg):
            pass
        elif isinstance(msg, Register):  # a decode node late for a room of this node's last role
            why = f"this node serves {self.name} now: it has no room {msg.registration.room}"
            self.loop.outbox.put(Answer(msg.token, {"code": "FAILED_PRECONDITION", "error": why}))
        elif isinstance(msg, Revoke):  # (a switch waits for every room of a prefill role to be revoked)
            why = f"this node serves {self.name} now: it has no room {msg.room}"
            self.loop.outbox.put(Answer(msg.token, {"code": "NOT_FOUND", "error": why}))
        else:
            return isinstance(msg, (Fail, PeerDown, Revoked))  # about requests of its last role: none is live
        return True

    def tick(self, now: float) -> None:
        self.current.tick(now)
        if self.pending is None:
            return
        if self._idle():
            self._switch()
        elif now >= self.deadline:
            msg, self.pending = self.pending, None
            live = len(self.loop.requests)
            error = f"the switch to {msg.role} timed out after {msg.wait_s:g} s: {live} requests still live"
            self.loop.outbox.put(Answer(msg.token, {"code": "DEADLINE_EXCEEDED", "error": error, "epoch": self.epoch}))

    def evicted(self, req: Request, pages: list[int]) -> None:
        self.current.evicted(req, pages)

    def finished(self, req: Request) -> bool:
        return self.current.finished(req)

    def fail(self, req: Request, error: str, code: str, reason: str = "error", **event) -> None:
        self.current.fail(req, error, code, reason, **event)

    def undecided(self) -> bool:
        return self.current.undecided()

    def queues(self) -> dict[str, list[str]]:
        return self.current.queues()

    def holders(self) -> list[Request]:
        return self.current.holders()

    def resting(self) -> set[str]:
        return self.current.resting()

    def transfers_in_flight(self) -> int:
        return self.current.transfers_in_flight()

    def sizes(self) -> dict[str, int]:
        return self.current.sizes()

    def problems(self) -> list[str]:
        return self.current.problems()

    # ---------------------------------------------------------------- the switch

    def _asked(self, msg: SetRole) -> None:
        answer = None
        if msg.role not in self.make:
            answer = {
                "code": "INVALID_ARGUMENT",
                "error": f"role must be one of {', '.join(self.make)}, got {shown(msg.role)}",
            }
        elif self.pending is not None and msg.role == self.name:  # back to the role it has: withdraw the switch
            withdrawn, self.pending = self.pending, None
            why = f"the switch to {withdrawn.role} was withdrawn: asked to stay {self.name}"
            self.loop.outbox.put(Answer(withdrawn.token, {"code": "ABORTED", "error": why, "epoch": self.epoch}))
            log_event(log, "role_switch_withdrawn", role=self.name, withdrawn=withdrawn.role, epoch=self.epoch)
            answer = {"code": "", "error": "", "withdrew": withdrawn.role}
        elif self.pending is not None:
            answer = {"code": "ABORTED", "error": f"a switch to {self.pending.role} is in progress"}
        elif msg.role == self.name:
            answer = {"code": "", "error": ""}  # nothing to do
        if answer is not None:
            self.loop.outbox.put(Answer(msg.token, answer | {"epoch": self.epoch}))
            return
        self.asked = time.perf_counter()
        self.pending, self.deadline = msg, self.asked + msg.wait_s
        if msg.migrate:
            for req in list(self.loop.requests.values()):
                self.current.fail(req, self._why(msg.role) + ": resume it elsewhere", "UNAVAILABLE", reason="abort")
        if self._idle():
            self._switch()

    def _why(self, role: str) -> str:
        return f"the node is switching from {self.name} to {role}"

    def _idle(self) -> bool:
        loop, role = self.loop, self.current
        return (
            not (loop.requests or loop.inflight or loop.scheduler.num_unfinished or role.undecided() or role.holders())
            and not role.resting()
        )

    def _switch(self) -> None:
        msg, self.pending = self.pending, None
        old = self.name
        self.epoch += 1
        self.loop.decide(SWITCH, "", info=Switched(msg.role, self.epoch))  # (rank 0's agent swaps here)
        self.current = self.make[msg.role]()
        self._bind()
        log_event(log, "role_switch", old=old, role=msg.role, epoch=self.epoch, seq=self.loop.log.count - 1)
        waited = round(time.perf_counter() - self.asked, 6)
        self.loop.outbox.put(Answer(msg.token, {"code": "", "error": "", "epoch": self.epoch, "waited_s": waited}))
