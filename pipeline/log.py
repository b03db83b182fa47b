"""Messages rank 0 sends down the pipeline: JSON, never pickle.

A message carries the decisions made since the previous message (applied by every rank
exactly once, in order) and, for a step, the batch description that the hidden states
sent right after it belong to.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import asdict, dataclass

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.batch import ForwardBatch
from kvbridge.kv_transfer.handoff import Destination, Registration
from kvbridge.pipeline import codec

ADMIT, ROUTE, FINISH, ABORT = "admit", "route", "finish", "abort"
RETRACT, RESUME = "retract", "resume"  # decode: a request's KV to host memory and back (info: Pages)
REUSE = "reuse"  # the request starts from these pages of the prefix cache (info: Pages), not computed
# the request's next tokens, for the last rank's sampling state (info: Appended): a decode node's
# first token (the prefill node sampled it), when the params need the request's tokens
APPEND = "append"
# the node's role changes here (info: Switched; rid ""): every rank swaps its part of the hand-off at
# this point of the log, with nothing live (pipeline/elastic.py)
SWITCH = "switch"
KINDS = (ADMIT, ROUTE, FINISH, ABORT, RETRACT, RESUME, REUSE, APPEND, SWITCH)
ENDS = (FINISH, ABORT)  # the request is gone after these
STEP, CONTROL, SHUTDOWN = "step", "control", "shutdown"


@dataclass(frozen=True)
class Admitted:
    """ADMIT's record: what every rank learns of a new request beyond its params."""

    first_sample_index: int = 0  # the output index its sampling starts at (a continuation, a decode node's)
    prompt: tuple[int, ...] = ()  # its tokens, when the last rank's sampling needs them (penalties, grammars)
    resumed: int = 0  # the last `resumed` prompt tokens are outputs an earlier attempt streamed
    destination: Destination | None = None  # decode node: where its KV lands
    trace: str = ""  # its trace context (W3C traceparent; common/tracing.py): every rank's spans go under it


@dataclass(frozen=True)
class Pages:
    """REUSE, RETRACT and RESUME's record: the request's pages."""

    pages: tuple[int, ...]


@dataclass(frozen=True)
class Appended:
    """APPEND's record: the request's next tokens."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Switched:
    """SWITCH's record: the role the node has from here on, and how many switches it made."""

    role: str  # "colocated" | "prefill" | "decode"
    epoch: int


Record = Admitted | Registration | Pages | Appended | Switched
# each kind's record (pipeline/codec.py checks every field of one that arrives); FINISH, ABORT: none
RECORDS = {
    ADMIT: Admitted,
    ROUTE: Registration,
    RETRACT: Pages,
    RESUME: Pages,
    REUSE: Pages,
    APPEND: Appended,
    SWITCH: Switched,
}


@dataclass(frozen=True)
class LogEntry:
    seq: int  # position in the node's decision log, from 0, contiguous
    kind: str  # ADMIT (the request exists; carries its sampling params) | ROUTE (where its KV goes) | FINISH | ABORT
    # | RETRACT / RESUME | REUSE | APPEND | SWITCH
    rid: str  # "" for SWITCH (the node's, not a request's)
    params: SamplingParams | None = None  # ADMIT only: the last rank samples with it
    info: Record | None = None  # the kind's record (RECORDS; ADMIT: always one), FINISH and ABORT: None

    def __post_init__(self) -> None:
        want = RECORDS.get(self.kind)
        if not (isinstance(self.info, want) if want else self.info is None):
            holds = getattr(want, "__name__", "no record")
            raise TypeError(f"{self.kind} entries hold {holds}, got {type(self.info).__name__}")

    def key(self) -> tuple[int, str, str]:
        return (self.seq, self.kind, self.rid)


class PipelineLog:
    """A node's decisions, in order, as one rank applied them: their count, a running digest of all
    of them, and the most recent `keep` (tests compare whole logs; a server must not grow for ever)."""

    def __init__(self, keep: int = 100_000):
        self.count = 0  # decisions applied; the next one must have seq == count
        self.recent: deque[tuple[int, str, str]] = deque(maxlen=keep)  # (seq, kind, rid), oldest first
        self._digest = hashlib.blake2b(digest_size=16)
        self.position = None  # a shared-memory int the rank publishes its count in, for the front's checks

    def append(self, d: LogEntry) -> None:
        if d.seq != self.count:
            raise AssertionError(f"decision {d.seq} arrived, expected {self.count}")
        self.count += 1
        if self.position is not None:
            self.position.value = self.count
        self.recent.append(d.key())
        self._digest.update(f"{d.seq}:{d.kind}:{d.rid};".encode())

    @property
    def digest(self) -> str:
        return self._digest.hexdigest()


@dataclass(frozen=True)
class Message:
    kind: str  # STEP (a batch follows) | CONTROL (decisions only) | SHUTDOWN
    decisions: tuple[LogEntry, ...]
    batch: ForwardBatch | None = None  # STEP only; input_ids are left out (only rank 0 embeds)

    def encode(self) -> bytes:
        b = self.batch
        return json.dumps(
            {
                "kind": self.kind,
                "decisions": [
                    [d.seq, d.kind, d.rid, asdict(d.params) if d.params else None, _info_out(d.info)]
                    for d in self.decisions
                ],
                "batch": None
                if b is None
                else [
                    list(b.rids),
                    list(b.starts),
                    list(b.q_lens),
                    [list(t) for t in b.page_tables],
                    list(b.sample),
                    list(b.scored),
                ],
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(data: bytes) -> Message:
        try:
            raw = json.loads(data)
            entries = [(seq, kind, rid, params, info) for seq, kind, rid, params, info in raw["decisions"]]
            if any(e[1] not in KINDS for e in entries) or raw["kind"] not in (STEP, CONTROL, SHUTDOWN):
                raise ValueError("unknown message or decision kind")
            decisions = tuple(
                LogEntry(int(seq), kind, str(rid), _params(params), _info_in(kind, info))
                for seq, kind, rid, params, info in entries
            )
            batch = None
            if raw["batch"] is not None:
                rids, starts, q_lens, tables, sample, scored = raw["batch"]
                lengths = {len(rids), len(starts), len(q_lens), len(tables), len(sample), len(scored) or len(rids)}
                if len(lengths) > 1:
                    raise ValueError("batch fields of different lengths")
                batch = ForwardBatch(
                    rids=tuple(rids),
                    starts=tuple(starts),
                    q_lens=tuple(q_lens),
                    page_tables=tuple(tuple(t) for t in tables),
                    input_ids=(),
                    sample=tuple(bool(x) for x in sample),
                    scored=tuple(bool(x) for x in scored),
                )
            return Message(raw["kind"], decisions, batch)
        # (json.loads raises RecursionError on deep nesting; int() OverflowError on Infinity)
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
            raise ValueError(f"malformed pipeline message: {e!r}") from None


def _info_out(info) -> dict | None:
    return None if info is None else codec.to_json(info)


def _info_in(kind: str, raw) -> Record | None:
    record = RECORDS.get(kind)
    if record is None:
        if raw is not None:
            raise ValueError(f"a {kind} entry carries no record")
        return None
    return codec.from_json(record, raw)


def _params(raw: dict | None) -> SamplingParams | None:
    if raw is None:
        return None
    raw = dict(
        raw,
        stop=tuple(raw["stop"]),
        stop_token_ids=tuple(raw["stop_token_ids"]),
        allowed_token_ids=tuple(raw["allowed_token_ids"]),
        logit_bias=tuple((int(t), float(b)) for t, b in raw["logit_bias"]),
        bad_words=tuple(raw["bad_words"]),
        bad_words_ids=tuple(tuple(w) for w in raw["bad_words_ids"]),
    )
    return SamplingParams(**raw)
