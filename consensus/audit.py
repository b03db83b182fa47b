"""Checks of the consensus properties on recorded runs; each raises AssertionError with the counts.

Inputs are what a run records: every rank's applied decision log, every round's reports
(what each rank contributed) and the decisions it produced, the final states. Used by the
simulator's tests, the exhaustive explorer, and tests on real processes.

- agreement: every log is a prefix of rank 0's; at quiescence all are equal
- exactly-once: every log is seqs 0, 1, 2, ...; no decision for a rid after its terminal one
- validity: a round's decisions are exactly FAILED for every rid some rank reported failed,
  then READY for every (stream, rid) every rank reported ready, less rids already dead
- no orphan: no rank holds a rid whose FAILED/ABORTED decision it applied
- liveness: a (stream, rid) settled before round n started is decided by round n's end
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvbridge.consensus.state import RankState
from kvbridge.consensus.types import STREAMS, Report, Ruling, Stream, Verdict


@dataclass(frozen=True)
class RoundRecord:
    """One concluded round as a run saw it."""

    round_id: int  # rank 0's round number
    reports: tuple[Report, ...]  # by rank: what each contributed
    first_seq: int  # seq of the first decision the round produced (rank 0's applied count before it)
    decisions: tuple[Ruling, ...]  # the decisions the round produced, in order

    @property
    def end_seq(self) -> int:
        return self.first_seq + len(self.decisions)


def check_exactly_once(logs: Sequence[Sequence[Ruling]]) -> None:
    for rank, log in enumerate(logs):
        misplaced = [i for i, d in enumerate(log) if d.seq != i]
        if misplaced:
            raise AssertionError(
                f"rank {rank}: {len(misplaced)} of {len(log)} decisions out of seq, first at {misplaced[0]}"
            )
    ended: dict[str, int] = {}
    for d in logs[0] if logs else ():
        if d.rid in ended:
            raise AssertionError(
                f"seq {d.seq}: {d.verdict.name} for {d.rid!r} after its terminal decision {ended[d.rid]}"
            )
        if d.is_terminal:
            ended[d.rid] = d.seq


def check_agreement(logs: Sequence[Sequence[Ruling]], *, quiescent: bool) -> None:
    leader = tuple(logs[0])
    for rank, log in enumerate(logs[1:], start=1):
        log = tuple(log)
        if log != leader[: len(log)]:
            first = next(i for i, (a, b) in enumerate(zip(log, leader)) if a != b) if len(log) <= len(leader) else None
            raise AssertionError(
                f"rank {rank}: log of {len(log)} is not a prefix of rank 0's {len(leader)} (first difference {first})"
            )
        if quiescent and len(log) != len(leader):
            raise AssertionError(f"quiescent, yet rank {rank} applied {len(log)} of rank 0's {len(leader)} decisions")


def expected_decisions(record: RoundRecord, dead_before: set[str]) -> list[tuple[Stream, str, Verdict]]:
    """What a round must decide, from its reports alone: (stream, rid, verdict) in order."""
    failed: dict[str, Stream] = {}
    for s in STREAMS:
        for rid in sorted(frozenset().union(*(r.failed[s] for r in record.reports))):
            if rid not in dead_before:
                failed.setdefault(rid, s)
    out = [(s, rid, Verdict.FAILED) for rid, s in failed.items()]
    for s in STREAMS:
        everyone = frozenset.intersection(*(r.ready[s] for r in record.reports))
        out += [(s, rid, Verdict.READY) for rid in sorted(everyone - failed.keys() - dead_before)]
    return out


def check_validity(rounds: Sequence[RoundRecord], leader_log: Sequence[Ruling], pp_size: int) -> None:
    """Every round decided exactly what its reports call for (validity, and completeness in that round)."""
    for rec in rounds:
        if sorted(r.rank for r in rec.reports) != list(range(pp_size)):
            raise AssertionError(f"round {rec.round_id}: reports from ranks {sorted(r.rank for r in rec.reports)}")
        if tuple(leader_log[rec.first_seq : rec.end_seq]) != rec.decisions:
            raise AssertionError(f"round {rec.round_id}: its {len(rec.decisions)} decisions are not in rank 0's log")
        dead = {d.rid for d in leader_log[: rec.first_seq] if d.is_terminal}
        want = expected_decisions(rec, dead)
        got = [(d.stream, d.rid, d.verdict) for d in rec.decisions]
        if got != want:
            raise AssertionError(
                f"round {rec.round_id}: decided {len(got)} (stream, rid, verdict), reports call for {len(want)}: "
                f"extra {sorted(set(got) - set(want))[:3]}, missing {sorted(set(want) - set(got))[:3]}"
            )


def check_no_orphan(states: Sequence[RankState]) -> None:
    for st in states:
        st.check_invariants()
        for d in st.log:
            held = [s.name for s in STREAMS if d.is_terminal and st.status(s, d.rid) is not None]
            if held:
                raise AssertionError(f"rank {st.rank}: {d.rid!r} {d.verdict.name} at seq {d.seq}, still held in {held}")


def check_quiescent(states: Sequence[RankState]) -> None:
    """Nothing left anywhere: every view empty, every log and digest equal."""
    live = {st.rank: st.num_live for st in states if st.num_live}
    if live:
        raise AssertionError(f"quiescent, yet ranks hold live (stream, rid) entries: {live}")
    check_agreement([st.log for st in states], quiescent=True)
    digests = {st.log_digest for st in states}
    if len(digests) != 1:
        raise AssertionError(f"{len(digests)} distinct log digests over {len(states)} ranks")


def check_liveness(
    leader_log: Sequence[Ruling],
    rounds: Sequence[RoundRecord],
    round_started: Mapping[int, float],
    settled: Mapping[tuple[Stream, str], float],
) -> int:
    """Each (stream, rid) settled at time t is decided by the end of the first round started after t.

    Returns how many settled entries had such a round (the others must be decided at quiescence)."""
    decided: dict[tuple[Stream | None, str], int] = {}  # first seq deciding (stream, rid), or (None, rid) for terminal
    for d in leader_log:
        decided.setdefault((None if d.is_terminal else d.stream, d.rid), d.seq)
    starts = sorted((round_started[rec.round_id], rec.round_id, rec.end_seq) for rec in rounds)
    never = 1 << 62
    checked = 0
    for (stream, rid), t in settled.items():
        bound = next(((n, end) for start, n, end in starts if start > t), None)
        if bound is None:
            continue
        seq = min(decided.get((stream, rid), never), decided.get((None, rid), never))
        if seq >= bound[1]:
            raise AssertionError(
                f"{stream.name} {rid!r} settled at {t:.3f} but not decided by round {bound[0]} (seq < {bound[1]})"
            )
        checked += 1
    return checked
