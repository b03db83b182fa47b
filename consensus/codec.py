"""The round message and its binary wire format. No pickle: a peer's bytes are parsed, never run.

One message type travels the ring. Rank 0 creates it (its own READY/FAILED sets, plus the
decisions not yet shipped); every later rank applies the decisions, merges its own sets
and forwards it; the last rank sends the result back to rank 0 without the decisions.

All streams share one message, so a round costs one ring traversal whatever the number
of busy streams, and all decisions share one seq space, so rank 0's order is total.

Layout, big-endian (struct "!"):

    header     magic b"KC", version u8 (=1), round_id u64, hops u16, first_seq u64,
               num_decisions u32, num_streams u8 (=5)
    decision   stream u8 (255: none, for ABORTED), verdict u8, rid
    tally      (one per stream, in Stream order) num_ready u32, num_failed u32,
               then num_ready rids, then num_failed rids
    rid        length u16 (1..65535), then that many bytes of utf-8

Rids within a tally are strictly increasing (utf-8 byte order is code point order), so
the encoding is canonical: equal messages encode to equal bytes, and every accepted
buffer re-encodes to itself. `decode` rejects anything else with ValueError: bad magic
or version, unknown enum values, a count that overruns the buffer, invalid utf-8, an
empty, duplicate or out-of-order rid, a rid both ready and failed in one stream,
decision seqs past 2**64, trailing bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import pairwise

from kvbridge.consensus.types import NUM_STREAMS, STREAMS, Ruling, Stream, Verdict

MAGIC = b"KC"
VERSION = 1
NO_STREAM = 255  # the stream byte of an ABORTED decision
MAX_RID_BYTES = 0xFFFF

_HEADER = struct.Struct("!2sBQHQIB")  # magic, version, round_id, hops, first_seq, num_decisions, num_streams
_DECISION = struct.Struct("!BB")  # stream, verdict
_COUNTS = struct.Struct("!II")  # num_ready, num_failed
_RID_LEN = struct.Struct("!H")
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class Tally:
    """One stream's running result of a round."""

    ready: frozenset[str]  # rids READY on every rank merged so far (starts as rank 0's READY set)
    failed: frozenset[str]  # rids FAILED on at least one rank merged so far


EMPTY_TALLY = Tally(frozenset(), frozenset())


@dataclass(frozen=True)
class RoundMsg:
    """A round on its way around the ring."""

    round_id: int  # rank 0's round counter, 0, 1, 2, ... (u64)
    hops: int  # ranks merged so far: 1 when rank 0 sends it, pp_size when it returns (u16)
    first_seq: int  # seq of decisions[0]; with no decisions, the next seq rank 0 will issue (u64)
    decisions: tuple[Ruling, ...]  # rank 0's decisions not shipped before, seqs first_seq, first_seq + 1, ...
    tallies: tuple[Tally, ...]  # one per Stream, indexed by Stream

    def __post_init__(self) -> None:
        if not (0 <= self.round_id <= _U64_MAX and 1 <= self.hops <= 0xFFFF and 0 <= self.first_seq <= _U64_MAX):
            raise ValueError(f"round_id {self.round_id}, hops {self.hops} or first_seq {self.first_seq} out of range")
        if len(self.tallies) != NUM_STREAMS:
            raise ValueError(f"a round carries {NUM_STREAMS} tallies, got {len(self.tallies)}")
        for i, d in enumerate(self.decisions):
            if d.seq != self.first_seq + i:
                raise ValueError(f"decision {i} has seq {d.seq}, expected {self.first_seq + i}")
        for stream, t in zip(STREAMS, self.tallies):
            both = t.ready & t.failed
            if both:
                raise ValueError(f"{stream.name}: {len(both)} rid(s) both ready and failed, e.g. {min(both)!r}")

    @property
    def next_seq(self) -> int:
        """The seq after the last decision this message carries."""
        return self.first_seq + len(self.decisions)

    def without_decisions(self) -> RoundMsg:
        """The same round with its decisions dropped, as the last rank returns it to rank 0."""
        return replace(self, first_seq=self.next_seq, decisions=())

    def encode(self) -> bytes:
        out = [_HEADER.pack(MAGIC, VERSION, self.round_id, self.hops, self.first_seq, len(self.decisions), NUM_STREAMS)]
        for d in self.decisions:
            out.append(_DECISION.pack(NO_STREAM if d.stream is None else int(d.stream), int(d.verdict)))
            out.append(_encode_rid(d.rid))
        for t in self.tallies:
            out.append(_COUNTS.pack(len(t.ready), len(t.failed)))
            out.extend(_encode_rids(t.ready))
            out.extend(_encode_rids(t.failed))
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes) -> RoundMsg:
        """Parse `data`; raises ValueError (never anything else) when it is not a valid message."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"expected bytes, got {type(data).__name__}")
        r = _Reader(bytes(data))
        magic, version, round_id, hops, first_seq, num_decisions, num_streams = r.unpack(_HEADER)
        if magic != MAGIC:
            raise ValueError(f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise ValueError(f"unsupported version {version}, expected {VERSION}")
        if num_streams != NUM_STREAMS:
            raise ValueError(f"message has {num_streams} streams, expected {NUM_STREAMS}")
        if first_seq + num_decisions > _U64_MAX:
            raise ValueError(f"decision seqs overflow: first_seq {first_seq} + {num_decisions}")
        r.expect_room(num_decisions, _DECISION.size + _RID_LEN.size + 1, "decisions")
        decisions = tuple(_decode_decision(r, first_seq + i) for i in range(num_decisions))
        tallies = tuple(_decode_tally(r, stream) for stream in STREAMS)
        if r.remaining:
            raise ValueError(f"{r.remaining} trailing byte(s) after the message")
        return cls(round_id, hops, first_seq, decisions, tallies)


def _encode_rid(rid: str) -> bytes:
    raw = rid.encode("utf-8")
    if not 1 <= len(raw) <= MAX_RID_BYTES:
        raise ValueError(f"rid must be 1..{MAX_RID_BYTES} utf-8 bytes, got {len(raw)}: {rid[:40]!r}")
    return _RID_LEN.pack(len(raw)) + raw


def _encode_rids(rids: Iterable[str]) -> list[bytes]:
    return [_encode_rid(rid) for rid in sorted(rids)]


class _Reader:
    """A cursor over a buffer; every read checks that the bytes are there."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    @property
    def remaining(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.remaining:
            raise ValueError(f"truncated {what}: need {n} byte(s) at offset {self.pos}, have {self.remaining}")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, s: struct.Struct) -> tuple:
        return s.unpack(self.take(s.size, "header" if s is _HEADER else "field"))

    def expect_room(self, count: int, min_size: int, what: str) -> None:
        """Reject a count that cannot fit before allocating anything for it."""
        if count * min_size > self.remaining:
            raise ValueError(f"{count} {what} cannot fit in the {self.remaining} byte(s) left")

    def rid(self) -> str:
        (n,) = self.unpack(_RID_LEN)
        if n == 0:
            raise ValueError(f"empty rid at offset {self.pos - _RID_LEN.size}")
        raw = self.take(n, "rid")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"rid is not utf-8: {raw[:40]!r}") from e


def _decode_decision(r: _Reader, seq: int) -> Ruling:
    stream_byte, verdict_byte = r.unpack(_DECISION)
    try:
        verdict = Verdict(verdict_byte)
        stream = None if stream_byte == NO_STREAM else Stream(stream_byte)
    except ValueError as e:
        raise ValueError(f"decision {seq}: {e}") from None
    return Ruling(seq, stream, r.rid(), verdict)  # Ruling checks stream-None <=> ABORTED


def _decode_tally(r: _Reader, stream: Stream) -> Tally:
    num_ready, num_failed = r.unpack(_COUNTS)
    r.expect_room(num_ready + num_failed, _RID_LEN.size + 1, f"{stream.name} rids")
    ready = [r.rid() for _ in range(num_ready)]
    failed = [r.rid() for _ in range(num_failed)]
    for rids in (ready, failed):
        if any(a >= b for a, b in pairwise(rids)):
            raise ValueError(f"{stream.name}: tally rids not strictly increasing (duplicate or out of order)")
    return Tally(frozenset(ready), frozenset(failed))
