"""The nouns of consensus: streams, local statuses, verdicts, decisions, reports.

Every record is immutable. A `Ruling` is what every rank applies, once, in rank 0's
order; a `Report` is what one rank contributed to one round (kept for audits).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Stream(IntEnum):
    """A stage of a request's life that needs every rank's agreement before it moves on."""

    PREFILL_BOOTSTRAPPED = 0  # prefill: the decode side's registration arrived on every rank (unused by
    # kvbridge's prefill node since registration overlaps prefill; kept: the protocol is generic)
    PREFILL_TRANSFERRED = 1  # prefill: every rank's KV pushes are done; pages may be freed
    DECODE_PREALLOCATED = 2  # decode: pages reserved on every rank; may register with prefill
    DECODE_RETRACTED = 3  # decode: a retracted request may resume on every rank
    DECODE_TRANSFERRED = 4  # decode: every rank holds all its KV pages; may join decoding


STREAMS: tuple[Stream, ...] = tuple(Stream)  # iterating an Enum class is slow; hot paths use this
NUM_STREAMS = len(STREAMS)


class LocalStatus(IntEnum):
    """One rank's own view of one request in one stream, set by that rank's environment."""

    PENDING = 0  # known, not yet ready here
    READY = 1  # ready here (e.g. this rank's transfer finished)
    FAILED = 2  # failed here; sticky: a FAILED status never changes back


class Verdict(IntEnum):
    """What rank 0 decided for a request."""

    READY = 1  # every rank reported ready in one round: the request may move on in that stream
    FAILED = 2  # some rank reported failed: the request is dropped from every stream
    ABORTED = 3  # rank 0 aborted it: the request is dropped from every stream


TERMINAL = frozenset({Verdict.FAILED, Verdict.ABORTED})


class ProtocolError(ValueError):
    """A peer's message breaks the protocol (wrong round, gap or repeat in decision seqs)."""


@dataclass(frozen=True)
class Ruling:
    """One immutable, ordered decision. Every rank applies every decision exactly once, by seq."""

    seq: int  # position in rank 0's decision log: 0, 1, 2, ... with no gap
    stream: Stream | None  # the stream it concerns; None only for ABORTED (every stream)
    rid: str  # request id
    verdict: Verdict  # READY: leave `stream`; FAILED/ABORTED: leave every stream, for good

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError(f"decision seq must be >= 0, got {self.seq}")
        if (self.stream is None) != (self.verdict == Verdict.ABORTED):
            raise ValueError(f"stream is None exactly when the verdict is ABORTED, got {self.stream} {self.verdict!r}")

    @property
    def is_terminal(self) -> bool:
        return self.verdict in TERMINAL


@dataclass(frozen=True)
class Report:
    """What one rank contributed to one round: its own READY and FAILED rids, per stream."""

    round_id: int  # the round (rank 0 numbers them 0, 1, 2, ...)
    rank: int  # the reporting rank, in [0, pp_size)
    ready: tuple[frozenset[str], ...]  # indexed by Stream: rids READY on this rank
    failed: tuple[frozenset[str], ...]  # indexed by Stream: rids FAILED on this rank
