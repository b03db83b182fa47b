"""KVPoll: every transition, legal or not, and the status board that reports them."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.kv_transfer.poll import IllegalTransition, KVPoll, PollState, StatusBoard, StatusChange

B, W, T, S, F = (
    KVPoll.BOOTSTRAPPING,
    KVPoll.WAITING_FOR_INPUT,
    KVPoll.TRANSFERRING,
    KVPoll.SUCCESS,
    KVPoll.FAILED,
)

# old -> the states it may move to (a self-move of a non-terminal state is a no-op)
LEGAL = {
    B: {B, W, T, S, F},
    W: {W, T, S, F},
    T: {T, S, F},
    S: set(),
    F: set(),
}
ALL_PAIRS = list(itertools.product(KVPoll, KVPoll))


def test_values_order_failed_lowest_so_min_is_least_advanced():
    assert [int(s) for s in (F, B, W, T, S)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("old,new", [p for p in ALL_PAIRS if p[1] in LEGAL[p[0]]])
def test_legal_transition_moves(old, new):
    st = PollState(old)
    changed = st.advance(new, "why")
    assert st.state == new
    assert changed == (old != new)
    assert st.reason == ("why" if new == F else "")


@pytest.mark.parametrize("old,new", [p for p in ALL_PAIRS if p[1] not in LEGAL[p[0]]])
def test_illegal_transition_raises_and_keeps_state(old, new):
    st = PollState(old)
    with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
        st.advance(new)
    assert st.state == old


def test_the_table_covers_thirteen_illegal_moves():
    # backwards: W->B, T->B, T->W; out of SUCCESS: 5; out of FAILED: 5
    assert sum(1 for o, n in ALL_PAIRS if n not in LEGAL[o]) == 13


def test_failed_reason_defaults_to_failed():
    st = PollState(W)
    st.advance(F)
    assert st.reason == "failed"


def test_board_delivers_changes_in_order_through_callback():
    seen: list[StatusChange] = []
    board = StatusBoard(seen.append)
    board.add(7, "r7")
    board.advance(7, W)
    board.advance(7, W)  # no change, no event
    board.advance(7, T)
    assert seen == []  # nothing until flush
    board.flush()
    assert seen == [StatusChange(7, "r7", W, ""), StatusChange(7, "r7", T, "")]
    board.fail(7, "boom")
    board.flush()
    assert seen[-1] == StatusChange(7, "r7", F, "boom")


def test_board_queues_changes_without_callback():
    board = StatusBoard()
    board.add(1, "a", W)
    board.advance(1, S)
    board.flush()
    assert board.pop_changes() == [StatusChange(1, "a", S, "")]
    assert board.pop_changes() == []


def test_board_fail_is_a_no_op_on_terminal_rooms():
    board = StatusBoard()
    board.add(1)
    board.advance(1, S)
    assert board.fail(1, "late") is False
    assert board.poll(1) == S
    board.add(2)
    assert board.fail(2, "first") is True
    assert board.fail(2, "second") is False
    assert board.reason(2) == "first"


def test_board_rejects_unknown_and_duplicate_rooms():
    board = StatusBoard()
    with pytest.raises(KeyError):
        board.poll(3)
    board.add(3, "x")
    with pytest.raises(ValueError, match="room 3 is already known"):
        board.add(3, "y")
    board.remove(3)
    assert 3 not in board
