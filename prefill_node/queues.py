"""The queues a prefill request waits in after the scheduler (pipeline/roles.py PhaseQueue).

    scheduler (chunked prefill, at once) --(first token sampled, no registration yet)--> bootstrap
    --(the decode node registered: ROUTE)--> inflight --(consensus PREFILL_TRANSFERRED)--> done

A request registered before its first token was sampled goes from the scheduler straight to
inflight. Both queues hold requests whose pages the scheduler keeps (`hold_finished`).

A routed request that ends early leaves its room in the revocations until every rank has dropped
it (consensus, prefill_node/agent.py revocation_key): only then is a decode node's Revoke answered.
"""

from __future__ import annotations

from kvbridge.consensus import Ruling, Verdict
from kvbridge.consensus import Stream as S
from kvbridge.engine.request import Phase, Request
from kvbridge.kv_transfer.handoff import Registration
from kvbridge.pipeline.roles import PhaseQueue


class BootstrapQueue(PhaseQueue):
    """Prefilled (first token out) and waiting for the decode node's registration."""

    phases = frozenset({Phase.BOOTSTRAP})


class InflightQueue(PhaseQueue):
    """Routed and prefilled: its pages wait until every rank's pushes landed."""

    phases = frozenset({Phase.TRANSFERRING})

    def on_verdict(self, req: Request, ruling: Ruling) -> bool:
        """True when `ruling` says every push of `req` landed (it leaves the queue: its pages may go)."""
        done = ruling.verdict == Verdict.READY and ruling.stream == S.PREFILL_TRANSFERRED
        return done and self.remove(req)


class Registrations:
    """Decode nodes' registrations that came before their request's Prefill call, by room, each
    dropped when its request has not come within `ttl_s`. (PrefillRole.ended keeps, the same way,
    the verdicts of requests that ended before their registration came.)"""

    def __init__(self, limit: int, ttl_s: float):
        self.limit, self.ttl_s = limit, ttl_s
        self._by_room: dict[int, tuple[float, Registration]] = {}  # room -> (arrival, registration)

    def __contains__(self, room: int) -> bool:
        return room in self._by_room

    def __len__(self) -> int:
        return len(self._by_room)

    def full(self) -> bool:
        return len(self._by_room) >= self.limit

    def add(self, room: int, registration: Registration, now: float) -> None:
        self._by_room[room] = (now, registration)

    def pop(self, room: int) -> Registration | None:
        entry = self._by_room.pop(room, None)
        return entry and entry[1]

    def expire(self, now: float) -> None:
        for room in [r for r, (t, _) in self._by_room.items() if now - t > self.ttl_s]:
            del self._by_room[room]

    def drop_oldest(self) -> None:
        if self._by_room:
            del self._by_room[next(iter(self._by_room))]


class Revocations:
    """Rooms of routed requests that ended early, from their ABORT until every rank reported the room
    revoked under its consensus key (no write into it under way or to come), with the Revoke calls
    waiting for that."""

    def __init__(self) -> None:
        self._waiting: dict[int, list[int]] = {}  # room -> tokens of the Revoke messages to answer
        self.keys: dict[str, int] = {}  # consensus key -> room

    def __contains__(self, room: int) -> bool:
        return room in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def begin(self, room: int, key: str) -> None:
        self._waiting.setdefault(room, [])
        self.keys[key] = room

    def wait(self, room: int, token: int) -> bool:
        """Answer `token` once `room` is revoked everywhere; False when it is not being revoked."""
        if room not in self._waiting:
            return False
        self._waiting[room].append(token)
        return True

    def done(self, key: str) -> tuple[int, list[int]]:
        """Every rank revoked the room of `key`: (the room, the tokens to answer)."""
        room = self.keys.pop(key)
        return room, self._waiting.pop(room)
