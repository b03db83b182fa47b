"""One client request's upstream calls.

Colocated: the least loaded healthy colocated node streams the whole request.
Disaggregated: a decode node D and a prefill node P are picked independently; the router makes a
random 63-bit room, then at once opens D.Generate (a stream, with PrefillRoute{room, P's address})
and P.Prefill{rid, room, prompt, sampling} (a future). D's responses go to the client. If P fails
before D's first response, D's stream is cancelled and the client gets P's status; later, D holds
the whole KV already, so P's failure does not touch the stream (P's call outlives D's first token:
it returns once P's pushes settle). If D fails, P is cancelled. A decode node competes with the
colocated nodes for each request (least outstanding wins), and is eligible only while some prefill
node is.

Retries. An attempt that fails before any response reached the client is tried again on another
node (pair) when another node may do better: UNAVAILABLE (down, draining, lost a rank),
RESOURCE_EXHAUSTED (full), DEADLINE_EXCEEDED from a node's own timeout (bootstrap, prealloc,
transfer; not the request's own deadline), or no first token within first_token_timeout_s. The node
that failed is left out of the request's later attempts; but P's own timeouts leave out D (P waited
on D: for its registration, or for its pages to take the KV), and a first-token timeout leaves out
P while its Prefill call runs, else D. Each attempt has a fresh room and, after the first, a fresh
upstream rid, `RID:retryN` (the nodes may still be dropping the attempt before). At most
max_attempts attempts; the n-th retry waits retry_backoff_s * 2**(n-1), at most
RETRY_BACKOFF_CAP_S. When the attempts are used up or no node is left, the client gets the last
failure's status and message (RESOURCE_EXHAUSTED stays RESOURCE_EXHAUSTED: clients back off on it).
Once a response reached the client nothing is retried (tokens would repeat): a failure ends the
stream with the upstream status. Retries are counted in kvbridge_router_retries_total{reason}.

Timeouts, watched by one thread for every request (router/watchdog.py): an attempt with no first
token within first_token_timeout_s of its start is cancelled (retried as above, else the client
gets DEADLINE_EXCEEDED); after the first token, a node that sends nothing for idle_stream_timeout_s
ends the request (DEADLINE_EXCEEDED "no token for N s"). Only time spent waiting for the node
counts, not time spent handing responses to a slow client. Both are counted in
kvbridge_router_timeouts_total{timeout}.

Liveness: how soon the requests on a node that dies end (retried, or failed if a token was sent).
- The node's process dies (crash, kill -9) on a host that stays up: the kernel closes its sockets,
  gRPC fails every call open on it with UNAVAILABLE at once, and its health watch fails (the pool
  routes nothing new to it). Bound: under 1 s (tests/test_failover.py measures it).
- The host vanishes without closing anything: gRPC keepalive (kvbridge/rpc.py: a ping after 10 s
  without traffic, 5 s for its answer) may fail the calls, but gRPC spaces its pings out on a
  connection the router sends nothing on (a minute apart after the first two), so the bound is the
  timeouts above: no request waits on a silent node longer than first_token_timeout_s per attempt
  (before its first token) or idle_stream_timeout_s (after).

Cancelling a Routed (client gone, or an operator's Admin.AbortRequest) cancels every upstream call
it has open; the nodes then abort the request, and the client is told CANCELLED with who cancelled
it. The dispatcher holds every request in flight by rid, from its first step to its end, for
Admin.ListRequests / AbortRequest and Drain (while draining, a new request ends at once with
UNAVAILABLE). Each phase change is one log line (`event=phase` with phase routed, first_token,
timeout, retry, finished or failed) and feeds the router's metrics (router/metrics.py).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Collection, Iterator

import grpc

from kvbridge.logs import log_event
from kvbridge.metrics import outcome_of
from kvbridge.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from router.config import RouterConfig
from router.metrics import Recorder
from router.pool import Node, NodePool
from router.watchdog import Watchdog

GENERATION_ROLES = ("colocated", "decode")
PHASES = ("routing", "colocated", "prefill+decode")  # a Routed's phase: no node yet, then how it is served
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
RETRY_BACKOFF_CAP_S = 1.0  # the longest pause between two attempts
CLIENT_CANCELLED = "the client cancelled the request"
OPERATOR_ABORTED = "an operator aborted the request (Admin.AbortRequest on the router)"
ROUTER_STOPPING = "the router is stopping"
DRAINING = "the router is draining"
log = logging.getLogger("kvbridge.router")


class RouteError(Exception):
    """The request failed; `code` and `message` are what the client is told."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class _Retry(Exception):
    """An attempt failed before any response reached the client, in a way other nodes may not."""

    def __init__(self, nodes: list[Node], error: RouteError):
        super().__init__(error.message)
        self.nodes, self.error = nodes, error  # the nodes to leave out from now on; what the client gets if last


class _TimedOut(Exception):
    """The watchdog cancelled the attempt (Routed._timed_out says which timeout)."""


class Dispatcher:
    """Routes requests over the pool and keeps every request in flight, by rid, from its first
    step to its end (any outcome); while draining it admits none."""

    def __init__(self, pool: NodePool, config: RouterConfig):
        self.pool = pool
        self.config = config
        self.requests_served = 0  # requests that ended here, any outcome
        self.draining = False  # new requests are refused with UNAVAILABLE; those in flight finish
        self.started_at = time.time()  # wall clock, for `created` fields
        self.metrics = Recorder(pool, lambda: self.draining, self.num_in_flight)
        self.watchdog = Watchdog()  # the timeouts of every request in flight
        self._routed: dict[str, Routed] = {}  # rid -> the request in flight
        self._lock = threading.Lock()
        self._ended_one = threading.Condition(self._lock)

    def can_route(self, exclude: Collection[Node] = ()) -> bool:
        """Some request could be served now (by nodes not in `exclude`): a healthy colocated node,
        or healthy P and D nodes."""
        return self.pool.has_eligible("colocated", exclude) or (
            self.pool.has_eligible("prefill", exclude) and self.pool.has_eligible("decode", exclude)
        )

    def accepting(self) -> bool:
        """A new request would be routed now: not draining, and some node could serve it."""
        return not self.draining and self.can_route()

    def route(self, request: generation_pb2.GenerateRequest, timeout_s: float | None = None) -> Routed:
        """Start routing a (checked) request; iterate the result for its responses. The deadline of
        every upstream call is now + min(timeout_s, request_timeout_s)."""
        req = generation_pb2.GenerateRequest()
        req.CopyFrom(request)
        req.rid = req.rid or uuid.uuid4().hex
        limit = self.config.request_timeout_s
        budget = limit if timeout_s is None else min(timeout_s, limit)
        return Routed(self, req, time.monotonic() + budget)

    def close(self) -> None:
        self.watchdog.stop()

    # ------------------------------------------------------------------ requests in flight

    def in_flight(self) -> list[Routed]:
        """The requests in flight, oldest first."""
        with self._lock:
            return sorted(self._routed.values(), key=lambda r: r.received)

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._routed)

    def find(self, rid: str) -> Routed | None:
        with self._lock:
            return self._routed.get(rid)

    def set_draining(self, draining: bool) -> None:
        with self._lock:
            self.draining = draining

    def wait_idle(self, timeout: float) -> int:
        """Block until no request is in flight, at most `timeout` seconds; returns how many are left."""
        with self._lock:
            self._ended_one.wait_for(lambda: not self._routed, timeout)
            return len(self._routed)

    def cancel_all(self, why: str) -> None:
        for routed in self.in_flight():
            routed.cancel(why)

    def _admit(self, routed: Routed) -> None:
        with self._lock:
            if self.draining:
                raise RouteError(grpc.StatusCode.UNAVAILABLE, DRAINING)
            if routed.rid in self._routed:
                raise RouteError(grpc.StatusCode.ALREADY_EXISTS, f"a request with rid {routed.rid!r} is in flight")
            self._routed[routed.rid] = routed

    def _ended(self, routed: Routed, outcome: str) -> None:
        with self._lock:
            if self._routed.get(routed.rid) is routed:
                del self._routed[routed.rid]
            self.requests_served += 1
            self._ended_one.notify_all()
        self.metrics.ended(outcome, time.monotonic() - routed.received)


class Routed:
    """A routed request: iterate GenerateResponses (RouteError on failure); cancel() from any thread.
    Its phase, room, peer and token counts are read by Admin.ListRequests while it runs."""

    def __init__(self, dispatcher: Dispatcher, request: generation_pb2.GenerateRequest, deadline: float):
        self.dispatcher, self.pool, self.config = dispatcher, dispatcher.pool, dispatcher.config
        self.request = request  # rid set; prefill unset
        self.deadline = deadline  # time.monotonic() by which every upstream call ends
        self.rid = request.rid
        self.received = time.monotonic()  # when the router got it
        self.phase = "routing"  # one of PHASES
        self.room = 0  # the current attempt's room (disaggregated), else 0
        self.peer = ""  # the nodes serving it: "P_ADDR -> D_ADDR", or the colocated node's address
        self.attempts = 0  # attempts started so far
        self.prompt_tokens = len(request.prompt.token_ids.ids)  # 0 until known (text, chat: the last usage)
        self.output_tokens = 0  # token ids handed to the client so far
        self.sent = 0  # responses handed to the client so far
        self.finish_reason = ""  # of the last response, once it came
        self.cancelled = threading.Event()
        self.why = ""  # the reason of the first cancel(): what the client is told
        self._last_token_at: float | None = None  # time.monotonic() of the last token-bearing response
        self._calls: list[grpc.Future] = []  # the current attempt's upstream calls, cancelled by cancel()
        self._waiting_since: float | None = None  # since when the attempt waits for its node's next response
        self._timed_out = ""  # the timeout that cancelled the current attempt: "first_token" | "idle_stream"
        self._poll_s = 0.0  # the watchdog looks at least this often (the shorter timeout)
        self._last_error: RouteError | None = None  # the failure of the last attempt
        self._ended = False
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[generation_pb2.GenerateResponse]:
        outcome = "error"
        try:
            self.dispatcher._admit(self)
            self._start_watching()
            excluded: list[Node] = []
            while True:
                try:
                    yield from self._attempt(excluded)
                    break
                except _Retry as retry:
                    excluded += retry.nodes
                    self._pause_before_retry(retry, excluded)
            outcome = outcome_of(self.finish_reason)
            self._log("finished", outcome=outcome, tokens=self.output_tokens, seconds=self.age_s())
        except RouteError as e:
            outcome = "abort" if e.code == grpc.StatusCode.CANCELLED and self.cancelled.is_set() else "error"
            self._log("failed", outcome=outcome, code=e.code.name, message=e.message, seconds=self.age_s())
            raise
        except GeneratorExit:  # the consumer stopped reading: the client is gone
            self.cancel()  # (a no-op if it was cancelled already; the first reason stays)
            outcome = "abort"
            self._log("failed", outcome=outcome, code="CANCELLED", message=self.why, seconds=self.age_s())
            raise
        finally:
            with self._lock:
                self._ended = True  # the watchdog drops it
            self.dispatcher._ended(self, outcome)

    def cancel(self, why: str = CLIENT_CANCELLED) -> None:
        """End the request: every upstream call it has open is cancelled (the nodes abort it) and
        the client is told CANCELLED with `why`; the first reason given is the one kept."""
        with self._lock:
            if not self.cancelled.is_set():
                self.why = why
                self.cancelled.set()
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def age_s(self) -> float:
        return time.monotonic() - self.received

    # ------------------------------------------------------------------ attempts

    def _attempt(self, excluded: list[Node]) -> Iterator[generation_pb2.GenerateResponse]:
        self.phase, self.room, self.peer = "routing", 0, ""
        if self.cancelled.is_set():
            raise RouteError(grpc.StatusCode.CANCELLED, self.why)
        timeout = self._remaining()
        roles = GENERATION_ROLES if self.pool.has_eligible("prefill", excluded) else ("colocated",)
        node = self.pool.acquire(roles, excluded)
        if node is None:
            raise self._none_left()
        with self._lock:
            self.attempts += 1
            self._calls, self._timed_out = [], ""
        request = generation_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        if self.attempts > 1:  # the nodes of an earlier attempt may still hold the rid for a moment
            request.rid = f"{self.rid}:retry{self.attempts - 1}"
        if node.role == "colocated":
            self.peer, self.phase = node.address, "colocated"  # the phase last: ListRequests reads them unlocked
            self._log("routed", colocated=node.address)
            yield from self._colocated(node, request, timeout)
            return
        prefill = self.pool.acquire(("prefill",), excluded)
        if prefill is None:  # the last prefill node turned unhealthy just now
            self.pool.release(node)
            raise self._none_left()
        self.room, self.peer = secrets.randbits(63), f"{prefill.address} -> {node.address}"
        self.phase = "prefill+decode"
        self._log("routed", prefill=prefill.address, decode=node.address)
        yield from self._disaggregated(prefill, node, request, timeout)

    def _pause_before_retry(self, retry: _Retry, excluded: list[Node]) -> None:
        """Wait the backoff before the next attempt; raise the failure when there is to be none."""
        self._last_error = retry.error
        if self.attempts >= self.config.max_attempts or not self.dispatcher.can_route(excluded):
            raise retry.error
        backoff = self.config.retry_backoff_s * 2 ** (self.attempts - 1)
        pause = min(backoff, RETRY_BACKOFF_CAP_S, max(0.0, self.deadline - time.monotonic()))
        code = retry.error.code
        self.dispatcher.metrics.retry(code.name.lower())
        self._log("retry", code=code.name, reason=retry.error.message, attempt=self.attempts + 1)
        if self.cancelled.wait(pause):
            raise RouteError(grpc.StatusCode.CANCELLED, self.why)

    def _none_left(self) -> RouteError:
        """No node to try: the last attempt's failure, if there was one."""
        return self._last_error or RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy node can serve the request")

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

    def _colocated(
        self, node: Node, request: generation_pb2.GenerateRequest, timeout: float
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """The node's stream, passed through. The caller acquired `node`; it is released here."""
        done = False
        try:
            stream = self._open(generation_pb2_grpc.GenerationStub(node.channel).Generate(request, timeout=timeout))
            try:
                for resp in self._responses(stream):
                    self._deliver(resp)
                    yield resp
                done = True
            except _TimedOut:
                raise self._timeout_error([node]) from None
            except grpc.RpcError as e:
                raise self._upstream_error(e, [node]) from None
            finally:
                if not done:  # an error, or the consumer closed this generator: no-op on a finished call
                    stream.cancel()
        finally:
            self.pool.release(node)

    def _disaggregated(
        self, p: Node, d: Node, request: generation_pb2.GenerateRequest, timeout: float
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """D's stream, passed through, with P's Prefill running beside it. The caller acquired both;
        D is released when its stream ends, P when its Prefill call returns."""
        dreq = generation_pb2.GenerateRequest()
        dreq.CopyFrom(request)
        dreq.prefill.room, dreq.prefill.prefill_addr = self.room, p.address
        preq = prefill_pb2.PrefillRequest(
            rid=request.rid, room=self.room, prompt=request.prompt, sampling=request.sampling
        )
        answered = threading.Event()  # D sent its first response: it holds the whole KV
        prefilled = threading.Event()  # P's Prefill call returned
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
                if f.cancelled():
                    return
                if f.exception() is None:
                    prefilled.set()
                elif not answered.is_set():  # (once D answered, P's failure cannot touch the stream)
                    p_failed.append(f.exception())
                    stream.cancel()

            p_call.add_done_callback(prefill_done)
            try:
                for resp in self._responses(stream):
                    answered.set()
                    self._deliver(resp)
                    yield resp
                done = True  # P may still be finishing (its pushes settle after D has the KV): let it
            except _TimedOut:
                raise self._timeout_error([d] if prefilled.is_set() else [p]) from None
            except grpc.RpcError as e:
                if p_failed:  # P's own timeouts wait on D (its registration, its pages taking the KV): D's fault
                    waited_on_d = p_failed[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    raise self._upstream_error(p_failed[0], [d] if waited_on_d else [p]) from None
                raise self._upstream_error(e, [d]) from None
            finally:
                if not done:
                    stream.cancel()
                    p_call.cancel()
        finally:
            self.pool.release(d)

    def _responses(self, stream) -> Iterator[generation_pb2.GenerateResponse]:
        """The upstream stream, each wait for its next response watched by the watchdog. Raises
        _TimedOut when a timeout cancelled the attempt (a response that raced it is dropped: the
        attempt fails as a whole)."""
        while True:
            with self._lock:
                self._waiting_since = time.monotonic()
            try:
                resp = next(stream, None)
            except grpc.RpcError:
                if self._stop_waiting():
                    raise _TimedOut() from None
                raise
            if self._stop_waiting():
                raise _TimedOut()
            if resp is None:
                return
            yield resp

    def _stop_waiting(self) -> str:
        """The wait for a response is over; returns the timeout that fired during it ("" if none)."""
        with self._lock:
            self._waiting_since = None
            return self._timed_out

    def _upstream_error(self, e: grpc.RpcError, nodes: list[Node]) -> Exception:
        """What a failed upstream call means for the client: a RouteError, or a _Retry when nothing
        reached the client yet and another node may succeed."""
        code, details = e.code(), e.details() or ""
        if self.cancelled.is_set():
            return RouteError(grpc.StatusCode.CANCELLED, self.why)
        where = ", ".join(n.key for n in nodes)
        error = RouteError(code, f"{details} (from {where})")
        own_deadline = code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= self.deadline
        if code in RETRIED_CODES and self.sent == 0 and not own_deadline:
            return _Retry(nodes, error)
        return error

    def _timeout_error(self, nodes: list[Node]) -> Exception:
        if self.cancelled.is_set():
            return RouteError(grpc.StatusCode.CANCELLED, self.why)
        where = ", ".join(n.key for n in nodes)
        if self._timed_out == "first_token":
            message = f"no first token within {self.config.first_token_timeout_s:g} s (from {where})"
            return _Retry(nodes, RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, message))
        message = f"no token for {self.config.idle_stream_timeout_s:g} s (from {where})"
        return RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, message)

    # ------------------------------------------------------------------ timeouts

    def _start_watching(self) -> None:
        limits = [t for t in (self.config.first_token_timeout_s, self.config.idle_stream_timeout_s) if t > 0]
        if limits:
            self._poll_s = min(limits)
            self.dispatcher.watchdog.schedule(time.monotonic() + self._poll_s, self._check_timeouts)

    def _check_timeouts(self, now: float) -> float | None:
        """The watchdog's look: cancel the attempt if it has waited too long for its node. Returns
        when to look again (None: the request ended)."""
        with self._lock:
            if self._ended:
                return None
            first = self.sent == 0
            limit = self.config.first_token_timeout_s if first else self.config.idle_stream_timeout_s
            since = self._waiting_since
            if since is None or not limit:  # not waiting for the node (or not watched now): look again later
                return now + self._poll_s
            if now < since + limit:
                return since + limit
            kind = self._timed_out = "first_token" if first else "idle_stream"
            self._waiting_since = None
            calls = list(self._calls)
        self.dispatcher.metrics.timed_out(kind)
        self._log("timeout", timeout=kind, seconds=now - since)
        for call in calls:
            call.cancel()
        return now + self._poll_s

    # ------------------------------------------------------------------ accounting

    def _deliver(self, resp: generation_pb2.GenerateResponse) -> None:
        """Account for a response about to be handed to the client: counts, TTFT, token gaps."""
        self.sent += 1
        if resp.finish_reason:
            self.finish_reason = resp.finish_reason
        if resp.HasField("usage"):
            self.prompt_tokens = resp.usage.prompt_tokens
        if not resp.token_ids:
            return
        now = time.monotonic()
        if self._last_token_at is None:
            self.dispatcher.metrics.first_token(now - self.received)
            self._log("first_token", seconds=now - self.received)
        else:
            self.dispatcher.metrics.token_gap(now - self._last_token_at)
        self._last_token_at = now
        self.output_tokens += len(resp.token_ids)

    def _log(self, phase: str, **fields) -> None:
        log_event(log, "phase", rid=self.rid, room=self.room, phase=phase, **fields)
