"""KVPoll: the state of one request's KV transfer on one rank, and a board of them.

    Bootstrapping -> WaitingForInput -> Transferring -> Success
         \\________________\\_______________\\__________> Failed

Forward moves may skip states (a shared-memory receiver never sees bytes arrive, so it
goes from WaitingForInput straight to Success). Moving backwards, or leaving Success or
Failed, raises. The values follow SGLang's (Failed lowest), so that the least advanced
state of several ranks is their minimum.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum


class KVPoll(IntEnum):
    FAILED = 0  # terminal: the transfer failed or was aborted; `reason` says why
    BOOTSTRAPPING = 1  # known, not yet connected (prefill: decode's registration not yet applied)
    WAITING_FOR_INPUT = 2  # connected (prefill) / registered (decode); no pages moved yet
    TRANSFERRING = 3  # pages are moving
    SUCCESS = 4  # terminal: every page landed and every notice arrived

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.SUCCESS, KVPoll.FAILED)


class IllegalTransition(ValueError):
    """A KVPoll move that the state machine forbids (backwards, or out of a terminal state)."""


def can_advance(old: KVPoll, new: KVPoll) -> bool:
    """True when old -> new is a legal move (a self-move is legal only for non-terminal states)."""
    if old.is_terminal:
        return False
    return new == KVPoll.FAILED or new >= old


class PollState:
    """One transfer's KVPoll with its failure reason."""

    def __init__(self, state: KVPoll = KVPoll.BOOTSTRAPPING):
        self.state = state  # current state
        self.reason = ""  # why it failed; "" unless FAILED

    def advance(self, new: KVPoll, reason: str = "") -> bool:
        """Move to `new`; returns whether the state changed. Raises IllegalTransition."""
        if not can_advance(self.state, new):
            raise IllegalTransition(f"KVPoll {self.state.name} -> {new.name} is not allowed")
        changed = new != self.state
        self.state = new
        if new == KVPoll.FAILED:
            self.reason = reason or "failed"
        return changed


@dataclass(frozen=True)
class StatusChange:
    """A room's state changed on this rank; what a daemon feeds into consensus."""

    room: int  # the transfer's room (the request's pairing key)
    rid: str  # the request id ("" when the side does not know it)
    state: KVPoll  # the new state
    reason: str  # why it failed; "" unless FAILED


class StatusBoard:
    """Rooms' PollStates, thread-safe. Changes queue up; `flush()` (which owners call once they hold
    no lock of their own) hands them to `on_change` in order, or, without a callback, they wait for
    `pop_changes()`."""

    def __init__(self, on_change: Callable[[StatusChange], None] | None = None):
        self._lock = threading.Lock()
        self._deliver_lock = threading.Lock()  # serializes callbacks so they keep the board's order
        self._on_change = on_change
        self._states: dict[int, PollState] = {}  # room -> its state
        self._rids: dict[int, str] = {}  # room -> request id
        self._pending: deque[StatusChange] = deque()  # changes not yet delivered or popped

    def add(self, room: int, rid: str = "", state: KVPoll = KVPoll.BOOTSTRAPPING) -> None:
        with self._lock:
            if room in self._states:
                raise ValueError(f"room {room} is already known (rid {self._rids[room]!r})")
            self._states[room] = PollState(state)
            self._rids[room] = rid

    def advance(self, room: int, new: KVPoll) -> bool:
        """Move a room forward; raises KeyError (unknown room) or IllegalTransition."""
        with self._lock:
            changed = self._states[room].advance(new)
            if changed:
                self._pending.append(StatusChange(room, self._rids[room], new, ""))
        return changed

    def fail(self, room: int, reason: str) -> bool:
        """Fail a room unless it is already terminal (then: no change, False). KeyError if unknown."""
        with self._lock:
            st = self._states[room]
            if st.state.is_terminal:
                return False
            st.advance(KVPoll.FAILED, reason)
            self._pending.append(StatusChange(room, self._rids[room], KVPoll.FAILED, st.reason))
        return True

    def poll(self, room: int) -> KVPoll:
        with self._lock:
            return self._states[room].state

    def reason(self, room: int) -> str:
        with self._lock:
            return self._states[room].reason

    def __contains__(self, room: int) -> bool:
        with self._lock:
            return room in self._states

    def rooms(self) -> list[int]:
        with self._lock:
            return list(self._states)

    def remove(self, room: int) -> None:
        with self._lock:
            self._states.pop(room, None)
            self._rids.pop(room, None)

    def pop_changes(self) -> list[StatusChange]:
        """Changes since the last call (only when there is no on_change callback)."""
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
        return out

    def flush(self) -> None:
        """Deliver queued changes to on_change (no-op without one). Call holding none of your locks."""
        if self._on_change is None:
            return
        with self._deliver_lock:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    change = self._pending.popleft()
                self._on_change(change)
