"""One rank's consensus state: its local view per stream and the decisions it has applied.

Pure bookkeeping; no I/O, no clock, not thread-safe (a caller that touches it from two
threads holds one lock around every call; see `RingDriver(guard=...)`).

Who calls what:
- the rank's environment (its KV transfer engine, its queues) calls `set_local` when a
  request's status on this rank changes, and reads `status`/`view`;
- the round roles (`consensus.roles`) read `local_sets` and call `apply` with the
  decisions rank 0 issued, in order;
- tests and idle-time self-checks call `check_invariants`, read `log` and `log_digest`.

A FAILED or ABORTED decision leaves the rid dead on this rank: removed from every
stream, and later `set_local` calls for it are ignored (return False), so a late report
from a transfer engine cannot bring it back. A READY decision removes the rid from that
stream only; the environment registers it in the next stream itself.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from kvbridge.consensus.types import STREAMS, LocalStatus, ProtocolError, Report, Ruling, Stream, Verdict

_DIGEST_RECORD = struct.Struct("!QBBH")  # seq, stream (255: none), verdict, rid length


class RankState:
    """Local view and applied decision log of rank `rank` of a `pp_size`-rank pipeline."""

    def __init__(self, rank: int, pp_size: int, *, keep_log: bool = True):
        if pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {pp_size}")
        if not 0 <= rank < pp_size:
            raise ValueError(f"rank must be in [0, {pp_size}), got {rank}")
        self.rank = rank  # this rank, in [0, pp_size)
        self.pp_size = pp_size  # ranks in the ring
        self.keep_log = keep_log  # keep every applied Ruling (tests); the digest is kept either way
        self._views: tuple[dict[str, LocalStatus], ...] = tuple({} for _ in STREAMS)  # by Stream: rid -> status
        self._dead: set[str] = set()  # rids FAILED or ABORTED by an applied decision; never live again
        self._log: list[Ruling] = []  # applied decisions, seq 0, 1, ... (empty unless keep_log)
        self._applied = 0  # number of decisions applied == the next seq this rank expects
        self._digest = hashlib.blake2b(digest_size=16)  # over every applied decision, in order

    # -- the environment ------------------------------------------------------------------

    def set_local(self, stream: Stream, rid: str, status: LocalStatus) -> bool:
        """Record this rank's status of `rid` in `stream` (registering it if new).

        Returns False, changing nothing, when `rid` is dead here. FAILED is sticky:
        moving a FAILED rid to another status raises ValueError."""
        stream, status = Stream(stream), LocalStatus(status)
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid must be a non-empty str, got {rid!r}")
        if rid in self._dead:
            return False
        view = self._views[stream]
        if view.get(rid) == LocalStatus.FAILED and status != LocalStatus.FAILED:
            raise ValueError(f"{rid!r} in {stream.name} is FAILED on rank {self.rank}; cannot become {status.name}")
        view[rid] = status
        return True

    def status(self, stream: Stream, rid: str) -> LocalStatus | None:
        """This rank's status of `rid` in `stream`, or None when it is not there."""
        return self._views[stream].get(rid)

    def view(self, stream: Stream) -> Mapping[str, LocalStatus]:
        """A read-only live view of one stream: rid -> status."""
        return MappingProxyType(self._views[stream])

    def is_dead(self, rid: str) -> bool:
        return rid in self._dead

    @property
    def num_live(self) -> int:
        """(stream, rid) entries in this rank's views."""
        return sum(map(len, self._views))

    def live_rids(self) -> frozenset[str]:
        return frozenset().union(*self._views)

    # -- rounds -----------------------------------------------------------------------------

    def local_sets(self, stream: Stream) -> tuple[frozenset[str], frozenset[str]]:
        """(rids READY here, rids FAILED here) in `stream`."""
        view = self._views[stream]
        ready = frozenset(rid for rid, s in view.items() if s == LocalStatus.READY)
        failed = frozenset(rid for rid, s in view.items() if s == LocalStatus.FAILED)
        return ready, failed

    def report(self, round_id: int) -> Report:
        """This rank's contribution to round `round_id`: its READY and FAILED sets per stream."""
        sets = [self.local_sets(s) for s in STREAMS]
        return Report(round_id, self.rank, tuple(r for r, _ in sets), tuple(f for _, f in sets))

    def apply(self, decisions: Iterable[Ruling]) -> None:
        """Apply decisions in seq order; they must continue this rank's log with no gap or repeat."""
        decisions = tuple(decisions)
        for i, d in enumerate(decisions):
            if d.seq != self._applied + i:
                kind = "repeat" if d.seq < self._applied + i else "gap"
                raise ProtocolError(f"rank {self.rank}: decision seq {d.seq} is a {kind}; expected {self._applied + i}")
        for d in decisions:
            self._apply_one(d)

    def _apply_one(self, d: Ruling) -> None:
        if d.verdict == Verdict.READY:
            if self._views[d.stream].pop(d.rid, None) is None:
                raise ProtocolError(f"rank {self.rank}: READY {d.rid!r} in {d.stream.name}, which it does not hold")
        else:
            for view in self._views:
                view.pop(d.rid, None)
            self._dead.add(d.rid)
        raw = d.rid.encode("utf-8")
        self._digest.update(_DIGEST_RECORD.pack(d.seq, 255 if d.stream is None else d.stream, d.verdict, len(raw)))
        self._digest.update(raw)
        if self.keep_log:
            self._log.append(d)
        self._applied += 1

    # -- introspection ----------------------------------------------------------------------

    def clone(self) -> RankState:
        """An independent copy (the exhaustive explorer branches on it)."""
        twin = RankState.__new__(RankState)
        twin.rank, twin.pp_size, twin.keep_log = self.rank, self.pp_size, self.keep_log
        twin._views = tuple(dict(v) for v in self._views)
        twin._dead = set(self._dead)
        twin._log = list(self._log)
        twin._applied = self._applied
        twin._digest = self._digest.copy()
        return twin

    @property
    def applied_seq(self) -> int:
        """Decisions applied so far == the seq of the next one this rank will accept."""
        return self._applied

    @property
    def log(self) -> tuple[Ruling, ...]:
        """Every applied decision, in order (empty when keep_log is False)."""
        return tuple(self._log)

    def decision(self, seq: int) -> Ruling:
        """The applied decision `seq` (needs keep_log)."""
        return self._log[seq]

    @property
    def log_digest(self) -> str:
        """A digest of the applied decisions in order; equal on two ranks iff their logs are."""
        return self._digest.copy().hexdigest()

    def check_invariants(self) -> None:
        """Raise AssertionError, with counts, when the bookkeeping is inconsistent."""
        for stream, view in zip(STREAMS, self._views):
            orphans = view.keys() & self._dead
            if orphans:
                raise AssertionError(
                    f"rank {self.rank}: {len(orphans)} dead rid(s) still in {stream.name} "
                    f"(of {len(view)} live, {len(self._dead)} dead), e.g. {min(orphans)!r}"
                )
        if not self.keep_log:
            return
        if len(self._log) != self._applied:
            raise AssertionError(f"rank {self.rank}: log holds {len(self._log)} decisions, applied {self._applied}")
        bad = [i for i, d in enumerate(self._log) if d.seq != i]
        if bad:
            raise AssertionError(f"rank {self.rank}: {len(bad)} of {len(self._log)} log entries out of place")
        terminal = {d.rid for d in self._log if d.is_terminal}
        if terminal != self._dead:
            raise AssertionError(
                f"rank {self.rank}: {len(terminal)} rids with a terminal decision, {len(self._dead)} dead"
            )
