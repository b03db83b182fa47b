"""A running node seen from its services: submit a request, iterate its events.

A dispatcher thread reads the rank-0 event queue of a PPNode and routes each event to the
stream of its request (or to a status waiter). Text is detokenized incrementally here,
holding back what might still turn out to be the start of a stop string.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.pp.node import PPNode
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from kvbridge.metrics import NodeMetrics, outcome_of

_ANSWERS = ("status", "requests", "check")  # rank 0's answers to the front's questions (keyed by token, not rid)


class Overloaded(Exception):
    """The node takes no more requests now (RESOURCE_EXHAUSTED): a router tries another node."""


@dataclass
class Delta:
    token_ids: list[int]  # new tokens
    text: str  # their text, as far as it is final
    finish_reason: str = ""  # set on the last delta
    prompt_tokens: int = 0  # set on the last delta
    completion_tokens: int = 0  # set on the last delta
    error: str = ""  # the request failed (last delta): why
    code: str = ""  # and the gRPC status code name to report it with
    kv_bytes: int = 0  # disaggregated: KV bytes moved for it
    kv_seconds: float = 0.0  # disaggregated, first delta: from registration to the KV landing on every rank


@dataclass
class TextStream:
    """Incremental detokenization of one request's output."""

    tokenizer: Tokenizer | None
    stop: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    sent: str = ""  # text already handed out

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a multibyte character is not complete yet
            return ""
        hold = max((len(s) - 1 for s in self.stop), default=0)
        safe = text[: max(len(self.sent), len(text) - hold)]
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (stop strings already cut off by the engine)."""
        rest = final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return rest


class NodeFront:
    def __init__(self, node: PPNode):
        self.node = node
        self.tokenizer = node.model.tokenizer
        self._streams: dict[str, queue.Queue] = {}
        self._status: dict[int, queue.Queue] = {}  # token -> waiter of a status / requests answer
        self._timing: dict[str, list] = {}  # rid -> [submitted, first token seen] (perf_counter)
        self.metrics: NodeMetrics | None = None  # set by the server: counted on the dispatch thread
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        # other events from rank 0, by kind (e.g. a decode node's "preallocated"): called on the dispatch
        # thread, so they must not block
        self.handlers: dict[str, Callable[[dict], None]] = {}
        self._thread = threading.Thread(target=self._dispatch, name="kvbridge-dispatch", daemon=True)
        self._thread.start()

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, rid: str, extra: dict | None = None
    ) -> Iterator[Delta]:
        """Start a request; iterate its deltas (the last has finish_reason). Raises ValueError on bad
        input, Overloaded when the node holds max_pending_requests already."""
        events: queue.Queue = queue.Queue()
        limit = self.node.config.max_pending_requests
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"duplicate request id {rid!r}")
            if len(self._streams) >= limit:
                raise Overloaded(f"the node holds {len(self._streams)} requests, its limit (--max-pending-requests)")
            self._streams[rid] = events
            self._timing[rid] = [time.perf_counter(), None]
        try:
            self.node.add_request(prompt_ids, params, rid, extra)
        except ValueError:
            with self._lock:
                del self._streams[rid]
                del self._timing[rid]
            raise
        return self._deltas(rid, events, TextStream(self.tokenizer, params.stop), len(prompt_ids))

    def _deltas(self, rid: str, events: queue.Queue, text: TextStream, prompt_tokens: int) -> Iterator[Delta]:
        try:
            while True:
                ev = events.get()
                if ev is None:
                    raise RuntimeError("the node stopped")
                if ev["event"] == "token":
                    yield Delta([ev["token"]], text.push(ev["token"]), kv_seconds=ev.get("kv_seconds", 0.0))
                else:
                    yield Delta(
                        [],
                        text.finish(ev["text"]),
                        ev["finish_reason"],
                        prompt_tokens,
                        len(ev["output_ids"]),
                        error=ev.get("error", ""),
                        code=ev.get("code", ""),
                        kv_bytes=ev.get("kv_bytes", 0),
                    )
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)

    def abort(self, rid: str, reason: str = "", source: str = "client") -> bool:
        """End a request in whatever phase; `reason` (when given) is the error its stream ends with.
        False when the request is not (or no longer) here."""
        with self._lock:
            live = rid in self._streams
        if live:
            self.node.abort(rid, reason)
            if self.metrics is not None:
                self.metrics.aborts.labels(source).inc()
        return live

    def status(self, timeout: float = 5.0) -> dict:
        """Rank 0's counters and queues (see Leader.status); raises queue.Empty if it does not answer."""
        return self._ask("status", timeout)

    def requests(self, timeout: float = 5.0) -> list[dict]:
        """Every request rank 0 holds (see Leader.list_requests)."""
        return self._ask("requests", timeout)["requests"]

    def _ask(self, op: str, timeout: float) -> dict:
        token = next(self._tokens)
        waiter: queue.Queue = queue.Queue()
        with self._lock:
            self._status[token] = waiter
        self.node.inbox.put((op, token))
        try:
            return waiter.get(timeout=timeout)
        finally:
            with self._lock:
                self._status.pop(token, None)

    def check(self, timeout: float = 5.0) -> dict:
        """Rank 0's invariant check: {"problems": [...], "log": decisions made so far}."""
        return self._ask("check", timeout)

    def fail_all(self, error: str, code: str = "UNAVAILABLE") -> int:
        """End every open stream with `error` (the node cannot finish them: a rank died). Returns how many."""
        with self._lock:
            streams = list(self._streams.items())
        for rid, q in streams:
            q.put({"event": "finish", "rid": rid, "finish_reason": "error", "output_ids": [], "text": "",
                   "error": error, "code": code})  # fmt: skip
            self._count_finish(rid, "error", 0, 0)
        return len(streams)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for q in self._streams.values():
                q.put(None)

    def _count_finish(self, rid: str, outcome: str, prompt_tokens: int, output_tokens: int) -> None:
        self.node.forget(rid)
        with self._lock:
            timing = self._timing.pop(rid, None)
        if self.metrics is None or timing is None:
            return
        m = self.metrics
        m.requests.labels(outcome).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(output_tokens)
        m.e2e.observe(time.perf_counter() - timing[0])

    def _dispatch(self) -> None:
        while not self._closed:
            try:
                ev = self.node.outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            kind = ev["event"]
            handler = self.handlers.get(kind)
            if handler is not None:
                handler(ev)
                continue
            with self._lock:
                target = self._status.get(ev["token"]) if kind in _ANSWERS else self._streams.get(ev["rid"])
                timing = self._timing.get(ev["rid"])
            if kind == "token" and timing is not None and timing[1] is None:
                timing[1] = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.ttft.observe(timing[1] - timing[0])
            elif kind == "finish":
                if ev.get("timeout") and self.metrics is not None:
                    self.metrics.timeouts.labels(ev["timeout"]).inc()
                outcome = outcome_of(ev["finish_reason"], ev.get("error", ""))
                self._count_finish(ev["rid"], outcome, ev.get("prompt_tokens", 0), len(ev["output_ids"]))
            if target is not None:
                target.put(ev)
