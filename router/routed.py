"""A routed request (`Routed`): one client request's upstream calls, on the router's event loop
(a request is a coroutine chain, never a thread; nothing here blocks).

Nodes are picked by the pool's policy (router/policy.py; cache_aware hashes the prompt's blocks
first, router/prompts.py, once per request); each pick is counted by role, policy and reason.
Colocated: one colocated node streams the whole request.
Disaggregated: a decode node D and a prefill node P are picked independently; the router makes a
random 63-bit room, then at once opens D.Generate (a stream, with PrefillRoute{room, P's address})
and P.Prefill{rid, room, prompt, sampling, cache_salt} (a task beside D's stream). D's responses go
to the client; the last one's usage.cached_tokens (choice 0's, with n > 1: P prefills choice 0 and D
forks the others after the hand-off) is P's PrefillResponse.cached_tokens (awaited at
most CACHED_TOKENS_WAIT_S if P's call has not returned yet). If P fails before D's first response,
D's stream is cancelled and the client gets P's status; later, D holds the whole KV already, so P's
failure does not touch the stream (P's call outlives D's first token: it returns once P's pushes
settle, and the dispatcher holds its task until then). If D fails, P is cancelled. A decode node
competes with the colocated nodes for each request, and is eligible only while some prefill node is.
Local prefill: while the prefill queue is long, D may compute a short prompt itself, with no P
(router/local_prefill.py: the rule, counted per attempt); its stream is passed through as a colocated one.

Retries (before any response reached the client) and migrations (after) are decided by the
failure's kind: router/failures.py.

Timeouts: each wait for the node's next response runs under an asyncio timeout, so an attempt
with no first token within first_token_timeout_s of its start is cancelled (retried as above, else
the client gets DEADLINE_EXCEEDED); after the first token, a node that sends nothing for
idle_stream_timeout_s ends the request (DEADLINE_EXCEEDED "no token for N s"). Only time spent
waiting for the node counts, not time spent handing responses to a slow client. Both are counted
in kvbridge_router_timeouts_total{timeout}.

Liveness: how soon the requests on a node that dies end (retried, or failed if a token was sent).
- The node's process dies (crash, kill -9) on a host that stays up: the kernel closes its sockets,
  gRPC fails every call open on it with UNAVAILABLE at once, and its health watch fails (the pool
  routes nothing new to it). Bound: under 1 s (tests/nodes/test_failover.py measures it).
- The host vanishes without closing anything: gRPC keepalive (common/rpc.py: a ping after 10 s
  without traffic, 5 s for its answer) may fail the calls, but gRPC spaces its pings out on a
  connection the router sends nothing on (a minute apart after the first two), so the bound is the
  timeouts above: no request waits on a silent node longer than first_token_timeout_s per attempt
  (before its first token) or idle_stream_timeout_s (after).

Cancelling a Routed (client gone: its consumer closed it or the consumer's task was cancelled; or
an operator's Admin.AbortRequest) cancels every upstream call it has open; the nodes then abort
the request, and the client is told CANCELLED with who cancelled it. A request that has ended is
not cancelled any more (its P call may still be settling, and is left to). The dispatcher holds
every request in flight by rid, from its first step to its end, for Admin.ListRequests /
AbortRequest and Drain (router/dispatch.py; while draining, a new request ends at once with
UNAVAILABLE). Each phase
change is one log line (`event=phase` with phase routed, first_token, timeout, retry, finished or
failed) and feeds the router's metrics (router/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
import time
from array import array
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from kvbridge.common import rpc, tracing
from kvbridge.common.limits import room_tag
from kvbridge.common.logs import log_event
from kvbridge.common.metrics import outcome_of
from kvbridge.common.security import message_proof
from kvbridge.router import local_prefill, traced
from kvbridge.router.failures import (
    Interrupted,
    Migrate,
    Retry,
    RouteError,
    TimedOut,
    Unpaired,
    timeout_error,
    upstream_error,
)
from kvbridge.router.pool import Node, Pick
from kvbridge.router.prompts import PromptBlocks, PromptIds
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc

if TYPE_CHECKING:
    from kvbridge.router.dispatch import Dispatcher

GENERATION_ROLES = ("colocated", "decode")
# a Routed's phase: no node yet, then how it is served
PHASES = ("routing", "colocated", "prefill+decode", "local_prefill")
RETRY_BACKOFF_CAP_S = 1.0  # the longest pause between two attempts
CACHED_TOKENS_WAIT_S = 1.0  # the last response waits this long at most for P's answer (its cached_tokens)
CLIENT_CANCELLED = "the client cancelled the request"
OPERATOR_ABORTED = "an operator aborted the request (Admin.AbortRequest on the router)"
ROUTER_STOPPING = "the router is stopping"
DRAINING = "the router is draining"
log = logging.getLogger("kvbridge.router")


class Routed:
    """A routed request: `async for` its GenerateResponses (RouteError on failure). A consumer that
    stops early closes it (`aclose`, or contextlib.aclosing), which cancels upstream like cancel().
    cancel() runs on the router's loop. Its phase, room, peer and token counts are read by
    Admin.ListRequests while it runs."""

    def __init__(
        self, dispatcher: Dispatcher, request: generation_pb2.GenerateRequest, deadline: float, prefill=(), parent=None
    ):
        self.dispatcher, self.pool, self.config = dispatcher, dispatcher.pool, dispatcher.config
        self.request = request  # rid set; prefill unset
        self.deadline = deadline  # time.monotonic() by which every upstream call ends
        self.gateway_prefill = prefill  # prefill nodes a gateway chose (x-gateway-prefill-endpoints): tried first
        self.rid = request.rid
        self.received = time.monotonic()  # when the router got it
        self.span = traced.request_span(request, parent)  # (parent: the client's trace context, or None)
        self.phase = "routing"  # one of PHASES
        self.room = 0  # the current attempt's room (disaggregated), else 0
        self.peer = ""  # the nodes serving it: "P_ADDR -> D_ADDR", or the colocated node's address
        self.attempts = 0  # attempts started so far
        self.prompt_tokens = len(request.prompt.token_ids.ids)  # 0 until known (text, chat: hashed, or the last usage)
        self.blocks: PromptBlocks | None = None  # the prompt's block hashes, for the policy (None: unknown)
        self.ids: PromptIds | None = None  # a text or chat prompt's ids, made here (None: no tokenizer, or sent as ids)
        self._hashed = False  # blocks were looked for (once per request, before the first attempt)
        # token ids handed to the client so far (a migration resumes after them): 4 bytes each
        self.output_ids = array("I")
        self.sent = 0  # responses handed to the client so far
        self.migrations = 0  # times the stream moved to another pair
        self._attempt_sent = 0  # responses of the current attempt handed to the client
        self.finish_reason = ""  # of the last response, once it came
        self.cancelled = asyncio.Event()
        self.why = ""  # the reason of the first cancel(): what the client is told
        # time.monotonic() of each choice's last token-bearing response (one choice unless n > 1: a gap
        # is timed within a choice, not across the interleaved choices of one stream)
        self._last_token_at: dict[int, float] = {}
        self._calls: list[grpc.aio.Call] = []  # the current attempt's upstream calls, cancelled by cancel()
        self._last_error: RouteError | None = None  # the failure of the last attempt
        self.unpaired = Unpaired()  # pairs whose decode node refused the prefill node (left out from now on)
        self._ended = False  # the request is over: cancel() does nothing any more
        self._responses: AsyncIterator[generation_pb2.GenerateResponse] | None = None

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        if self._responses is None:
            self._responses = self._run()
        return self._responses

    async def aclose(self) -> None:
        if self._responses is not None:
            await self._responses.aclose()

    def cancel(self, why: str = CLIENT_CANCELLED) -> None:
        """End the request: every upstream call it has open is cancelled (the nodes abort it) and
        the client is told CANCELLED with `why`; the first reason given is the one kept."""
        if self._ended:
            return
        if not self.cancelled.is_set():
            self.why = why
            self.cancelled.set()
        for call in self._calls:
            call.cancel()

    def age_s(self) -> float:
        return time.monotonic() - self.received

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    async def _run(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        outcome, error = "error", None
        try:
            self.dispatcher._admit(self)
            excluded: list[Node] = []
            while True:
                try:
                    async with contextlib.aclosing(self._attempt(excluded)) as responses:
                        async for resp in responses:
                            yield resp
                    break
                except Migrate as moved:
                    excluded += moved.nodes
                    self._migrate(moved, excluded)
                except Retry as retry:
                    excluded += retry.nodes
                    await self._pause_before_retry(retry, excluded)
            outcome = outcome_of(self.finish_reason)
            self._log("finished", outcome=outcome, tokens=self.output_tokens, seconds=self.age_s())
        except RouteError as e:
            error = e
            outcome = "abort" if e.code == grpc.StatusCode.CANCELLED and self.cancelled.is_set() else "error"
            self._log("failed", outcome=outcome, code=e.code.name, message=e.message, seconds=self.age_s())
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the consumer stopped reading, or its task was cancelled
            self.cancel()  # (a no-op if it was cancelled already; the first reason stays)
            outcome, error = "abort", RouteError(grpc.StatusCode.CANCELLED, self.why)
            self._log("failed", outcome=outcome, code="CANCELLED", message=self.why, seconds=self.age_s())
            raise
        finally:
            self._ended = True
            self.dispatcher._ended(self, outcome)
            traced.ended(self.span, self, error)

    # ------------------------------------------------------------------ attempts

    async def _attempt(self, excluded: list[Node]) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.phase, self.room, self.peer = "routing", 0, ""
        if self.cancelled.is_set():
            raise RouteError(grpc.StatusCode.CANCELLED, self.why)
        if not self._hashed:  # (once per request, whatever its attempts)
            self._hashed = True
            prompts = self.dispatcher.prompts
            self.ids = await prompts.ids(self.request)
            if self.pool.policy.needs_prompt:
                self.blocks = await prompts.blocks(self.request, self.pool.page_sizes(), self.ids)
            if self.ids is not None:
                self.prompt_tokens = len(self.ids.ids)
            elif self.blocks is not None:
                self.prompt_tokens = self.blocks.tokens
        timeout, picking = self._remaining(), time.time_ns()
        roles = GENERATION_ROLES if self.pool.has_eligible("prefill", excluded) else ("colocated",)
        picked = self._pick(roles, [*excluded, *self.unpaired.stuck(self.pool, excluded)])
        if picked is None:
            raise self._none_left()
        node = picked.node
        self.attempts += 1
        self._calls = []
        request = generation_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        if self.attempts > 1:  # the nodes of an earlier attempt may still hold the rid for a moment
            request.rid = f"{self.rid}:retry{self.attempts - 1}"
        request.resume_ids.extend(self.output_ids)  # (a migration: the new node goes on after them)
        if self.output_ids:  # (the client has the prompt's logprobs: they came with the first token)
            request.sampling.ClearField("prompt_logprobs")
        self._attempt_sent = 0
        if node.role == "colocated":
            fallback = roles == ("colocated",) and self.pool.has_role("prefill")
            self.dispatcher.metrics.pd_decision("fallback" if fallback else "colocated", self.prompt_tokens)
            self._send_ids(request, node)
            self.peer, self.phase = node.address, "colocated"
            self._log("routed", colocated=node.address)
            attempt = traced.picked(self.span, picked, None, self.pool.policy.name, picking, self.migrations)
            served = self._colocated(picked, request, timeout, tracing.metadata(attempt))
        elif (local := local_prefill.consider(self, picked, excluded)) is not None and local.local:
            computing = local_prefill.uncached(self, picked)  # (D's queue until its first response)
            self.dispatcher.metrics.pd_decision("local", self.prompt_tokens)
            self._send_ids(request, node)
            request.prefill.CopyFrom(local_prefill.local_route(request.rid))
            self.pool.add_tokens(node, computing)
            self.peer, self.phase = node.address, "local_prefill"
            self._log("routed", decode=node.address, local_prefill=local.reason, uncached=computing)
            attempt = traced.picked(self.span, picked, None, self.pool.policy.name, picking, self.migrations, local)
            served = self._colocated(picked, request, timeout, tracing.metadata(attempt), computing)
        else:
            prefill = self._pick(("prefill",), [*excluded, *self.unpaired.prefill_of(node)], among=self.gateway_prefill)
            if prefill is None:  # the last prefill node turned unhealthy just now
                self.pool.release(node, picked.tokens)
                raise self._none_left()
            self.dispatcher.metrics.pd_decision("disaggregated", self.prompt_tokens)
            self._send_ids(request, node)  # (D refuses a P of another model: the layout's fingerprint)
            self.room, self.peer = secrets.randbits(63), f"{prefill.node.address} -> {node.address}"
            self.phase = "prefill+decode"
            self._log("routed", prefill=prefill.node.address, decode=node.address)
            attempt = traced.picked(self.span, picked, prefill, self.pool.policy.name, picking, self.migrations, local)
            served = self._disaggregated(prefill, picked, request, timeout, tracing.metadata(attempt))
        try:
            async with contextlib.aclosing(served) as responses:
                async for resp in responses:
                    yield resp
        finally:
            traced.attempt_ended(attempt, sys.exc_info()[1])

    def _send_ids(self, request: generation_pb2.GenerateRequest, node: Node) -> None:
        """The prompt as the ids the router made, when `node` serves the model whose tokenizer made
        them (else the nodes tokenize it themselves)."""
        if self.ids is not None and node.model is not None and node.model.fingerprint == self.ids.fingerprint:
            request.prompt.CopyFrom(common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=self.ids.ids)))

    def _pick(self, roles: tuple[str, ...], excluded: list[Node], among: tuple = ()) -> Pick | None:
        picked = self.pool.pick(roles, excluded, self.blocks, among)
        if picked is not None:
            self.dispatcher.metrics.routed(picked.node.role, self.pool.policy.name, picked.reason)
        return picked

    async def _pause_before_retry(self, retry: Retry, excluded: list[Node]) -> None:
        """Wait the backoff before the next attempt; raise the failure when there is to be none."""
        self._last_error = retry.error
        if self.attempts >= self.config.max_attempts or not self.dispatcher.can_route(excluded):
            raise retry.error
        backoff = self.config.retry_backoff_s * 2 ** (self.attempts - 1)
        pause = min(backoff, RETRY_BACKOFF_CAP_S, max(0.0, self.deadline - time.monotonic()))
        code = retry.error.code
        self.dispatcher.metrics.retry(code.name.lower())
        self._log("retry", code=code.name, reason=retry.error.message, attempt=self.attempts + 1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(pause):
                await self.cancelled.wait()
        if self.cancelled.is_set():
            raise RouteError(grpc.StatusCode.CANCELLED, self.why)

    def _migrate(self, moved: Migrate, excluded: list[Node]) -> None:
        """Move the stream to another pair, or raise the failure saying why it cannot move."""
        error = moved.error
        if self.cancelled.is_set():
            raise RouteError(grpc.StatusCode.CANCELLED, self.why)
        why_not = ""
        if self.migrations >= self.config.max_migrations:
            why_not = f"it was migrated {self.migrations} times already (--max-migrations {self.config.max_migrations})"
        elif not self.dispatcher.can_route(excluded):
            why_not = "no other healthy node pair can take it over"
        elif time.monotonic() >= self.deadline:
            why_not = "the request's deadline passed"
        if why_not:
            self._log("not_migrated", code=error.code.name, reason=error.message, why=why_not)
            raise RouteError(error.code, f"{error.message}; after {self.output_tokens} tokens, not migrated: {why_not}")
        self.migrations += 1
        self.dispatcher.metrics.migrated(moved.reason)
        fields = {"tokens": self.output_tokens, "migration": self.migrations}
        self._log("migrate", code=error.code.name, reason=error.message, **fields)
        self.span.add_event("migrated", {"kvbridge.reason": moved.reason, "kvbridge.tokens": self.output_tokens})

    def _none_left(self) -> RouteError:
        """No node to try: the last attempt's failure, if there was one."""
        return self._last_error or RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy node can serve the request")

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return left

    def _open(self, call: grpc.aio.Call) -> grpc.aio.Call:
        """Register an upstream call so that cancel() reaches it (at once, if cancel came first)."""
        self._calls.append(call)
        if self.cancelled.is_set():
            call.cancel()
        return call

    async def _colocated(
        self, picked: Pick, request: generation_pb2.GenerateRequest, timeout: float, trace: tuple, computing: int = 0
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The node's stream, passed through (a colocated node's, or a decode node's computing the
        prompt itself: `computing` tokens off its queue at its first response). The caller acquired the
        node; it is released here."""
        node = picked.node
        try:
            call = generation_pb2_grpc.GenerationStub(node.channel).Generate
            stream = self._open(call(request, timeout=timeout, metadata=self.pool.call_metadata + trace))
            done = False
            try:
                while (resp := await self._next(stream)) is not None:
                    if computing:  # (a local prompt is computed: off the decode node's queue)
                        self.pool.add_tokens(node, -computing)
                        computing = 0
                    self._deliver(resp)
                    yield resp
                done = True
            except TimedOut as e:
                raise timeout_error(self, e.kind, [node]) from None
            except Interrupted:
                raise self._interrupted() from None
            except grpc.aio.AioRpcError as e:
                raise upstream_error(self, e, [node]) from None
            finally:
                if not done:  # an error, or the consumer closed this generator: no-op on a finished call
                    stream.cancel()
        finally:
            self.pool.release(node, picked.tokens + computing)

    async def _disaggregated(
        self, p_pick: Pick, d_pick: Pick, request: generation_pb2.GenerateRequest, timeout: float, trace: tuple
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """D's stream, passed through, with P's Prefill running beside it as a task. The caller
        acquired both; D is released when its stream ends, P when its Prefill call returns."""
        p, d = p_pick.node, d_pick.node
        dreq = generation_pb2.GenerateRequest()
        dreq.CopyFrom(request)
        dreq.prefill.room, dreq.prefill.prefill_addr = self.room, p.address
        dreq.prefill.proof = message_proof(rpc.security().fleet(), dreq.prefill)  # D registers only routes of its fleet
        preq = prefill_pb2.PrefillRequest(
            rid=request.rid, room=self.room, prompt=request.prompt, sampling=request.sampling,
            cache_salt=request.cache_salt, resume_ids=request.resume_ids,
        )  # fmt: skip
        preq.sampling.ClearField("n")  # (P computes choice 0; D forks the others after the hand-off)
        answered = False  # D sent its first response: it holds the whole KV
        prefilled: prefill_pb2.PrefillResponse | None = None  # P's answer, once its Prefill call returned
        p_failed: grpc.aio.AioRpcError | None = None  # P's error, recorded before D's stream is cancelled for it
        calls: list[grpc.aio.Call] = []
        settling = False  # P's task holds P (and releases it when its call ends)
        done = False
        try:
            call = generation_pb2_grpc.GenerationStub(d.channel).Generate
            stream = self._open(call(dreq, timeout=timeout, metadata=self.pool.call_metadata + trace))
            calls.append(stream)
            p_call = self._open(prefill_pb2_grpc.PrefillStub(p.channel).Prefill(preq, timeout=timeout, metadata=trace))
            calls.append(p_call)

            async def prefill() -> None:
                nonlocal prefilled, p_failed
                try:
                    prefilled = await p_call
                except grpc.aio.AioRpcError as e:
                    if not answered:  # (once D answered, P's failure cannot touch the stream)
                        p_failed = e
                        stream.cancel()
                except asyncio.CancelledError:
                    pass  # cancelled here: the attempt failed, or the router is stopping

            task = self.dispatcher._settle(prefill())
            task.add_done_callback(lambda _: self.pool.release(p, p_pick.tokens))  # (runs even if cancelled first)
            settling = True
            try:
                while (resp := await self._next(stream)) is not None:
                    if not answered and preq.sampling.HasField("prompt_logprobs"):  # P computed them
                        if prefilled is None:
                            await asyncio.wait([task], timeout=max(self.deadline - time.monotonic(), 0))
                        if prefilled is None:
                            raise RouteError(grpc.StatusCode.UNAVAILABLE, "the prefill node sent no prompt logprobs")
                        resp.prompt_logprobs.extend(prefilled.prompt_logprobs)
                    answered = True
                    if resp.HasField("usage") and resp.index == 0:  # choice 0's last: what P found cached
                        if prefilled is None:
                            await asyncio.wait([task], timeout=CACHED_TOKENS_WAIT_S)
                        if prefilled is not None:
                            resp.usage.cached_tokens = prefilled.cached_tokens
                    self._deliver(resp)
                    yield resp
                done = True  # P may still be finishing (its pushes settle after D has the KV): let it
            except TimedOut as e:
                raise timeout_error(self, e.kind, [d] if prefilled is not None else [p]) from None
            except (Interrupted, grpc.aio.AioRpcError) as e:
                if p_failed is not None:  # P's own timeouts wait on D (its registration, its pages taking the KV)
                    waited_on_d = p_failed.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    raise upstream_error(self, p_failed, [d] if waited_on_d else [p]) from None
                if isinstance(e, Interrupted):
                    raise self._interrupted() from None
                raise upstream_error(self, e, [d], (p, d)) from None
        finally:
            if not done:  # an error, or the consumer closed this generator
                for call in calls:
                    call.cancel()
            if not settling:
                self.pool.release(p, p_pick.tokens)
            self.pool.release(d, d_pick.tokens)

    async def _next(self, stream: grpc.aio.UnaryStreamCall) -> generation_pb2.GenerateResponse | None:
        """The node's next response (None: the stream ended), waited for at most the timeout that
        applies now: first_token_timeout_s before any response reached the client, else
        idle_stream_timeout_s (0: none). A timeout cancels the call and raises TimedOut."""
        first = self._attempt_sent == 0  # (a migrated attempt's first token waits for its prefill too)
        limit = self.config.first_token_timeout_s if first else self.config.idle_stream_timeout_s
        since = time.monotonic()
        try:
            async with asyncio.timeout(limit or None):
                resp = await stream.read()  # (a cancelled read cancels the call)
        except TimeoutError:
            kind = "first_token" if first else "idle_stream"
            self.dispatcher.metrics.timed_out(kind)
            self._log("timeout", timeout=kind, seconds=time.monotonic() - since)
            raise TimedOut(kind) from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # our own task is being cancelled: let it
                raise
            raise Interrupted() from None  # grpc.aio reads a locally cancelled call as CancelledError
        return None if resp is grpc.aio.EOF else resp

    def _interrupted(self) -> RouteError:
        return RouteError(grpc.StatusCode.CANCELLED, self.why or "the upstream call was cancelled")

    # ------------------------------------------------------------------ accounting

    def _deliver(self, resp: generation_pb2.GenerateResponse) -> None:
        """Account for a response about to be handed to the client: counts, TTFT, token gaps."""
        self.sent += 1
        self._attempt_sent += 1
        if resp.finish_reason:
            self.finish_reason = resp.finish_reason
        if resp.HasField("usage"):
            self.prompt_tokens = resp.usage.prompt_tokens
        if not resp.token_ids:
            return
        now = time.monotonic()
        if not self._last_token_at:
            self.span.add_event("first_token")
            self.dispatcher.metrics.first_token(now - self.received)
            self._log("first_token", seconds=now - self.received)
        elif resp.index in self._last_token_at:
            self.dispatcher.metrics.token_gap(now - self._last_token_at[resp.index])
        self._last_token_at[resp.index] = now
        self.output_ids.extend(resp.token_ids)

    def _log(self, phase: str, **fields) -> None:
        log_event(log, "phase", rid=self.rid, room=room_tag(self.room), phase=phase, **fields)
