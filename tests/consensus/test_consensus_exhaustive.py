"""Every interleaving, for pp 2 and 3 with up to 3 requests (consensus.explore, model-check style).

The explorer checks the properties in every reached world and raises at the first
violation: agreement, exactly-once, no orphan, invariants (every world); each rank's
report and merge (every hop); validity and the liveness bound (every conclusion);
quiescence (every world where nothing but an abort could happen: no deadlock).

Free spaces let every environment choose READY or FAILED at any time (one failure in
all, late failures included) and rank 0 abort any rid at any time (once). With three
requests at pp 3 that space is too big for the time budget, so there the environments
follow scripts (one request fails on a given rank, another is aborted at any moment,
or one fails late), and every order of every event is still explored.
"""

from __future__ import annotations

import pytest

from kvbridge.consensus import roles
from kvbridge.consensus.explore import Space, explore
from kvbridge.consensus.types import LocalStatus, Stream

R, F = LocalStatus.READY, LocalStatus.FAILED
RIDS = (("a", Stream.DECODE_PREALLOCATED), ("b", Stream.DECODE_TRANSFERRED), ("c", Stream.DECODE_PREALLOCATED))


def scripted(pp: int, fail_rank: int, *, late: bool = False, abort_c: bool = True) -> Space:
    """a: READY everywhere; b: FAILED on fail_rank (after READY there if late); c: READY, and abortable."""
    b = (R, F) if late else (F,)
    rows = tuple(((R,), b if rank == fail_rank else (R,), (R,)) for rank in range(pp))
    return Space(pp, RIDS, max_aborts=int(abort_c), scripts=rows, abortable=frozenset({"c"}))


def test_one_request_reaches_exactly_four_outcomes():
    for pp in (2, 3):
        stats = explore(Space(pp, RIDS[:1]))
        assert stats.final_logs == {("a:READY",), ("a:FAILED",), ("a:ABORTED",), ("a:READY", "a:ABORTED")}
        assert stats.rounds_concluded > 0


@pytest.mark.parametrize(("pp", "n"), [(2, 2), (2, 3), (3, 2)])
def test_every_interleaving_with_free_choices(pp, n):
    stats = explore(Space(pp, RIDS[:n]))
    rids = {rid for rid, _ in RIDS[:n]}
    for log in stats.final_logs:
        verdicts = [entry.split(":")[1] for entry in log]
        assert {entry.split(":")[0] for entry in log} == rids  # every request decided
        assert verdicts.count("FAILED") <= 1 and verdicts.count("ABORTED") <= 1  # within the budgets
    # Every fate combination is reached. A request ends READY, FAILED, ABORTED or READY+ABORTED;
    # at most one FAILED and one aborted (a dead request cannot be aborted): 1 + n + 2n + 2n(n - 1).
    fates = {tuple(sorted(_fates(log).items())) for log in stats.final_logs}
    assert len(fates) == 1 + n + 2 * n * n
    assert len(stats.final_logs) == {2: 26, 3: 186}[n]  # and every order of them that rounds allow


def _fates(log: tuple[str, ...]) -> dict[str, str]:
    fate: dict[str, str] = {}
    for entry in log:
        rid, verdict = entry.split(":")
        fate[rid] = f"{fate[rid]}+{verdict}" if rid in fate else verdict
    return fate


@pytest.mark.parametrize("fail_rank", [0, 2])  # the middle rank fails in the free pp 3 spaces
def test_every_interleaving_of_three_requests_at_pp3(fail_rank):
    stats = explore(scripted(3, fail_rank))
    assert {tuple(sorted(_fates(log).items())) for log in stats.final_logs} == {
        (("a", "READY"), ("b", "FAILED"), ("c", "READY")),
        (("a", "READY"), ("b", "FAILED"), ("c", "ABORTED")),
        (("a", "READY"), ("b", "FAILED"), ("c", "READY+ABORTED")),
    }


def test_every_interleaving_of_a_late_failure_at_pp3():
    stats = explore(scripted(3, 2, late=True, abort_c=False))
    assert {tuple(sorted(_fates(log).items())) for log in stats.final_logs} == {
        (("a", "READY"), ("b", "READY"), ("c", "READY")),
        (("a", "READY"), ("b", "FAILED"), ("c", "READY")),
    }


def test_the_explorer_catches_a_leader_that_ignores_failures(monkeypatch):
    monkeypatch.setattr(roles, "_first_stream_of", lambda tallies, field: {})
    with pytest.raises(AssertionError, match="reports call for"):
        explore(Space(2, RIDS[:1], max_aborts=0))


def test_the_explorer_catches_a_deadlock(monkeypatch):
    """A leader that stops starting rounds while rids are pending leaves a non-quiescent world."""
    monkeypatch.setattr(roles.Leader, "wants_round", property(lambda self: bool(self._unshipped)))
    with pytest.raises(AssertionError, match="quiescent, yet ranks hold"):
        explore(Space(2, RIDS[:1], max_aborts=0, max_failures=0))
