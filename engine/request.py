"""A generation request, its sampling parameters, where it is (`Phase`) and, when it is served
disaggregated, its hand-off (`Handoff`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.pages import PageTable

if TYPE_CHECKING:
    from kvbridge.common.text.detok import StopChecker
    from kvbridge.engine.grammar import Matcher
    from kvbridge.engine.logits import Controls


class Phase(str, Enum):
    """Where a live request is on its node; one value per queue that can hold it. The value is what
    operators see (Admin.ListRequests, `event=phase` log lines)."""

    WAITING = "waiting"  # in the scheduler's queue, no pages yet (or preempted: to be recomputed)
    PREFILLING = "prefilling"  # running: prompt chunks left
    DECODING = "decoding"  # running: one token per step
    BOOTSTRAP = "bootstrap"  # prefill node: first token out, the decode node's registration not yet in
    TRANSFERRING = "transferring"  # prefill: pages wait for every rank's pushes; decode: for the KV to land
    PREALLOC = "prealloc"  # decode node: waiting for pages for its prompt and a reserve
    RETRACTED = "retracted"  # decode node: its KV in host memory, waiting for pages
    RESUMING = "resuming"  # decode node: new pages given, its KV being copied back on every rank


@dataclass
class Handoff:
    """A disaggregated request's hand-off between its prefill and decode nodes."""

    room: int  # the key pairing its prefill and decode halves
    peer: str = ""  # the other node's address (shown by Admin)
    sources: tuple = ()  # decode: the prefill ranks that write its KV (kv_transfer Sources; opaque here)
    backend: str = ""  # decode: the transfer backend the pair uses
    secret: bytes = b""  # decode: the room's write key; every KV write carries it
    routed: bool = False  # prefill: the decode node's registration arrived (a ROUTE decision went out)
    transferred: bool = False  # prefill: consensus agreed every push landed (may come before the first token)
    deadline: float = float("inf")  # perf_counter time at which the phase it waits in times out
    timeout: str = ""  # which timeout that is: "bootstrap" | "unregistered" | "prealloc" | "transfer"
    preallocated_s: float = 0.0  # decode: when every rank expected its pages (for kv_seconds)
    held_pages: int = 0  # decode: the prompt's first pages, found in its prefix cache (not moved)
    caller: str = ""  # prefill: the host its Prefill call came from (rpc.peer_host; bounds what one caller holds)
    # what the hand-off moved, once known (Admin's listing, the logs, the trace): pages and their bytes
    # over every layer, and on a prefill node the hand-off's time after prefill (routed and prompt
    # computed, to every rank's pushes landing)
    kv_pages: int = 0
    kv_bytes: int = 0
    awaiting_s: float = 0.0  # prefill: when it began to wait for its pushes (perf_counter)
    handoff_s: float = 0.0

    def figures(self) -> dict:
        """What its hand-off moved, as Admin lists it (RequestInfo) and the logs and spans show it."""
        moved = {"backend": self.backend, "kv_pages_moved": self.kv_pages, "kv_bytes_moved": self.kv_bytes}
        return moved | {"handoff_s": round(self.handoff_s, 6)}

    def expires(self, now: float, after_s: float, timeout: str) -> None:
        self.deadline, self.timeout = now + after_s, timeout

    def no_deadline(self) -> None:
        self.deadline, self.timeout = float("inf"), ""


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    page_table: PageTable
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache, or scheduled into it by a batch in flight
    awaiting_output: bool = False  # a batch in flight samples this request's next token
    announced: bool = False  # its ADMIT decision went down the pipeline (PP)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str = ""  # detokenized output, set when the request finishes
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    seed: int = 0  # the sampling seed: params.seed, or a random one drawn at creation
    num_sampled: int = 0  # tokens sampled for this request so far (where sampling starts: see sampler.py)
    phase: Phase | None = None  # None until its role places it; then set by whoever moves it (Rank0Loop.move)
    handoff: Handoff | None = None  # disaggregated serving only
    stop_checker: StopChecker | None = None  # rank 0, with stop strings: the text so far (Scheduler.stop_reason)
    cache_salt: str = ""  # the prefix cache shares pages only between requests with equal salts
    block_hashes: list[int] = field(default_factory=list)  # of its full blocks so far (common/blocks.py)
    cached_tokens: int = 0  # prompt tokens its latest admission found in the prefix cache
    indexed_pages: int = 0  # its first pages the prefix cache knows (found there, or indexed since)
    # a migrated request's continuation: the last `resumed` prompt ids are output tokens an earlier
    # attempt streamed to the client; they are computed as prompt and count as outputs (num_outputs)
    resumed: int = 0
    grammar: Matcher | None = None  # structured output: at the sampling rank, the grammar's state
    controls: Controls | None = None  # at the sampling rank: its masks, built on its first step there
    logprobs: list = field(default_factory=list)  # engine/llm.py: its outputs' engine.logits.Logprob
    prompt_logprobs: list = field(default_factory=list)  # engine/llm.py: its prompt tokens' (from the second)
    # choice i > 0 of an n > 1 request: choice 0, whose full prompt pages it starts from (Scheduler._fork)
    parent: Request | None = None
    trace: str = ""  # its trace context (W3C traceparent), "" when none: spans are recorded under it
    phase_ns: int = 0  # time.time_ns() when it entered its phase (the phase's span starts there)
    prompt_logprobs_next: int = 1  # rank 0: the prompt token whose logprobs go out next (a recompute repeats some)

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.num_sampled = self.resumed  # (sampling continues at the token index the earlier attempt reached)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_outputs(self) -> int:
        """Output tokens so far, an earlier attempt's (resumed) included: what max_new_tokens and
        min_tokens count."""
        return self.resumed + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """The client's prompt, without the resumed outputs."""
        return len(self.prompt_ids) - self.resumed

    @property
    def resumed_ids(self) -> list[int]:
        return self.prompt_ids[len(self.prompt_ids) - self.resumed :]

    @property
    def num_pending(self) -> int:
        """Known tokens whose K/V is not cached yet: the next forward's input length, at most."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return bool(self.output_ids) and self.num_pending == 1 and not self.awaiting_output

    @property
    def has_prompt_left(self) -> bool:
        """Tokens to prefill (a prompt, or prompt + output after a preemption) beyond the last one."""
        return self.num_pending > 1 or (self.num_pending == 1 and not self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
