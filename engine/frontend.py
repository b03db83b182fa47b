"""A running node seen from its services: submit a request, iterate its events.

A dispatcher thread reads the rank-0 event queue of a PPNode and routes each event to the
stream of its request (or to a status waiter). Text is detokenized incrementally here,
holding back what might still turn out to be the start of a stop string.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.pp.node import PPNode
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer


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
        self._status: dict[int, queue.Queue] = {}
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
        """Start a request; iterate its deltas (the last has finish_reason). Raises ValueError on bad input."""
        events: queue.Queue = queue.Queue()
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"duplicate request id {rid!r}")
            self._streams[rid] = events
        try:
            self.node.add_request(prompt_ids, params, rid, extra)
        except ValueError:
            with self._lock:
                del self._streams[rid]
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
                    yield Delta([], text.finish(ev["text"]), ev["finish_reason"], prompt_tokens, len(ev["output_ids"]))
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)

    def abort(self, rid: str) -> None:
        with self._lock:
            live = rid in self._streams
        if live:
            self.node.abort(rid)

    def status(self, timeout: float = 5.0) -> dict:
        token = next(self._tokens)
        waiter: queue.Queue = queue.Queue()
        with self._lock:
            self._status[token] = waiter
        self.node.inbox.put(("status", token))
        try:
            return waiter.get(timeout=timeout)
        finally:
            with self._lock:
                self._status.pop(token, None)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for q in self._streams.values():
                q.put(None)

    def _dispatch(self) -> None:
        while not self._closed:
            try:
                ev = self.node.outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            handler = self.handlers.get(ev["event"])
            if handler is not None:
                handler(ev)
                continue
            with self._lock:
                target = self._status.get(ev["token"]) if ev["event"] == "status" else self._streams.get(ev["rid"])
            if target is not None:
                target.put(ev)
