"""The consensus control channel of a pipeline node, on real processes.

`GlooTransport` is consensus.Transport over torch.distributed on a gloo group of its own
(so rounds never queue behind hidden states). `ControlChannel` runs a rank's
consensus.RingDriver in a daemon thread, rounds back to back while there is something to
agree on; the rank's loop calls `set_local` / `abort` and takes the decisions with
`take_decisions()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from consensus import Decision, LocalStatus, RankState, RingDriver, Stream, make_role
from engine.pp.dist import Sends
from kvbridge.metrics import rank_metrics


class GlooTransport:
    """One rank's ends of the control ring: length-prefixed byte payloads, async sends."""

    def __init__(self, group, rank: int, pp_size: int, poll_s: float = 2e-4):
        self.group = group
        self.next, self.prev = (rank + 1) % pp_size, (rank - 1) % pp_size
        self.poll_s = poll_s  # sleep between completion checks when recv has a timeout
        self._sends = Sends(group)
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


CLOSE = b""  # sent around the ring once, at shutdown: every control thread forwards it and exits


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
    """A rank's consensus driver in a background thread. `stop()` closes the ring (rank 0 sends the
    sentinel round it; the others forward it) so that no thread is left inside a receive at exit."""

    def __init__(
        self,
        rank: int,
        pp_size: int,
        transport: GlooTransport | None,
        idle_poll_s: float = 0.002,
        on_decisions: Callable[[], None] | None = None,
        collect: bool = True,
        keep_log: bool = False,
    ):
        self.state = RankState(rank, pp_size, keep_log=keep_log)  # the digest is kept either way
        self.on_decisions = on_decisions  # called (no arguments, from the thread) after decisions arrive
        self.collect = collect  # keep decisions for take_decisions(); ranks that only follow need not
        self.lock = threading.Lock()
        self.transport = transport
        self.driver = RingDriver(make_role(self.state), transport and _ClosableRing(transport), guard=self.lock)
        self.idle_poll_s = idle_poll_s  # rank 0: pause after a round that decided nothing
        self._wake = threading.Event()
        self._decided: list[Decision] = []  # issued (rank 0) or applied (rank k), not yet taken
        self._stop = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"kvbridge-consensus{rank}", daemon=True)
        self.thread.start()

    def set_local(self, stream: Stream, rid: str, status: LocalStatus) -> None:
        with self.lock:
            self.state.set_local(stream, rid, status)
        self._wake.set()

    def abort(self, rid: str) -> None:
        self.driver.abort(rid)
        self._wake.set()

    def take_decisions(self) -> list[Decision]:
        with self.lock:
            out, self._decided = self._decided, []
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout_s)

    def _run(self) -> None:
        metrics = rank_metrics()
        started: dict[int, float] = {}  # rank 0: round id -> when it was sent round the ring
        try:
            while not (self._stop and self.state.rank == 0):
                result = self.driver.step(timeout=None)
                if self.state.rank == 0:
                    now = time.perf_counter()
                    if result.started is not None:
                        started[result.started] = now
                    if result.finished is not None and result.finished in started:
                        metrics.rounds.inc()
                        metrics.round_duration.observe(now - started.pop(result.finished))
                    for d in result.decisions:
                        stream = d.stream.name.lower() if d.stream is not None else "all"
                        metrics.verdicts.labels(stream, d.verdict.name.lower()).inc()
                if result.decisions:
                    if self.collect:
                        with self.lock:
                            self._decided.extend(result.decisions)
                    if self.on_decisions is not None:
                        self.on_decisions()
                elif self.state.rank == 0 and (result.idle or result.finished is not None):
                    # nothing decided: wait for a local change, or poll the other ranks again soon
                    self._wake.wait(self.idle_poll_s)
                    self._wake.clear()
            if self.transport is not None:  # rank 0, stopping: send the sentinel round the ring
                self.transport.send(CLOSE)
                while self.transport.recv(None) != CLOSE:
                    pass
        except RingClosed:  # ranks 1..P-1: pass the sentinel on, then stop
            self.transport.send(CLOSE)
            self.transport.flush()
        except BaseException as e:  # surfaced to the rank's loop through .error
            self.error = e
