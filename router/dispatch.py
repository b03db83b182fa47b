"""One client request's upstream calls.

Colocated: the least loaded healthy colocated node streams the whole request.
Disaggregated: a decode node D and a prefill node P are picked independently; the router makes a
random 63-bit room, then at once opens D.Generate (a stream, with PrefillRoute{room, P's address})
and P.Prefill{rid, room, prompt, sampling} (a future). D's responses go to the client. If P fails,
D's stream is cancelled and the client gets P's status; if D fails, P is cancelled. A decode node
competes with the colocated nodes for each request (least outstanding wins), and is eligible only
while some prefill node is.

A node that answers UNAVAILABLE before the client got any response is skipped and the request
tried again elsewhere (nothing was produced, so nothing is repeated). Cancelling a Routed
(client gone) cancels every upstream call it has open; the nodes then abort the request.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Iterator

import grpc

from kvbridge.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from router.pool import Node, NodePool

GENERATION_ROLES = ("colocated", "decode")


class RouteError(Exception):
    """The request failed; `code` and `message` are what the client is told."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class _Retry(Exception):
    def __init__(self, nodes: list[Node], error: RouteError):
        super().__init__(error.message)
        self.nodes, self.error = nodes, error


class Dispatcher:
    def __init__(self, pool: NodePool, request_timeout_s: float):
        self.pool = pool
        self.request_timeout_s = request_timeout_s
        self.requests_served = 0  # requests that ended here, any outcome
        self.started_at = time.time()  # wall clock, for `created` fields
        self._lock = threading.Lock()

    def can_route(self) -> bool:
        """Some request could be served now: a healthy colocated node, or healthy P and D nodes."""
        return self.pool.has_eligible("colocated") or (
            self.pool.has_eligible("prefill") and self.pool.has_eligible("decode")
        )

    def route(self, request: generation_pb2.GenerateRequest, timeout_s: float | None = None) -> Routed:
        """Start routing a (checked) request; iterate the result for its responses. The deadline of
        every upstream call is now + min(timeout_s, request_timeout_s)."""
        req = generation_pb2.GenerateRequest()
        req.CopyFrom(request)
        req.rid = req.rid or uuid.uuid4().hex
        budget = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
        return Routed(self, req, time.monotonic() + budget)

    def _served(self) -> None:
        with self._lock:
            self.requests_served += 1


class Routed:
    """A routed request: iterate GenerateResponses (RouteError on failure); cancel() from any thread."""

    def __init__(self, dispatcher: Dispatcher, request: generation_pb2.GenerateRequest, deadline: float):
        self.dispatcher, self.pool = dispatcher, dispatcher.pool
        self.request = request  # rid set; prefill unset
        self.deadline = deadline  # time.monotonic() by which every upstream call ends
        self.rid = request.rid
        self.sent = 0  # responses handed to the client so far
        self.cancelled = threading.Event()
        self._calls: list[grpc.Future] = []  # open upstream calls, cancelled by cancel()
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[generation_pb2.GenerateResponse]:
        excluded: list[Node] = []
        try:
            while True:
                try:
                    yield from self._attempt(excluded)
                    return
                except _Retry as retry:
                    excluded += retry.nodes
        finally:
            self.dispatcher._served()

    def cancel(self) -> None:
        self.cancelled.set()
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    # ------------------------------------------------------------------ internals

    def _attempt(self, excluded: list[Node]) -> Iterator[generation_pb2.GenerateResponse]:
        if self.cancelled.is_set():
            raise RouteError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        timeout = self._remaining()
        roles = GENERATION_ROLES if self.pool.has_eligible("prefill", excluded) else ("colocated",)
        node = self.pool.acquire(roles, excluded)
        if node is None:
            raise self._none_left(excluded)
        if node.role == "colocated":
            yield from self._colocated(node, timeout)
            return
        prefill = self.pool.acquire(("prefill",), excluded)
        if prefill is None:  # the last prefill node turned unhealthy just now
            self.pool.release(node)
            raise self._none_left(excluded)
        yield from self._disaggregated(prefill, node, timeout)

    def _none_left(self, excluded: list[Node]) -> RouteError:
        if excluded:
            tried = ", ".join(n.key for n in excluded)
            return RouteError(grpc.StatusCode.UNAVAILABLE, f"no healthy node left to try (unavailable: {tried})")
        return RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy node can serve the request")

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return left

    def _open(self, call):
        """Register an upstream call so that cancel() reaches it (at once, if cancel came first)."""
        with self._lock:
            self._calls.append(call)
        if self.cancelled.is_set():
            call.cancel()
        return call

    def _colocated(self, node: Node, timeout: float) -> Iterator[generation_pb2.GenerateResponse]:
        """The node's stream, passed through. The caller acquired `node`; it is released here."""
        done = False
        try:
            stream = self._open(
                generation_pb2_grpc.GenerationStub(node.channel).Generate(self.request, timeout=timeout)
            )
            try:
                for resp in stream:
                    self.sent += 1
                    yield resp
                done = True
            except grpc.RpcError as e:
                raise self._upstream_error(e, [node]) from None
            finally:
                if not done:  # an error, or the consumer closed this generator: no-op on a finished call
                    stream.cancel()
        finally:
            self.pool.release(node)

    def _disaggregated(self, p: Node, d: Node, timeout: float) -> Iterator[generation_pb2.GenerateResponse]:
        """D's stream, passed through, with P's Prefill running beside it. The caller acquired both;
        D is released when its stream ends, P when its Prefill call returns."""
        room = secrets.randbits(63)
        dreq = generation_pb2.GenerateRequest()
        dreq.CopyFrom(self.request)
        dreq.prefill.room, dreq.prefill.prefill_addr = room, p.address
        preq = prefill_pb2.PrefillRequest(
            rid=self.rid, room=room, prompt=self.request.prompt, sampling=self.request.sampling
        )
        p_failed: list[grpc.RpcError] = []  # P's error, recorded before D's stream is cancelled for it
        done = False
        try:
            stream = self._open(generation_pb2_grpc.GenerationStub(d.channel).Generate(dreq, timeout=timeout))
            try:
                p_call = self._open(prefill_pb2_grpc.PrefillStub(p.channel).Prefill.future(preq, timeout=timeout))
            except BaseException:
                stream.cancel()
                self.pool.release(p)
                raise

            def prefill_done(f: grpc.Future) -> None:
                self.pool.release(p)
                if not f.cancelled() and f.exception() is not None:
                    p_failed.append(f.exception())
                    stream.cancel()

            p_call.add_done_callback(prefill_done)
            try:
                for resp in stream:
                    self.sent += 1
                    yield resp
                done = True  # P may still be finishing (its pushes settle after D has the KV): let it
            except grpc.RpcError as e:
                if p_failed:
                    raise self._upstream_error(p_failed[0], [p]) from None
                raise self._upstream_error(e, [d]) from None
            finally:
                if not done:
                    stream.cancel()
                    p_call.cancel()
        finally:
            self.pool.release(d)

    def _upstream_error(self, e: grpc.RpcError, nodes: list[Node]) -> Exception:
        code, details = e.code(), e.details() or ""
        if self.cancelled.is_set():
            return RouteError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        where = ", ".join(n.key for n in nodes)
        error = RouteError(code, f"{details} (from {where})")
        if code == grpc.StatusCode.UNAVAILABLE and self.sent == 0:
            return _Retry(nodes, error)
        return error
