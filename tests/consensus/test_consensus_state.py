"""Round semantics on small in-memory rings: intersection/union, decisions, aborts, errors."""

from __future__ import annotations

import pytest

from kvbridge.consensus import (
    InMemoryRing,
    LocalStatus,
    ProtocolError,
    RankState,
    RingDriver,
    RoundMsg,
    Ruling,
    Stream,
    Tally,
    Verdict,
    make_role,
    run_round,
)
from kvbridge.consensus.roles import Follower, Leader

R, P, F = LocalStatus.READY, LocalStatus.PENDING, LocalStatus.FAILED
PRE, TX, BOOT = Stream.DECODE_PREALLOCATED, Stream.DECODE_TRANSFERRED, Stream.PREFILL_BOOTSTRAPPED


def make_ring(pp: int, **state_kw) -> list[RingDriver]:
    ring = InMemoryRing(pp)
    return [
        RingDriver(make_role(RankState(r, pp, **state_kw)), ring.endpoint(r) if pp > 1 else None) for r in range(pp)
    ]


def set_local(drivers: list[RingDriver], stream: Stream, rid: str, *statuses: LocalStatus) -> None:
    """statuses[r] on rank r; one status means every rank."""
    statuses = statuses * len(drivers) if len(statuses) == 1 else statuses
    for d, s in zip(drivers, statuses, strict=True):
        d.state.set_local(stream, rid, s)


def logs(drivers: list[RingDriver]) -> list[tuple[Ruling, ...]]:
    return [d.state.log for d in drivers]


def test_ready_needs_every_rank_in_one_round():
    ring = make_ring(3)
    set_local(ring, TX, "a", R, R, P)
    assert run_round(ring).decisions == ()
    ring[2].state.set_local(TX, "a", R)
    assert run_round(ring).decisions == (Ruling(0, TX, "a", Verdict.READY),)
    assert ring[0].state.status(TX, "a") is None  # rank 0 applies at once
    assert ring[2].state.status(TX, "a") == R  # the others when the next round ships it
    run_round(ring)
    assert logs(ring) == [(Ruling(0, TX, "a", Verdict.READY),)] * 3
    assert [d.state.num_live for d in ring] == [0, 0, 0]


def test_failed_on_one_rank_fails_on_every_rank_and_every_stream():
    ring = make_ring(3)
    set_local(ring, TX, "a", R, R, F)
    set_local(ring, BOOT, "a", R)
    set_local(ring, TX, "b", R)
    res = run_round(ring)
    assert res.decisions == (Ruling(0, TX, "a", Verdict.FAILED), Ruling(1, TX, "b", Verdict.READY))
    run_round(ring)
    for d in ring:
        assert (d.state.status(TX, "a"), d.state.status(BOOT, "a"), d.state.is_dead("a")) == (None, None, True)
        assert d.state.set_local(BOOT, "a", R) is False  # no resurrection by a late report
    assert logs(ring) == [res.decisions] * 3


def test_failed_wins_over_ready_in_the_same_round():
    ring = make_ring(2)
    set_local(ring, BOOT, "x", R)
    set_local(ring, TX, "x", R, F)
    assert run_round(ring).decisions == (Ruling(0, TX, "x", Verdict.FAILED),)


def test_decisions_are_failed_first_then_ready_in_stream_then_rid_order():
    ring = make_ring(2)
    for stream, rid in [(TX, "b"), (TX, "a"), (PRE, "c"), (BOOT, "d")]:
        set_local(ring, stream, rid, R)
    set_local(ring, TX, "z", R, F)
    set_local(ring, PRE, "y", F, R)
    got = [(d.seq, d.stream, d.rid, d.verdict) for d in run_round(ring).decisions]
    assert got == [
        (0, PRE, "y", Verdict.FAILED),
        (1, TX, "z", Verdict.FAILED),
        (2, BOOT, "d", Verdict.READY),
        (3, PRE, "c", Verdict.READY),
        (4, TX, "a", Verdict.READY),
        (5, TX, "b", Verdict.READY),
    ]


def test_rank_k_failure_of_a_rid_rank0_does_not_know():
    ring = make_ring(3)
    set_local(ring, TX, "known", P)  # keeps rounds going
    ring[1].state.set_local(PRE, "ghost", F)
    assert run_round(ring).decisions == (Ruling(0, PRE, "ghost", Verdict.FAILED),)
    assert ring[0].state.set_local(PRE, "ghost", P) is False
    run_round(ring)
    assert ring[1].state.status(PRE, "ghost") is None
    assert logs(ring) == [(Ruling(0, PRE, "ghost", Verdict.FAILED),)] * 3


def test_ready_leaves_only_its_stream():
    ring = make_ring(2)
    set_local(ring, TX, "a", R)
    set_local(ring, Stream.DECODE_RETRACTED, "a", P)
    run_round(ring)
    run_round(ring)
    assert [(d.state.status(TX, "a"), d.state.status(Stream.DECODE_RETRACTED, "a")) for d in ring] == [(None, P)] * 2


def test_abort_removes_the_rid_from_every_stream_of_every_rank():
    ring = make_ring(3)
    set_local(ring, TX, "a", P)
    set_local(ring, BOOT, "a", R, P, R)
    assert ring[0].abort("a") == Ruling(0, None, "a", Verdict.ABORTED)
    assert ring[0].abort("a") is None  # already dead: no second decision
    run_round(ring)
    for d in ring:
        assert (d.state.num_live, d.state.is_dead("a"), d.state.set_local(TX, "a", R)) == (0, True, False)
    assert logs(ring) == [(Ruling(0, None, "a", Verdict.ABORTED),)] * 3


def test_abort_while_the_round_is_on_the_ring_suppresses_its_ready():
    ring = make_ring(3)
    set_local(ring, TX, "a", R)
    assert ring[0].step(timeout=0).started == 0  # round 0 reads "a" READY on rank 0
    ring[0].abort("a")
    ring[1].step(timeout=0)
    ring[2].step(timeout=0)
    assert ring[0].step(timeout=0).decisions == ()  # the result says READY; the rid is dead by now
    run_round(ring)
    assert logs(ring) == [(Ruling(0, None, "a", Verdict.ABORTED),)] * 3
    assert sum(d.state.num_live for d in ring) == 0


def test_every_rank_applies_the_same_log_and_digest():
    ring = make_ring(4)
    for i in range(6):
        set_local(ring, PRE, f"r{i}", R)
        ring[i % 4].state.set_local(PRE, f"r{i}", F if i % 3 == 0 else R)
        run_round(ring)
    run_round(ring)
    first = ring[0].state.log
    assert len(first) == 6 and [d.seq for d in first] == list(range(6))
    assert logs(ring) == [first] * 4
    assert len({d.state.log_digest for d in ring}) == 1
    assert [d.verdict for d in first] == [Verdict.FAILED, Verdict.READY, Verdict.READY] * 2


def test_digest_without_log_matches_the_full_log():
    full, lean = make_ring(2), make_ring(2, keep_log=False)
    for ring in (full, lean):
        set_local(ring, TX, "a", R)
        set_local(ring, TX, "b", R, F)
        run_round(ring)
        run_round(ring)
    assert lean[1].state.log == () and lean[1].state.applied_seq == 2
    assert lean[1].state.log_digest == full[1].state.log_digest == full[0].state.log_digest


def test_leader_is_idle_with_nothing_to_agree_on():
    ring = make_ring(2)
    assert ring[0].step(timeout=0).idle is True
    ring[0].state.set_local(TX, "a", P)
    res = ring[0].step(timeout=0)
    assert (res.idle, res.started, res.finished) == (False, 0, None)


def test_pp1_concludes_its_own_round_and_then_idles():
    (solo,) = make_ring(1)
    solo.state.set_local(TX, "a", R)
    solo.state.set_local(TX, "b", P)
    res = solo.step()
    assert (res.decisions, res.started, res.finished) == ((Ruling(0, TX, "a", Verdict.READY),), 0, 0)
    assert solo.step().idle is True  # "b" is pending: nothing changes, do not spin
    solo.state.set_local(TX, "b", F)
    assert solo.step().decisions == (Ruling(1, TX, "b", Verdict.FAILED),)


def test_failed_is_sticky_and_bad_input_raises():
    st = RankState(0, 2)
    st.set_local(TX, "a", F)
    with pytest.raises(ValueError, match="FAILED"):
        st.set_local(TX, "a", R)
    with pytest.raises(ValueError):
        st.set_local(TX, "", R)
    with pytest.raises(ValueError):
        st.set_local(9, "a", R)
    with pytest.raises(ValueError):
        RankState(2, 2)
    with pytest.raises(ValueError):
        RingDriver(make_role(RankState(0, 2)), None)


def test_a_gap_or_a_repeat_in_decision_seqs_raises():
    st = RankState(1, 2)
    st.set_local(TX, "a", R)
    with pytest.raises(ProtocolError, match="gap"):
        st.apply([Ruling(1, TX, "a", Verdict.READY)])
    st.apply([Ruling(0, TX, "a", Verdict.READY)])
    with pytest.raises(ProtocolError, match="repeat"):
        st.apply([Ruling(0, TX, "a", Verdict.READY)])
    with pytest.raises(ProtocolError, match="does not hold"):
        st.apply([Ruling(1, TX, "a", Verdict.READY)])
    assert st.applied_seq == 1


def test_follower_rejects_a_misrouted_or_out_of_order_round():
    f = Follower(RankState(2, 3))
    empty = (Tally(frozenset(), frozenset()),) * 5
    with pytest.raises(ProtocolError, match="after 1 hops"):
        f.relay(RoundMsg(0, 1, 0, (), empty))
    with pytest.raises(ProtocolError, match="round 1"):
        f.relay(RoundMsg(1, 2, 0, (), empty))
    with pytest.raises(ProtocolError, match="start at seq 3"):
        f.relay(RoundMsg(0, 2, 3, (), empty))


def test_leader_rejects_a_tampered_result():
    leader = Leader(RankState(0, 2))
    leader.state.set_local(TX, "a", P)
    msg, _ = leader.propose()
    grown = tuple(Tally(frozenset({"evil"}) if s == TX else t.ready, t.failed) for s, t in zip(Stream, msg.tallies))
    with pytest.raises(ProtocolError, match="grew"):
        leader.conclude(RoundMsg(0, 2, 0, (), grown))
    with pytest.raises(ProtocolError, match="hops"):
        leader.conclude(RoundMsg(0, 1, 0, (), msg.tallies))
    with pytest.raises(ProtocolError, match="round 5"):
        leader.conclude(RoundMsg(5, 2, 0, (), msg.tallies))
    assert leader.conclude(RoundMsg(0, 2, 0, (), msg.tallies)) == ()


def test_driver_raises_value_error_on_a_peer_bad_bytes():
    ring = InMemoryRing(2)
    follower = RingDriver(make_role(RankState(1, 2)), ring.endpoint(1))
    ring.endpoint(0).send(b"\x80\x04\x95" + bytes(40))  # a pickle header: refused, not unpickled
    with pytest.raises(ValueError, match="magic"):
        follower.step(timeout=0)


def test_check_invariants_reports_counts():
    st = RankState(0, 2)
    st.set_local(TX, "a", R)
    st.set_local(PRE, "b", R)
    st.check_invariants()
    st._dead.add("a")  # corrupt it: a dead rid still in a view
    with pytest.raises(AssertionError, match=r"1 dead rid\(s\) still in DECODE_TRANSFERRED \(of 1 live, 1 dead\)"):
        st.check_invariants()
    leader = Leader(RankState(0, 2))
    leader.abort("x")
    leader._unshipped.clear()
    with pytest.raises(AssertionError, match=r"shipped 0 \+ unshipped 0 != applied 1"):
        leader.check_invariants()


def test_guard_is_held_around_every_state_access():
    class Counting:
        entered = 0

        def __enter__(self):
            Counting.entered += 1

        def __exit__(self, *exc):
            return False

    ring = InMemoryRing(2)
    lead = RingDriver(make_role(RankState(0, 2)), ring.endpoint(0), guard=Counting())
    follow = RingDriver(make_role(RankState(1, 2)), ring.endpoint(1), guard=Counting())
    lead.state.set_local(TX, "a", R)
    follow.state.set_local(TX, "a", R)
    assert run_round([lead, follow]).decisions == (Ruling(0, TX, "a", Verdict.READY),)
    assert Counting.entered == 3  # propose, relay, conclude
    lead.abort("b")
    assert Counting.entered == 4


def test_in_memory_ring_is_fifo_and_wraps():
    ring = InMemoryRing(3)
    ring.endpoint(2).send(b"one")
    ring.endpoint(2).send(b"two")
    assert (ring.pending(0), ring.endpoint(0).recv(0), ring.endpoint(0).recv(0), ring.endpoint(0).recv(0)) == (
        2,
        b"one",
        b"two",
        None,
    )
    assert (ring.num_sent, ring.bytes_sent) == (2, 6)
    with pytest.raises(TypeError):
        ring.endpoint(0).send("text")
