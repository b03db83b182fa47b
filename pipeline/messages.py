"""What a node's front and its rank 0 say to each other, over the RankGroup's two queues.

    front -> rank 0 (RankGroup.inbox)     Add, Abort, Ask, Shutdown; Register, Revoke (prefill node);
                                       Fail, PeerDown, Revoked (decode node); SetRole (elastic node);
                                       Wake (rank 0's own consensus thread: decisions arrived)
    rank 0 -> front (RankGroup.outbox)    Token, Finish, Answer, CacheEvents; Preallocated,
                                       Quarantined (decode node)

Frozen dataclasses, dispatched by type (`match msg: case Add(): ...`). They cross a local
multiprocessing queue between the front and the rank process it spawned, never a network
socket: what arrives from the network is checked (common/text/prompts.py) before it becomes one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.logits import Logprob
from kvbridge.kv_transfer.handoff import Registration
from kvbridge.kv_transfer.rooms import Source

# ---------------------------------------------------------------- front -> rank 0


@dataclass(frozen=True)
class Pairing:
    """A disaggregated request's half, as the node's service checked it: the room that pairs the
    prefill and decode halves, and on a decode node where the KV comes from."""

    room: int
    peer: str = ""  # decode: the prefill node's address (shown by Admin)
    sources: tuple[Source, ...] = ()  # decode: the prefill node's ranks (each writes the layers it overlaps)
    backend: str = ""  # decode: the transfer engine the pair uses
    secret: bytes = b""  # decode: the room's write key, minted by the decode node; every KV write carries it
    caller: str = ""  # prefill: the host the Prefill call came from (rpc.peer_host)


@dataclass(frozen=True)
class Add:
    """A new request (checked by RankGroup.add_request)."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    pairing: Pairing | None = None  # disaggregated (None: colocated, or a choice i > 0 on a decode node)
    cache_salt: str = ""  # the prefix cache shares pages only between requests with equal salts
    resumed: int = 0  # migration: the last `resumed` prompt ids are outputs an earlier attempt streamed
    fork_of: str = ""  # choice i > 0 of an n > 1 request: the rid of choice 0, whose prompt pages it shares
    trace: str = ""  # its trace context (W3C traceparent of the node's span; common/tracing.py), "" for none


@dataclass(frozen=True)
class Abort:
    rid: str
    reason: str = ""  # an operator's: the error the request ends with (CANCELLED); "" = the client left


@dataclass(frozen=True)
class Ask:
    """A question rank 0 answers between steps with an Answer carrying the same token."""

    what: str  # "status" (Rank0Loop.status) | "requests" (Rank0Loop.list_requests) | "check" (invariants)
    # | "clear_cache" (drop the prefix cache's index: {"pages_dropped": n})
    token: int


@dataclass(frozen=True)
class Shutdown:
    """Abort what is left, stop every rank."""


@dataclass(frozen=True)
class Register:
    """Prefill node: a decode node's registration of a room (its destination pages and layout)."""

    registration: Registration
    token: int  # rank 0 answers with an Answer carrying it: {"code": "" or a gRPC status name, "error"}


@dataclass(frozen=True)
class Revoke:
    """Prefill node: a decode node gave up on `room` (Bootstrap.Revoke, checked). Rank 0 answers with
    an Answer carrying `token` once no rank writes into the room: {"code": "" or "NOT_FOUND", "error"}."""

    room: int
    token: int


@dataclass(frozen=True)
class Fail:
    """Decode node: the front could not finish the request's hand-off (its registration failed)."""

    rid: str
    code: str  # gRPC status code name
    error: str


@dataclass(frozen=True)
class PeerDown:
    """Decode node: a prefill node is unreachable; requests waiting for its KV cannot get it."""

    addr: str


@dataclass(frozen=True)
class Revoked:
    """Decode node: the prefill node revoked `room` on every rank (or knows no such room): nothing of
    it writes into the pages of `rid`, which rest in the quarantine until now."""

    rid: str
    room: int


@dataclass(frozen=True)
class SetRole:
    """An elastic node (pipeline/elastic.py): switch to `role` once nothing is live, within `wait_s`.
    Rank 0 answers with an Answer carrying `token`: {"code": "" or a gRPC status name, "error", "epoch"}."""

    role: str
    token: int
    wait_s: float
    migrate: bool = False  # end the live requests now (UNAVAILABLE: a router resumes them elsewhere)


@dataclass(frozen=True)
class Wake:
    """Consensus decisions arrived: take them now (sent by rank 0's control thread to its own inbox)."""


# ---------------------------------------------------------------- rank 0 -> front


@dataclass(frozen=True)
class Token:
    rid: str
    token: int
    index: int  # its position in the output
    kv_seconds: float = 0.0  # decode node, first token: from registration to the KV landing on every rank
    pages_skipped: int = 0  # decode node, first token: prompt pages its prefix cache held (not moved)
    logprob: Logprob | None = None  # the request asked for logprobs (params.logprobs)


@dataclass(frozen=True)
class PromptLogprobs:
    """The logprobs of prompt tokens first, first + 1, ... (params.prompt_logprobs); before the first Token."""

    rid: str
    first: int
    logprobs: tuple[Logprob, ...]


@dataclass(frozen=True)
class Finish:
    rid: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    output_ids: tuple[int, ...]
    text: str  # the whole output text (stop strings cut off)
    prompt_tokens: int
    error: str = ""  # the request failed (or an operator aborted it): why
    code: str = ""  # and the gRPC status code name to report it with
    kv_bytes: int = 0  # prefill node: KV bytes pushed for it
    timeout: str = ""  # the node timeout that ended it, if one did ("bootstrap", "unregistered", "prealloc", ...)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed here)


@dataclass(frozen=True)
class Answer:
    token: int  # the Ask's
    body: dict  # status: Rank0Loop.status(); requests: {"requests": [...]}; check: {"problems": [...], "log": n}


@dataclass(frozen=True)
class Preallocated:
    """Decode node: every rank expects the room's KV in these pages; the front registers them with P."""

    rid: str
    page_ids: tuple[int, ...]  # the pages the KV is written to: the prompt's after the held ones
    held_pages: int = 0  # the prompt's first pages, found in the prefix cache: not moved


@dataclass(frozen=True)
class Quarantined:
    """Decode node: the hand-off of `rid` failed while its KV may still be landing; its pages rest in
    the quarantine until the prefill node at `peer` revokes `room` (the front asks it: Revoked)."""

    rid: str
    room: int
    peer: str  # the prefill node's address (normalized, as PrefillPeers keys it)


@dataclass(frozen=True)
class CacheEvents:
    """Rank 0's prefix cache changed (engine/prefix_cache.py): (kind, block hashes), in order."""

    events: tuple[tuple[str, tuple[int, ...]], ...]


ToRank0 = Add | Abort | Ask | Shutdown | Register | Revoke | Fail | PeerDown | Revoked | SetRole | Wake
ToFront = Token | PromptLogprobs | Finish | Answer | Preallocated | Quarantined | CacheEvents
