"""Exhaustive exploration of every interleaving, for small rings (model-check style).

A world is every rank's role and state, the round message on the ring (at most one),
and the environment's choices so far. From each world the explorer takes every enabled
action, each in its own copy:

    deliver        the message on the ring reaches its rank, which relays or concludes it
    start          rank 0 starts a round: right after concluding one, when it wants one
                   (back to back, as RingDriver does), or later, after it was idle
    set r x S      rank r's environment moves rid x to status S: PENDING -> READY or FAILED,
                   READY -> FAILED (a late failure); failures are budgeted
    abort x        rank 0 aborts rid x; budgeted

Every rid waits in one stream and starts PENDING on every rank. Worlds that differ
only in round numbers are the same world, so the search is finite. In every reached
world it checks agreement (prefixes of rank 0's log), exactly-once, no orphan and the
roles' invariants; at every hop, that the rank's report is its environment's truth and
the message is the intersection/union of the reports so far; at every conclusion,
validity (exactly the decisions the reports call for) and the liveness bound (every
rid settled when the round started is decided by it); in every world where neither the
ring nor an environment can move (aborts are optional), quiescence: every view empty,
every log equal, every rid decided. Such a world that is not quiescent is a deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.consensus import audit
from kvbridge.consensus.codec import RoundMsg, Tally
from kvbridge.consensus.roles import Follower, Leader
from kvbridge.consensus.state import RankState
from kvbridge.consensus.types import STREAMS, LocalStatus, Report, Stream

READY, FAILED, PENDING = LocalStatus.READY, LocalStatus.FAILED, LocalStatus.PENDING


@dataclass(frozen=True)
class Space:
    """What may happen. Without `scripts`, every environment chooses freely within the budgets."""

    pp_size: int  # ranks, >= 2
    rids: tuple[tuple[str, Stream], ...]  # each rid and the stream it waits in
    max_failures: int = 1  # FAILED statuses the environments may set, in all
    max_aborts: int = 1  # aborts rank 0 may issue, in all
    late_failures: bool = True  # a rid READY on a rank may still fail there
    scripts: tuple[tuple[tuple[LocalStatus, ...], ...], ...] | None = None  # [rank][rid]: statuses it sets, in order
    abortable: frozenset[str] | None = None  # rids rank 0 may abort (None: any)

    def __post_init__(self) -> None:
        if self.scripts is not None and (
            len(self.scripts) != self.pp_size or any(len(row) != len(self.rids) for row in self.scripts)
        ):
            raise ValueError(f"scripts must be [pp_size][len(rids)], got {len(self.scripts)} rows")


@dataclass
class World:
    """One reachable state; copied, never shared, across branches."""

    leader: Leader  # rank 0
    followers: list[Follower]  # ranks 1..P-1
    env: dict[tuple[int, str], LocalStatus]  # (rank, rid) -> the status its environment set last
    wire: tuple[int, bytes] | None = None  # (receiving rank, payload) of the round on the ring
    proposal: bytes = b""  # rank 0's proposal of the round on the ring, less its round id
    must_decide: frozenset[str] = frozenset()  # rids settled when the round on the ring started
    failures: int = 0  # FAILED statuses set so far
    aborts: int = 0  # aborts issued so far

    def __post_init__(self) -> None:
        self.states: list[RankState] = [self.leader.state, *(f.state for f in self.followers)]  # by rank

    def copy(self) -> World:
        return World(
            self.leader.clone(),
            [f.clone() for f in self.followers],
            dict(self.env),
            self.wire,
            self.proposal,
            self.must_decide,
            self.failures,
            self.aborts,
        )


@dataclass
class Stats:
    """What an exploration covered."""

    worlds: int = 0  # distinct worlds reached
    transitions: int = 0  # actions taken (including into known worlds)
    terminal: int = 0  # worlds with no enabled action (all checked quiescent)
    rounds_concluded: int = 0  # conclusions checked for validity and the liveness bound
    final_logs: set[tuple[str, ...]] = field(default_factory=set)  # distinct "rid:VERDICT" logs at quiescence


def explore(space: Space, max_worlds: int = 5_000_000) -> Stats:
    """Visit every world reachable in `space`; raises AssertionError at the first violation."""
    if space.pp_size < 2:
        raise ValueError(f"explore needs pp_size >= 2, got {space.pp_size}")
    stats = Stats()
    start = _initial(space)
    seen = {_key(space, start)}
    stack = [(start, _key(space, start))]
    while stack:
        world, key = stack.pop()
        stats.worlds += 1
        if stats.worlds > max_worlds:
            raise AssertionError(f"more than {max_worlds} worlds: the space is not finite as configured")
        moves = 0  # ring and environment moves; aborts are optional and do not count
        for nxt in _protocol_moves(space, world, stats):
            moves += 1
            _check_logs(nxt)
            _visit(space, nxt, _key(space, nxt), seen, stack)
        for nxt in _abort_moves(space, world):
            stats.transitions += 1
            _check_logs(nxt)
            _visit(space, nxt, _key(space, nxt), seen, stack)
        for rank, i, status in _env_moves(space, world):
            moves += 1
            # A status change touches one entry of the key: compute it first, copy only for a new world.
            nkey = _key_after_set(key, rank, i, status)
            if nkey not in seen:
                nxt = world.copy()
                rid, stream = space.rids[i]
                nxt.states[rank].set_local(stream, rid, status)
                nxt.env[(rank, rid)] = status
                nxt.failures += status == FAILED
                if stats.worlds % 16 == 0:  # spot-check the shortcut
                    assert _key(space, nxt) == nkey, "the shortcut key disagrees with the world"
                _visit(space, nxt, nkey, seen, stack)
        stats.transitions += moves
        if not moves:
            _check_terminal(space, world, stats)
    return stats


def _visit(space: Space, w: World, key: tuple, seen: set, stack: list) -> None:
    if key not in seen:
        _check_world(w)
        seen.add(key)
        stack.append((w, key))


def _initial(space: Space) -> World:
    states = [RankState(r, space.pp_size) for r in range(space.pp_size)]
    for st in states:
        for rid, stream in space.rids:
            st.set_local(stream, rid, PENDING)
    env = {(r, rid): PENDING for r in range(space.pp_size) for rid, _ in space.rids}
    return World(Leader(states[0]), [Follower(st) for st in states[1:]], env)


def _protocol_moves(space: Space, w: World, stats: Stats):
    """Deliver or start: at most one is enabled."""
    if w.wire is not None:
        yield _deliver(space, w.copy(), stats)
    elif w.leader.wants_round:
        yield _start(space, w.copy())


def _abort_moves(space: Space, w: World):
    if w.aborts < space.max_aborts:
        for rid, _ in space.rids:
            if not w.leader.state.is_dead(rid) and (space.abortable is None or rid in space.abortable):
                nxt = w.copy()
                nxt.leader.abort(rid)
                nxt.aborts += 1
                yield nxt


def _env_moves(space: Space, w: World):
    """(rank, rid index, status) of every enabled status change."""
    for rank, st in enumerate(w.states):
        for i, (rid, stream) in enumerate(space.rids):
            held = st.status(stream, rid)  # the environment only moves what its rank still holds
            if held is not None:
                for status in _next_statuses(space, w, held, rank, i):
                    yield rank, i, status


def _next_statuses(space: Space, w: World, held: LocalStatus, rank: int, i: int) -> tuple[LocalStatus, ...]:
    if space.scripts is not None:
        script = (PENDING, *space.scripts[rank][i])  # statuses are set in order, each once
        at = script.index(held)
        return script[at + 1 : at + 2]
    can_fail = w.failures < space.max_failures
    if held == PENDING:
        return (READY, FAILED) if can_fail else (READY,)
    if held == READY and can_fail and space.late_failures:
        return (FAILED,)
    return ()


def _start(space: Space, w: World) -> World:
    decided = {d.rid for d in w.leader.state.log}
    w.must_decide = frozenset(rid for rid, _ in space.rids if rid not in decided and _settled(space, w, rid))
    msg, report = w.leader.propose()
    _check_report(space, w, 0, report)
    payload = msg.encode()
    w.wire, w.proposal = (1, payload), _without_round_id(payload)
    return w


def _settled(space: Space, w: World, rid: str) -> bool:
    statuses = [w.env[(r, rid)] for r in range(space.pp_size)]
    return FAILED in statuses or all(s == READY for s in statuses)


def _deliver(space: Space, w: World, stats: Stats) -> World:
    rank, payload = w.wire
    msg = _decode(payload)
    if rank == 0:
        _conclude(space, w, msg, stats)
        if w.leader.wants_round:  # back to back, as RingDriver does; a later start is only a slower hop
            _start(space, w)
        return w
    out, report = w.followers[rank - 1].relay(msg)
    _check_report(space, w, rank, report)
    want = tuple(Tally(t.ready & r, t.failed | f) for t, r, f in zip(msg.tallies, report.ready, report.failed))
    assert out.tallies == want, f"rank {rank}: forwarded tallies are not the merge of its report"
    w.wire = ((rank + 1) % space.pp_size, out.encode())
    return w


_DECODED: dict[bytes, RoundMsg] = {}


def _decode(payload: bytes) -> RoundMsg:
    """RoundMsg.decode, memoized: the same payloads recur across worlds, and messages are immutable."""
    msg = _DECODED.get(payload)
    if msg is None:
        if len(_DECODED) > 1 << 16:
            _DECODED.clear()
        msg = _DECODED[payload] = RoundMsg.decode(payload)
    return msg


def _conclude(space: Space, w: World, msg: RoundMsg, stats: Stats) -> None:
    """Validity: every hop checked its report against the truth and its merge, so the returning
    tallies are the intersection/union of the round's reports; the decisions must be what they call for."""
    first = w.leader.state.applied_seq
    dead_before = {d.rid for d in w.leader.state.log if d.is_terminal}
    decisions = w.leader.conclude(msg)
    merged = Report(msg.round_id, 0, tuple(t.ready for t in msg.tallies), tuple(t.failed for t in msg.tallies))
    want = audit.expected_decisions(audit.RoundRecord(msg.round_id, (merged,), first, decisions), dead_before)
    got = [(d.stream, d.rid, d.verdict) for d in decisions]
    assert got == want, f"round {msg.round_id}: decided {got}, its reports call for {want}"
    decided = {d.rid for d in w.leader.state.log}
    missed = w.must_decide - decided
    assert not missed, f"round {msg.round_id}: {sorted(missed)} settled before it started, still undecided"
    w.wire, w.proposal, w.must_decide = None, b"", frozenset()
    stats.rounds_concluded += 1


def _check_report(space: Space, w: World, rank: int, report: Report) -> None:
    """A rank reports exactly what its environment set, for the rids it still holds."""
    st = w.states[rank]
    for status, sets in ((READY, report.ready), (FAILED, report.failed)):
        for stream in STREAMS:
            truth = {
                rid
                for rid, s in space.rids
                if s == stream and w.env[(rank, rid)] == status and st.status(s, rid) is not None
            }
            assert sets[stream] == truth, f"rank {rank} reported {sorted(sets[stream])} {status.name}, truth {truth}"


def _check_logs(w: World) -> None:
    """Agreement and exactly-once, after every action."""
    logs = [st.log for st in w.states]
    audit.check_agreement(logs, quiescent=False)
    audit.check_exactly_once(logs)


def _check_world(w: World) -> None:
    """No orphan and every invariant, in every new world."""
    audit.check_no_orphan(w.states)
    w.leader.check_invariants()


def _check_terminal(space: Space, w: World, stats: Stats) -> None:
    audit.check_quiescent(w.states)
    decided = {d.rid for d in w.leader.state.log}
    assert decided == {rid for rid, _ in space.rids}, f"quiescent with {sorted(decided)} of {len(space.rids)} decided"
    stats.terminal += 1
    stats.final_logs.add(tuple(f"{d.rid}:{d.verdict.name}" for d in w.leader.state.log))


def _key(space: Space, w: World) -> tuple:
    """Everything that shapes the future and the checks, except round numbers (and the logs
    of ranks > 0, which `_check_logs` proves are prefixes of rank 0's, of length applied_seq)."""
    ranks = tuple(
        (tuple(st._views[stream].get(rid) for rid, stream in space.rids), st.num_live, st.applied_seq)
        for st in w.states
    )
    wire = None if w.wire is None else (w.wire[0], _without_round_id(w.wire[1]))
    return (ranks, w.leader.state.log, w.leader.num_unshipped, w.proposal, wire, w.must_decide, w.failures, w.aborts)


def _without_round_id(payload: bytes) -> bytes:
    return payload[:3] + payload[11:]  # bytes 3..11 hold the round id (see consensus.codec)


def _key_after_set(key: tuple, rank: int, i: int, status: LocalStatus) -> tuple:
    """`_key` of the world after rank `rank` set rid `i` (which it holds) to `status`."""
    ranks = list(key[0])
    statuses, num_live, applied = ranks[rank]
    ranks[rank] = ((*statuses[:i], status, *statuses[i + 1 :]), num_live, applied)
    return (tuple(ranks), *key[1:6], key[6] + (status == FAILED), key[7])
