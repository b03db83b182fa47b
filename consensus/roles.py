"""The two roles of a round, chosen once per rank: `Leader` (rank 0) and `Follower` (ranks 1..P-1).

A round, for all five streams at once:

    rank 0      propose(): its READY set as `ready`, its FAILED set as `failed`, plus the
                decisions it issued since the last round (hops = 1)
    rank k      relay(): apply those decisions, then ready &= READY_k, failed |= FAILED_k
                (hops = k + 1); the last rank drops the decisions and sends to rank 0
    rank 0      conclude(): one FAILED decision per failed rid, then one READY decision per
                ready rid that did not fail, in (stream, rid) order; apply them at once

Rounds are sequential (max_in_flight = 1): rank 0 starts round n + 1 only after round n
came back, so a round never sees a stale result, and the decisions issued by round n ride
round n + 1. (consensus.baseline pipelines rounds to model the seed's schedule.) `abort`
issues an ABORTED decision at any time; it rides the next round.

A READY decision stands for the round's snapshot: if rank 0's own status turns FAILED
after it proposed, the round still decides READY (every rank was ready when visited).

Every rank applies decisions before it merges, so a rid decided in round n is gone from
every view before anyone contributes to round n + 1: no rid is decided twice.

Bound: a rid whose status has settled on every rank (READY on all, or FAILED on one)
before round n starts is decided by round n, i.e. within the round in flight plus one.
"""

from __future__ import annotations

from collections import deque

from kvbridge.consensus.codec import RoundMsg, Tally
from kvbridge.consensus.state import RankState
from kvbridge.consensus.types import STREAMS, ProtocolError, Report, Ruling, Stream, Verdict


class Leader:
    """Rank 0: starts rounds, turns results into decisions, aborts."""

    def __init__(self, state: RankState, *, max_in_flight: int = 1):
        if state.rank != 0:
            raise ValueError(f"the leader is rank 0, got rank {state.rank}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.state = state  # rank 0's own view and log
        self.max_in_flight = max_in_flight  # rounds on the ring at once: 1 here; the baseline pipelines them
        self._next_round = 0  # id of the next round to start
        self._in_flight: deque[RoundMsg] = deque()  # proposals of the rounds on the ring, oldest first
        self._unshipped: list[Ruling] = []  # issued and applied here, not yet sent down the ring
        self._shipped_upto = 0  # decisions with seq below this have been sent down the ring

    @property
    def round_in_flight(self) -> int | None:
        """The oldest round on the ring, the one `conclude` expects next."""
        return self._in_flight[0].round_id if self._in_flight else None

    @property
    def num_unshipped(self) -> int:
        return len(self._unshipped)

    @property
    def wants_round(self) -> bool:
        """Room on the ring, and something to agree on or to ship."""
        room = len(self._in_flight) < self.max_in_flight
        return room and (self.state.num_live > 0 or bool(self._unshipped))

    def abort(self, rid: str) -> Ruling | None:
        """Abort `rid` on every rank; None when it is already failed or aborted."""
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid must be a non-empty str, got {rid!r}")
        if self.state.is_dead(rid):
            return None
        return self._issue(None, rid, Verdict.ABORTED)

    def propose(self) -> tuple[RoundMsg, Report] | None:
        """Start the next round: the message for rank 1 and rank 0's report; None when idle."""
        if not self.wants_round:
            return None
        report = self.state.report(self._next_round)
        tallies = tuple(Tally(r, f) for r, f in zip(report.ready, report.failed))
        msg = RoundMsg(self._next_round, 1, self._shipped_upto, tuple(self._unshipped), tallies)
        self._in_flight.append(msg)
        self._next_round += 1
        self._shipped_upto, self._unshipped = msg.next_seq, []
        return msg, report

    def conclude(self, result: RoundMsg) -> tuple[Ruling, ...]:
        """Turn the returning round into decisions, applied here at once; ships with the next round."""
        self._check_result(result)
        self._in_flight.popleft()
        failed = _first_stream_of(result.tallies, "failed")
        ready = [(s, rid) for s, rid in _pairs(result.tallies, "ready") if rid not in failed]
        issued = [self._issue(s, rid, Verdict.FAILED) for rid, s in failed.items() if not self.state.is_dead(rid)]
        # Held: true of every ready rid unless aborted meanwhile (or, with rounds pipelined, decided by an older one).
        issued += [self._issue(s, rid, Verdict.READY) for s, rid in ready if self.state.status(s, rid) is not None]
        return tuple(issued)

    def _check_result(self, result: RoundMsg) -> None:
        sent = self._in_flight[0] if self._in_flight else None
        if sent is None or result.round_id != sent.round_id:
            on_ring = self.round_in_flight
            raise ProtocolError(f"result of round {result.round_id}, but the round on the ring is {on_ring}")
        if result.hops != self.state.pp_size:
            raise ProtocolError(f"round {result.round_id} came back after {result.hops} hops, not {self.state.pp_size}")
        if result.decisions or result.first_seq != sent.next_seq:
            raise ProtocolError(
                f"round {result.round_id} came back with {len(result.decisions)} decisions at seq "
                f"{result.first_seq}; expected none at {sent.next_seq}"
            )
        for stream, got, put in zip(STREAMS, result.tallies, sent.tallies):
            if not got.ready <= put.ready or not put.failed <= got.failed:
                raise ProtocolError(f"round {result.round_id}: {stream.name} grew its ready or shrank its failed set")

    def _issue(self, stream: Stream | None, rid: str, verdict: Verdict) -> Ruling:
        d = Ruling(self.state.applied_seq, stream, rid, verdict)
        self.state.apply((d,))
        self._unshipped.append(d)
        return d

    def clone(self) -> Leader:
        twin = Leader.__new__(Leader)
        twin.__dict__.update(self.__dict__)
        twin.state, twin._unshipped, twin._in_flight = self.state.clone(), list(self._unshipped), deque(self._in_flight)
        return twin

    def check_invariants(self) -> None:
        self.state.check_invariants()
        if self._shipped_upto + len(self._unshipped) != self.state.applied_seq:
            raise AssertionError(
                f"leader: shipped {self._shipped_upto} + unshipped {len(self._unshipped)} "
                f"!= applied {self.state.applied_seq}"
            )
        seqs = [d.seq for d in self._unshipped]
        if seqs != list(range(self._shipped_upto, self.state.applied_seq)):
            raise AssertionError(f"leader: {len(seqs)} unshipped decisions are not the log's tail")


class Follower:
    """Ranks 1..P-1: apply the shipped decisions, merge the local view, forward."""

    def __init__(self, state: RankState):
        if state.rank == 0:
            raise ValueError("rank 0 is the leader, not a follower")
        self.state = state  # this rank's own view and log
        self._next_round = 0  # the round id this rank expects next (rounds are numbered without gaps)

    @property
    def is_last(self) -> bool:
        return self.state.rank == self.state.pp_size - 1

    def relay(self, msg: RoundMsg) -> tuple[RoundMsg, Report]:
        """Apply `msg`'s decisions, merge this rank's sets: the message for the next rank, and the report."""
        rank = self.state.rank
        if msg.round_id != self._next_round or msg.hops != rank:
            raise ProtocolError(
                f"rank {rank}: got round {msg.round_id} after {msg.hops} hops, expected round "
                f"{self._next_round} after {rank}"
            )
        if msg.first_seq != self.state.applied_seq:
            applied = self.state.applied_seq
            raise ProtocolError(f"rank {rank}: decisions start at seq {msg.first_seq}, applied {applied}")
        self.state.apply(msg.decisions)
        self._next_round += 1
        report = self.state.report(msg.round_id)
        tallies = tuple(
            Tally(t.ready & mine_ready, t.failed | mine_failed)
            for t, mine_ready, mine_failed in zip(msg.tallies, report.ready, report.failed)
        )
        out = RoundMsg(msg.round_id, rank + 1, msg.first_seq, msg.decisions, tallies)
        return (out.without_decisions() if self.is_last else out), report

    def clone(self) -> Follower:
        twin = Follower.__new__(Follower)
        twin.state, twin._next_round = self.state.clone(), self._next_round
        return twin

    def check_invariants(self) -> None:
        self.state.check_invariants()


Role = Leader | Follower


def make_role(state: RankState) -> Role:
    """The role of `state.rank`, chosen once at start-up."""
    return Leader(state) if state.rank == 0 else Follower(state)


def _pairs(tallies: tuple[Tally, ...], field: str) -> list[tuple[Stream, str]]:
    """(stream, rid) of one field of every tally, in stream then rid order."""
    return [(s, rid) for s, t in zip(STREAMS, tallies) for rid in sorted(getattr(t, field))]


def _first_stream_of(tallies: tuple[Tally, ...], field: str) -> dict[str, Stream]:
    """rid -> the first stream whose `field` holds it (a rid failed in two streams fails once)."""
    first: dict[str, Stream] = {}
    for s, rid in _pairs(tallies, field):
        first.setdefault(rid, s)
    return first
