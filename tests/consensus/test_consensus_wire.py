"""The round message's binary format: exact bytes, round trips, and refusal of malformed input."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.consensus.codec import EMPTY_TALLY, RoundMsg, Tally
from kvbridge.consensus.types import Ruling, Stream, Verdict

TX = Stream.DECODE_TRANSFERRED


def make_msg(decisions=(), first_seq=0, **tallies: Tally) -> RoundMsg:
    by_stream = tuple(tallies.get(s.name, EMPTY_TALLY) for s in Stream)
    return RoundMsg(round_id=7, hops=2, first_seq=first_seq, decisions=tuple(decisions), tallies=by_stream)


def tally(ready=(), failed=()) -> Tally:
    return Tally(frozenset(ready), frozenset(failed))


SAMPLE = make_msg(
    [Ruling(3, TX, "a", Verdict.READY), Ruling(4, None, "ü", Verdict.ABORTED)],
    first_seq=3,
    DECODE_TRANSFERRED=tally(["b", "a"], ["c"]),
)


def test_exact_bytes_of_a_small_message():
    header = b"KC\x01" + struct.pack("!QHQIB", 7, 2, 3, 2, 5)
    decisions = b"\x04\x01" + b"\x00\x01a" + b"\xff\x03" + b"\x00\x02\xc3\xbc"
    empty = struct.pack("!II", 0, 0)
    tx = struct.pack("!II", 2, 1) + b"\x00\x01a" + b"\x00\x01b" + b"\x00\x01c"
    assert SAMPLE.encode() == header + decisions + empty * 4 + tx
    assert RoundMsg.decode(SAMPLE.encode()) == SAMPLE


def test_round_trip_keeps_every_field():
    back = RoundMsg.decode(SAMPLE.encode())
    assert (back.round_id, back.hops, back.first_seq, back.next_seq) == (7, 2, 3, 5)
    assert back.decisions[1] == Ruling(4, None, "ü", Verdict.ABORTED)
    assert back.tallies[TX] == tally(["a", "b"], ["c"])


def _replace(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


GOOD = SAMPLE.encode()
DECISIONS_AT = 2 + 1 + 8 + 2 + 8 + 4 + 1  # end of the header


MALFORMED = [
    (b"", "truncated header"),
    (_replace(GOOD, 0, b"PK"), "bad magic"),
    (_replace(GOOD, 2, b"\x02"), "unsupported version"),
    (_replace(GOOD, DECISIONS_AT - 1, b"\x06"), "6 streams"),
    (_replace(GOOD, DECISIONS_AT, b"\x09"), "decision 3: 9 is not a valid Stream"),
    (_replace(GOOD, DECISIONS_AT + 1, b"\x07"), "decision 3: 7 is not a valid Verdict"),
    (_replace(GOOD, DECISIONS_AT + 1, b"\x03"), "stream is None exactly when"),  # ABORTED with a stream
    (_replace(GOOD, DECISIONS_AT + 2, b"\x00\x00"), "empty rid"),
    (_replace(GOOD, DECISIONS_AT + 4, b"\xff"), "not utf-8"),
    (_replace(GOOD, DECISIONS_AT - 5, b"\xff\xff\xff\xff"), "cannot fit"),
    (_replace(GOOD, len(GOOD) - 9, b"\x00\x01b\x00\x01a"), "not strictly increasing"),
    (_replace(GOOD, len(GOOD) - 3, b"\x00\x01b"), "both ready and failed"),
    (GOOD + b"\x00", "1 trailing byte"),
    (_replace(GOOD, 3 + 8 + 2, b"\xff" * 8), "overflow"),
    ("text", "expected bytes"),
]


@pytest.mark.parametrize(("data", "why"), MALFORMED, ids=[why for _, why in MALFORMED])
def test_malformed_input_raises_value_error(data, why):
    with pytest.raises(ValueError, match=why):
        RoundMsg.decode(data)


def test_every_truncation_raises_value_error():
    for n in range(len(GOOD)):
        with pytest.raises(ValueError):
            RoundMsg.decode(GOOD[:n])


def test_encode_refuses_what_decode_would_refuse():
    with pytest.raises(ValueError, match=r"1\.\.65535"):
        make_msg(DECODE_TRANSFERRED=tally(["x" * 70000])).encode()
    with pytest.raises(ValueError, match="both ready and failed"):
        make_msg(DECODE_TRANSFERRED=tally(["a"], ["a"]))
    with pytest.raises(ValueError, match="expected 1"):
        make_msg([Ruling(2, TX, "a", Verdict.READY)], first_seq=1)
    with pytest.raises(ValueError, match="out of range"):
        RoundMsg(0, 0, 0, (), (EMPTY_TALLY,) * 5)


rids = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
rid_sets = st.frozensets(rids, max_size=6)


@st.composite
def messages(draw) -> RoundMsg:
    first = draw(st.integers(0, 2**40))
    n = draw(st.integers(0, 5))
    decisions = []
    for i in range(n):
        verdict = draw(st.sampled_from(Verdict))
        stream = None if verdict == Verdict.ABORTED else draw(st.sampled_from(Stream))
        decisions.append(Ruling(first + i, stream, draw(rids), verdict))
    tallies = []
    for _ in Stream:
        ready = draw(rid_sets)
        tallies.append(Tally(ready, draw(rid_sets) - ready))
    return RoundMsg(
        draw(st.integers(0, 2**64 - 1)), draw(st.integers(1, 0xFFFF)), first, tuple(decisions), tuple(tallies)
    )


@settings(max_examples=300, deadline=None)
@given(messages())
def test_round_trip_of_any_message(msg):
    data = msg.encode()
    assert RoundMsg.decode(data) == msg
    assert RoundMsg.decode(data).encode() == data


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_refused_or_canonical(data):
    try:
        msg = RoundMsg.decode(data)
    except ValueError:
        return
    assert msg.encode() == data


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_corrupted_messages_are_refused_or_canonical(data):
    raw = bytearray(GOOD)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        msg = RoundMsg.decode(bytes(raw))
    except ValueError:
        return
    assert msg.encode() == bytes(raw)
