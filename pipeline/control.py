"""The consensus control channel of a pipeline node, on real processes.

`GlooTransport` is consensus.Transport over torch.distributed on a gloo group of its own
(so rounds never queue behind hidden states). `ControlChannel` runs a rank's
consensus.RingDriver in a daemon thread, rounds back to back while there is something to
agree on; the rank's loop calls `set_local` / `abort` and takes the decisions with
`take_decisions()`.

Wake-ups are event-driven. After a round that decided nothing, rank 0 waits for a change:
its own (`set_local`, `abort`), or a nudge, a one-word message on a second gloo group that
any other rank sends when one of its statuses becomes READY or FAILED (one nudge per burst
of changes: a thread per rank sends them, so the caller never blocks). A lost nudge would
cost latency only: rank 0 runs a round at least every `idle_poll_s` while anything is live.

A channel whose thread fails (a broken gloo pair, a malformed round) can decide nothing any
more: rank 0's loop learns it from `take_decisions`, which raises; ranks 1..P-1, whose loops
never ask, end their process (`end_rank`). Either way a rank dies, and the node's watcher fails
its streams and makes the node exit non-zero.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvbridge.consensus import LocalStatus, RankState, RingDriver, Ruling, Stream, make_role
from kvbridge.engine import faults
from kvbridge.pipeline.dist import Sends
from kvbridge.pipeline.metrics import RankRecorder

log = logging.getLogger("kvbridge.consensus")


def end_rank(error: BaseException) -> None:
    """on_failure of ranks 1..P-1: this rank's process ends (exit status 70, EX_SOFTWARE)."""
    log.critical("the consensus channel failed: %r; this rank exits", error)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(70)


class GlooTransport:
    """One rank's ends of the control ring: length-prefixed byte payloads, async sends."""

    def __init__(self, groups, rank: int, pp_size: int, poll_s: float = 2e-4):
        self.group, self.nudge_group = groups.ring, groups.nudge  # pipeline.dist.ControlGroups
        self.next, self.prev = (rank + 1) % pp_size, (rank - 1) % pp_size
        self.poll_s = poll_s  # sleep between completion checks when recv has a timeout
        self._sends = Sends(self.group)
        self._len = torch.empty(1, dtype=torch.int64)
        self._pending: dist.Work | None = None  # a posted receive of the next length

    def send(self, payload: bytes) -> None:
        self._sends.send(torch.tensor([len(payload)], dtype=torch.int64), self.next)
        if payload:  # an empty payload (the ring's close sentinel) is its length alone
            self._sends.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), self.next)

    def flush(self) -> None:
        self._sends.flush()

    def recv(self, timeout: float | None) -> bytes | None:
        if self._pending is None:
            self._pending = dist.irecv(self._len, self.prev, group=self.group)
        if timeout is None:
            self._pending.wait()
        else:
            deadline = time.monotonic() + timeout
            while not self._pending.is_completed():
                if time.monotonic() >= deadline:
                    return None  # the receive stays posted for the next call
                time.sleep(self.poll_s)
        self._pending = None
        if self._len.item() == 0:
            return b""
        buf = torch.empty(int(self._len.item()), dtype=torch.uint8)
        dist.recv(buf, self.prev, group=self.group)  # the payload follows its length at once
        return buf.numpy().tobytes()

    def send_nudge(self, word: int) -> None:
        """Ranks 1..P-1, from one thread: a word to rank 0 (NUDGE, or NUDGE_CLOSE once at the end)."""
        dist.send(torch.tensor([word], dtype=torch.int64), 0, group=self.nudge_group)

    def recv_nudge(self) -> int:
        """Rank 0, from one thread: the next word any other rank sent."""
        word = torch.empty(1, dtype=torch.int64)
        dist.recv(word, None, group=self.nudge_group)
        return int(word.item())


CLOSE = b""  # sent around the ring once, at shutdown: every control thread forwards it and exits
NUDGE, NUDGE_CLOSE = 1, 0  # words to rank 0: "a status of mine changed"; "no more nudges from me"


class RingClosed(Exception):
    pass


class _ClosableRing:
    """A transport on which the CLOSE sentinel ends the ring instead of reaching the driver."""

    def __init__(self, inner: GlooTransport):
        self.inner = inner

    def send(self, payload: bytes) -> None:
        self.inner.send(payload)

    def recv(self, timeout: float | None) -> bytes | None:
        payload = self.inner.recv(timeout)
        if payload == CLOSE:
            raise RingClosed
        return payload


class ControlChannel:
    """A rank's consensus driver in a background thread (a ring of one: inline, in take_decisions).
    `stop()` closes the ring (rank 0 sends the sentinel round it; the others forward it) so that no
    thread is left inside a receive at exit."""

    def __init__(
        self,
        rank: int,
        pp_size: int,
        transport: GlooTransport | None,
        idle_poll_s: float = 0.1,
        on_decisions: Callable[[], None] | None = None,
        collect: bool = True,
        keep_log: bool = False,
        on_failure: Callable[[BaseException], None] | None = None,
        recorder: RankRecorder | None = None,
    ):
        self.state = RankState(rank, pp_size, keep_log=keep_log)  # the digest is kept either way
        self.on_decisions = on_decisions  # rank 0: wakes its loop (no arguments, any thread) when decisions wait
        self.collect = collect  # keep decisions for take_decisions(); ranks that only follow need not
        self.on_failure = on_failure  # called (on the channel's thread) with the error that ended it
        self.lock = threading.Lock()
        self.transport = transport
        self.driver = RingDriver(make_role(self.state), transport and _ClosableRing(transport), guard=self.lock)
        # a ring of one needs no thread: its rounds run inside take_decisions, on the loop's thread
        self.inline = transport is None
        self._owner = threading.get_ident()  # the loop's thread (it made the channel)
        self._changed = False  # inline: a status changed or a rid was aborted since the last round
        self.idle_poll_s = idle_poll_s  # rank 0: the longest pause after a round that decided nothing
        self._wake = threading.Event()  # rank 0: a change (local, or another rank's nudge) since the last round
        self._nudge = threading.Event()  # ranks 1..P-1: a status became READY or FAILED; tell rank 0
        self._decided: list[Ruling] = []  # issued (rank 0) or applied (rank k), not yet taken
        self._stop = False
        self._closing = False  # ranks 1..P-1: the ring closed; the nudger sends NUDGE_CLOSE and ends
        self.recorder = recorder or RankRecorder()
        self._started: dict[int, float] = {}  # rank 0: round id -> when it was sent round the ring
        self.error: BaseException | None = None
        self._local_changes = 0  # set_local and abort calls so far (fault injection counts them)
        self._fail_after = faults.current().consensus_fail_after  # 0 = never (engine/faults.py)
        self._broken = False  # fault injection: the channel took its last change; its thread fails next round
        self.thread: threading.Thread | None = None  # the rounds (none inline)
        self.nudges: threading.Thread | None = None  # rank 0: takes nudges; ranks 1..P-1: sends them
        if not self.inline:
            work = self._take_nudges if rank == 0 else self._send_nudges
            self.nudges = threading.Thread(target=work, name=f"kvbridge-nudges{rank}", daemon=True)
            self.nudges.start()
            self.thread = threading.Thread(target=self._run, name=f"kvbridge-consensus{rank}", daemon=True)
            self.thread.start()

    @property
    def has_changes(self) -> bool:
        """Inline: a round may decide something (the loop calls take_decisions before it sleeps)."""
        return self._changed

    def set_local(self, stream: Stream, rid: str, status: LocalStatus) -> None:
        if self._injected_break():
            return
        with self.lock:
            self.state.set_local(stream, rid, status)
        self._changed_here(status != LocalStatus.PENDING)

    def abort(self, rid: str) -> None:
        if self._injected_break():
            return
        self.driver.abort(rid)
        self._changed_here(True)

    def _injected_break(self) -> bool:
        """Fault injection (consensus_fail_after=N): the N-th local change and every later one never
        reach the ring; the channel's thread fails at its next round instead. So the failure always
        comes before a round could carry that change, however fast the host is (a request that needs
        it cannot complete first)."""
        if self.inline or not self._fail_after or self._local_changes + 1 < self._fail_after:
            return False
        if not self._broken:
            self._broken = True
            self._local_changes += 1
            self._wake.set()  # rank 0: take a round now; ranks 1..P-1 fail at the next round rank 0 sends
        return True

    def _changed_here(self, decisive: bool) -> None:
        self._local_changes += 1
        if self.inline:
            self._changed = True
            if decisive and self.on_decisions is not None and threading.get_ident() != self._owner:
                self.on_decisions()  # (a change made on the loop's thread is seen before it sleeps)
        elif self.state.rank == 0:
            self._wake.set()
        elif decisive:  # (a registration alone decides nothing)
            self._nudge.set()

    def take_decisions(self) -> list[Ruling]:
        """The decisions since the last call. RuntimeError once the channel's thread failed: the
        ring can decide nothing any more, so the rank must not go on as if it could."""
        if self.error is not None:
            why = f"the consensus channel of rank {self.state.rank} failed: {self.error!r}"
            raise RuntimeError(why) from self.error
        if self.inline and self._changed:
            self._changed = False
            while (result := self.driver.step(timeout=0)).decisions:  # until a round decides nothing
                self._count(result)
                with self.lock:
                    self._decided.extend(result.decisions)
        with self.lock:
            out, self._decided = self._decided, []
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.inline:
            return
        self._stop = True
        self._wake.set()
        self.thread.join(timeout_s)
        if self.state.rank == 0:  # its nudge thread ends once every other rank said NUDGE_CLOSE
            self.nudges.join(timeout_s)

    def _take_nudges(self) -> None:
        """Rank 0: every nudge wakes the control thread; returns after every other rank closed."""
        open_ranks = self.state.pp_size - 1
        while open_ranks:
            if self.transport.recv_nudge() == NUDGE_CLOSE:
                open_ranks -= 1
            self._wake.set()

    def _send_nudges(self) -> None:
        """Ranks 1..P-1: one nudge per burst of changes (the event coalesces them), then NUDGE_CLOSE."""
        while True:
            self._nudge.wait()
            self._nudge.clear()
            if self._closing:
                self.transport.send_nudge(NUDGE_CLOSE)
                return
            self.transport.send_nudge(NUDGE)

    def _count(self, result) -> None:
        """Rank 0: round and verdict metrics."""
        now = time.perf_counter()
        if result.started is not None:
            self._started[result.started] = now
        if result.finished is not None and result.finished in self._started:
            self.recorder.round_done(now - self._started.pop(result.finished))
        for d in result.decisions:
            stream = d.stream.name.lower() if d.stream is not None else "all"
            self.recorder.ruled(stream, d.verdict.name.lower())

    def _run(self) -> None:
        try:
            while not (self._stop and self.state.rank == 0):
                result = self.driver.step(timeout=None)
                if self._broken:
                    raise RuntimeError(f"injected consensus failure after {self._local_changes} status changes")
                if self.state.rank == 0:
                    self._count(result)
                if result.decisions:
                    if self.collect:
                        with self.lock:
                            self._decided.extend(result.decisions)
                    if self.on_decisions is not None:
                        self.on_decisions()
                elif self.state.rank == 0 and (result.idle or result.finished is not None):
                    # nothing decided: wait for a change here or a nudge from another rank
                    self._wake.wait(self.idle_poll_s)
                    self._wake.clear()
            # rank 0, stopping: send the sentinel round the ring
            self.transport.send(CLOSE)
            while self.transport.recv(None) != CLOSE:
                pass
        except RingClosed:  # ranks 1..P-1: pass the sentinel on, then stop (and the nudger)
            self.transport.send(CLOSE)
            self.transport.flush()
            self._closing = True
            self._nudge.set()
            self.nudges.join(10.0)
        except BaseException as e:  # surfaced to the rank's loop through .error, and on_failure
            self.error = e
            if self.on_failure is not None:
                self.on_failure(e)
