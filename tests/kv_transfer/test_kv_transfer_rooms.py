"""The decode rank's room table: every check on writes and notices, and when a room succeeds."""

from __future__ import annotations

import re
import threading
import time

import pytest

from kvbridge.kv_transfer.poll import KVPoll, StatusBoard
from kvbridge.kv_transfer.rooms import BadTransfer, Notice, RoomClosed, RoomNotFound, RoomTable, Source

KEY = bytes(range(16))  # the rooms' write key (the decode node mints one per room)
DIRECT, THROUGH = True, False  # the backend writes into the pool itself (shm), or the bytes come through (grpc)

BLOCK = 64  # bytes of one layer of one page
PAGE_SIZE = 4
P_SOURCES = [Source(0, 0, 3), Source(1, 3, 6)]  # prefill pp 2 over 6 layers


def make_table(rank=1, layers=(2, 4), first_token=False) -> RoomTable:
    """Decode rank 1 of [(0,2),(2,4),(4,6)]: fed by prefill rank 0 (layer 2) and 1 (layer 3)."""
    return RoomTable(rank, layers, 16, PAGE_SIZE, BLOCK, first_token, StatusBoard())


def write(t: RoomTable, room, src, lo, hi, pages, nbytes=None):
    ticket = t.begin_write(room, KEY, src, lo, hi, pages, len(pages) * (hi - lo) * BLOCK if nbytes is None else nbytes)
    t.end_write(ticket)


def notice(src, num_tokens, nbytes, layers=None, error=""):
    lo, hi = layers or {0: (2, 3), 1: (3, 4)}[src]
    return Notice(src, lo, hi, num_tokens, nbytes, error)


def test_data_path_room_succeeds_once_notices_and_bytes_agree():
    t = make_table()
    t.expect(5, "r", [7, 8, 9], P_SOURCES, THROUGH, KEY)
    assert t.board.poll(5) == KVPoll.WAITING_FOR_INPUT
    write(t, 5, 0, 2, 3, [7, 8])
    write(t, 5, 0, 2, 3, [8, 9])  # the partial page 8 again
    assert t.board.poll(5) == KVPoll.TRANSFERRING
    t.done(notice(0, 10, 4 * BLOCK), 5, KEY)
    write(t, 5, 1, 3, 4, [7, 8, 9])
    assert t.board.poll(5) == KVPoll.TRANSFERRING
    t.done(notice(1, 10, 3 * BLOCK), 5, KEY)
    assert t.board.poll(5) == KVPoll.SUCCESS


def test_bytes_landing_after_the_notice_complete_the_room():
    t = make_table()
    t.expect(5, "r", [7, 8], P_SOURCES, THROUGH, KEY)
    t.done(notice(0, 8, 2 * BLOCK), 5, KEY)
    t.done(notice(1, 8, 2 * BLOCK), 5, KEY)
    assert t.board.poll(5) == KVPoll.WAITING_FOR_INPUT
    write(t, 5, 0, 2, 3, [7, 8])
    write(t, 5, 1, 3, 4, [7, 8])
    assert t.board.poll(5) == KVPoll.SUCCESS


def test_direct_room_counts_notice_bytes_against_the_prompt_pages():
    t = make_table()
    t.expect(5, "r", [7, 8, 9], P_SOURCES, DIRECT, KEY)
    t.done(notice(0, 9, 3 * BLOCK), 5, KEY)
    t.done(notice(1, 9, 3 * BLOCK), 5, KEY)
    assert t.board.poll(5) == KVPoll.SUCCESS
    t.expect(6, "r", [1, 2, 3], P_SOURCES, DIRECT, KEY)
    t.done(notice(0, 9, 2 * BLOCK), 6, KEY)  # 9 tokens need 3 pages
    with pytest.raises(BadTransfer, match="prefill rank 0 reports"):  # the sender learns why
        t.done(notice(1, 9, 3 * BLOCK), 6, KEY)
    assert t.board.poll(6) == KVPoll.FAILED
    assert t.board.reason(6) == f"prefill rank 0 reports {2 * BLOCK} bytes; 3 pages need {3 * BLOCK}"


@pytest.mark.parametrize(
    "src,lo,hi,pages,nbytes,reason",
    [
        (0, 2, 3, [16], None, "page id 16 out of range [0, 16)"),
        (0, 2, 3, [3], None, "page id 3 is not registered for room 5"),
        (0, 1, 3, [7], None, "layers [1, 3) are outside prefill rank 0's overlap [2, 3) with decode rank 1"),
        (1, 2, 4, [7], None, "layers [2, 4) are outside prefill rank 1's overlap [3, 4) with decode rank 1"),
        (0, 2, 3, [7], BLOCK + 1, f"{BLOCK + 1} bytes for 1 pages x 1 layers; expected {BLOCK}"),
        (2, 2, 3, [7], None, "prefill rank 2 is not a source of room 5 on decode rank 1"),
    ],
)
def test_bad_write_fails_its_room_and_names_the_value(src, lo, hi, pages, nbytes, reason):
    t = make_table()
    t.expect(5, "r", [7, 8], P_SOURCES, THROUGH, KEY)
    t.expect(6, "other", [1, 2], P_SOURCES, THROUGH, KEY)
    with pytest.raises(BadTransfer, match=f"^{re.escape(reason)}$"):
        t.begin_write(5, KEY, src, lo, hi, pages, len(pages) * (hi - lo) * BLOCK if nbytes is None else nbytes)
    assert t.board.poll(5) == KVPoll.FAILED
    assert t.board.reason(5) == reason
    assert t.board.poll(6) == KVPoll.WAITING_FOR_INPUT  # the other room is untouched
    write(t, 6, 0, 2, 3, [1])
    assert t.board.poll(6) == KVPoll.TRANSFERRING


def test_unknown_room_is_not_found_and_terminal_room_is_closed():
    t = make_table()
    with pytest.raises(RoomNotFound, match="room 99 is not expected on decode rank 1") as e:
        t.begin_write(99, KEY, 0, 2, 3, [7], BLOCK)
    assert e.value.code == "NOT_FOUND"
    with pytest.raises(RoomNotFound):
        t.done(notice(0, 4, BLOCK), 99, KEY)
    t.expect(5, "r", [7], P_SOURCES, THROUGH, KEY)
    t.fail(5, "decode timeout")
    with pytest.raises(RoomClosed, match="room 5 is already FAILED: decode timeout") as e:
        t.begin_write(5, KEY, 0, 2, 3, [7], BLOCK)
    assert e.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize(
    "n,reason",
    [
        (
            notice(0, 4, BLOCK, layers=(2, 4)),
            "notice for layers [2, 4) from prefill rank 0; its overlap with decode rank 1 is [2, 3)",
        ),
        (notice(0, 9, BLOCK), "num_tokens 9 outside [1, 8] (the room's pages)"),
        (notice(0, 0, BLOCK), "num_tokens 0 outside [1, 8] (the room's pages)"),
        (notice(3, 4, BLOCK, layers=(2, 3)), "prefill rank 3 is not a source of room 5 on decode rank 1"),
    ],
)
def test_bad_notice_fails_the_room(n, reason):
    t = make_table()
    t.expect(5, "r", [7, 8], P_SOURCES, DIRECT, KEY)
    with pytest.raises(BadTransfer):
        t.done(n, 5, KEY)
    assert t.board.reason(5) == reason


def test_notice_with_error_fails_the_room_without_raising():
    t = make_table()
    t.expect(5, "r", [7, 8], P_SOURCES, THROUGH, KEY)
    t.done(notice(1, 4, 0, error="prefill aborted"), 5, KEY)
    assert (t.board.poll(5), t.board.reason(5)) == (KVPoll.FAILED, "prefill rank 1: prefill aborted")


def test_more_bytes_than_the_notice_says_fails():
    t = make_table()
    t.expect(5, "r", [7, 8], P_SOURCES, THROUGH, KEY)
    write(t, 5, 0, 2, 3, [7, 8])
    write(t, 5, 1, 3, 4, [7, 8])
    t.done(notice(1, 8, 2 * BLOCK), 5, KEY)
    with pytest.raises(BadTransfer):
        t.done(notice(0, 8, BLOCK), 5, KEY)
    assert t.board.reason(5) == f"prefill rank 0: {2 * BLOCK} bytes landed, its notice says {BLOCK}"


def test_pages_never_written_fail_even_when_bytes_add_up():
    t = make_table()
    t.expect(5, "r", [7, 8], P_SOURCES, THROUGH, KEY)
    write(t, 5, 0, 2, 3, [7])
    write(t, 5, 0, 2, 3, [7])  # page 8 never written
    write(t, 5, 1, 3, 4, [7, 8])
    t.done(notice(1, 8, 2 * BLOCK), 5, KEY)
    with pytest.raises(BadTransfer):
        t.done(notice(0, 8, 2 * BLOCK), 5, KEY)
    assert t.board.reason(5) == "prefill rank 0 never wrote pages [8] of the prompt"


def test_sources_must_agree_on_num_tokens():
    t = make_table()
    t.expect(5, "r", [7, 8], P_SOURCES, DIRECT, KEY)
    t.done(notice(0, 8, 2 * BLOCK), 5, KEY)
    with pytest.raises(BadTransfer):
        t.done(notice(1, 7, 2 * BLOCK), 5, KEY)
    assert t.board.reason(5) == "prefill ranks disagree on num_tokens: [7, 8]"


def test_rank_zero_waits_for_the_first_token():
    t = make_table(rank=0, layers=(0, 2), first_token=True)
    t.expect(5, "r", [7], P_SOURCES, DIRECT, KEY)  # only prefill rank 0 overlaps [0, 2)
    t.done(Notice(0, 0, 2, 3, 2 * BLOCK), 5, KEY)
    assert t.board.poll(5) == KVPoll.WAITING_FOR_INPUT
    t.set_first_token(5, KEY, 42, 3)
    assert t.board.poll(5) == KVPoll.SUCCESS
    assert t.first_token(5) == (42, 3)


def test_first_token_disagreeing_with_notices_fails():
    t = make_table(rank=0, layers=(0, 2), first_token=True)
    t.expect(5, "r", [7], P_SOURCES, DIRECT, KEY)
    t.set_first_token(5, KEY, 42, 4)
    with pytest.raises(BadTransfer):
        t.done(Notice(0, 0, 2, 3, 2 * BLOCK), 5, KEY)
    assert t.board.reason(5) == "first token says 4 prompt tokens, notices 3"


def test_first_token_on_another_rank_is_a_failed_precondition():
    t = make_table()
    t.expect(5, "r", [7], P_SOURCES, DIRECT, KEY)
    with pytest.raises(RoomClosed, match="decode rank 1 takes no first tokens"):
        t.set_first_token(5, KEY, 1, 1)


def test_a_first_token_riding_the_notice_completes_rank_zero_in_one_message():
    t = make_table(rank=0, layers=(0, 2), first_token=True)
    t.expect(5, "r", [7], P_SOURCES, DIRECT, KEY)
    t.done(Notice(0, 0, 2, 3, 2 * BLOCK, first_token=42), 5, KEY)
    assert t.board.poll(5) == KVPoll.SUCCESS
    assert t.first_token(5) == (42, 3)  # its prompt length is the notice's num_tokens


def test_a_notice_whose_first_token_differs_from_the_first_token_call_fails_the_room():
    t = make_table(rank=0, layers=(0, 2), first_token=True)
    t.expect(5, "r", [7], P_SOURCES, DIRECT, KEY)
    t.set_first_token(5, KEY, 42, 3)
    with pytest.raises(BadTransfer):
        t.done(Notice(0, 0, 2, 3, 2 * BLOCK, first_token=43), 5, KEY)
    assert t.board.poll(5) == KVPoll.FAILED
    assert t.board.reason(5) == "second first token (43, 3) after (42, 3) for room 5"


def test_a_first_token_in_a_notice_to_another_rank_is_refused():
    t = make_table()
    t.expect(5, "r", [7], P_SOURCES, DIRECT, KEY)
    with pytest.raises(RoomClosed, match="decode rank 1 takes no first tokens"):
        t.done(Notice(0, 2, 3, 3, BLOCK, first_token=1), 5, KEY)
    assert t.board.poll(5) == KVPoll.WAITING_FOR_INPUT  # nothing recorded: the sender fails the room itself


def test_expect_rejects_bad_registrations():
    t = make_table()
    with pytest.raises(ValueError, match="page id 16 out of range"):
        t.expect(5, "r", [16], P_SOURCES, THROUGH, KEY)
    with pytest.raises(ValueError, match="repeated page ids"):
        t.expect(5, "r", [1, 1], P_SOURCES, THROUGH, KEY)
    with pytest.raises(ValueError, match="no source overlaps"):
        t.expect(5, "r", [1], [Source(0, 4, 6)], THROUGH, KEY)


def test_forget_waits_for_copies_in_flight():
    t = make_table()
    t.expect(5, "r", [7], P_SOURCES, THROUGH, KEY)
    ticket = t.begin_write(5, KEY, 0, 2, 3, [7], BLOCK)
    done = threading.Event()
    th = threading.Thread(target=lambda: (t.forget(5), done.set()))
    th.start()
    deadline = time.monotonic() + 60
    while t.authentic(5, KEY):  # until forget() took the room off the table (it then waits for the copy)
        assert time.monotonic() < deadline, "forget() never started"
        time.sleep(0.01)
    assert not done.is_set()
    with pytest.raises(RoomNotFound):  # no new writes meanwhile
        t.begin_write(5, KEY, 0, 2, 3, [7], BLOCK)
    t.end_write(ticket)
    th.join(60)
    assert done.is_set() and 5 not in t.board


def test_a_room_with_held_pages_expects_only_the_pages_after_them():
    """The decode node holds the prompt's first 2 pages (its prefix cache): 10 tokens need page 3 only."""
    t = make_table()
    t.expect(5, "r", [9], P_SOURCES, THROUGH, KEY, held_pages=2)
    write(t, 5, 0, 2, 3, [9])
    t.done(notice(0, 10, BLOCK), 5, KEY)
    write(t, 5, 1, 3, 4, [9])
    t.done(notice(1, 10, BLOCK), 5, KEY)
    assert t.board.poll(5) == KVPoll.SUCCESS
    # a prompt held whole: nothing to write, the notices alone complete it (8 tokens = 2 pages)
    t.expect(6, "r", [], P_SOURCES, DIRECT, KEY, held_pages=2)
    t.done(notice(0, 8, 0), 6, KEY)
    t.done(notice(1, 8, 0), 6, KEY)
    assert t.board.poll(6) == KVPoll.SUCCESS
    # a notice claiming fewer tokens than the held pages plus one written page fails the room
    t.expect(7, "r", [10], P_SOURCES, DIRECT, KEY, held_pages=2)
    with pytest.raises(BadTransfer, match=re.escape("num_tokens 8 outside [9, 12] (the room's pages)")):
        t.done(notice(0, 8, BLOCK), 7, KEY)
    with pytest.raises(ValueError, match="room 8: no pages"):
        t.expect(8, "r", [], P_SOURCES, DIRECT, KEY)
