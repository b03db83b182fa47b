"""The router's requests in flight: `Dispatcher` routes each client request over the pool (as a
`Routed`, router/routed.py: its attempts, retries and timeouts), holds it by rid from its first
step to its end for Admin.ListRequests / AbortRequest and Drain, and holds the Prefill calls that
outlive their requests until they settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
import uuid
from collections.abc import Collection, Coroutine

import grpc

from kvbridge.router.config import RouterConfig
from kvbridge.router.failures import RouteError
from kvbridge.router.metrics import Recorder
from kvbridge.router.pool import Node, NodePool
from kvbridge.router.prompts import Prompts
from kvbridge.router.routed import DRAINING, Routed
from kvbridge.v1 import generation_pb2

CLOSE_WAIT_S = 5.0  # aclose() waits this long at most for the prefill calls still settling


class Dispatcher:
    """Routes requests over the pool and keeps every request in flight, by rid, from its first
    step to its end (any outcome); while draining it admits none. Routing, cancelling and waiting
    happen on the router's event loop; the counts and listings may be read from any thread."""

    def __init__(self, pool: NodePool, config: RouterConfig):
        self.pool = pool
        self.config = config
        self.requests_served = 0  # requests that ended here, any outcome
        self.planner = None  # router/planner.py PlannerLoop, with --planner slo
        self.draining = False  # new requests are refused with UNAVAILABLE; those in flight finish
        self.started_at = time.time()  # wall clock, for `created` fields
        self.metrics = Recorder(pool, lambda: self.draining, self.num_in_flight)
        pool.on_resync = self.metrics.kv_resync
        self.prompts = Prompts(pool, config.health_retry_s)  # the requests' block hashes, for cache_aware
        self._routed: dict[str, Routed] = {}  # rid -> the request in flight
        self._lock = threading.Lock()  # guards _routed (read by the metrics scrape's thread)
        self._idle = asyncio.Event()  # set while nothing is in flight (wait_idle)
        self._idle.set()
        self._settling: set[asyncio.Task] = set()  # Prefill calls outliving their request (held: tasks are weakly kept)

    def can_route(self, exclude: Collection[Node] = ()) -> bool:
        """Some request could be served now (by nodes not in `exclude`): a healthy colocated node,
        or healthy P and D nodes."""
        return self.pool.has_eligible("colocated", exclude) or (
            self.pool.has_eligible("prefill", exclude) and self.pool.has_eligible("decode", exclude)
        )

    def accepting(self) -> bool:
        """A new request would be routed now: not draining, and some node could serve it."""
        return not self.draining and self.can_route()

    def route(
        self, request: generation_pb2.GenerateRequest, timeout_s: float | None = None, prefill: tuple = (), parent=None
    ) -> Routed:
        """Start routing a (checked) request; iterate the result (`async for`) for its responses.
        The deadline of every upstream call is now + min(timeout_s, request_timeout_s). `prefill`:
        the pool's prefill nodes a gateway chose (pool.prefill_nodes_at), tried before any other;
        `parent`: the caller's trace context (common/tracing.py extract), or None."""
        req = generation_pb2.GenerateRequest()
        req.CopyFrom(request)
        req.rid = req.rid or uuid.uuid4().hex
        s = req.sampling
        if s.temperature > 0 and s.top_k != 1 and not s.HasField("seed"):
            # sampled with a seed of its own, so that a migrated stream continues with the same randomness
            s.seed = secrets.randbits(63)
        limit = self.config.request_timeout_s
        budget = limit if timeout_s is None else min(timeout_s, limit)
        return Routed(self, req, time.monotonic() + budget, prefill, parent)

    async def aclose(self) -> None:
        """Cancel the Prefill calls still settling after their requests ended."""
        for task in list(self._settling):
            task.cancel()
        if self._settling:
            await asyncio.wait(list(self._settling), timeout=CLOSE_WAIT_S)

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
        self.draining = draining

    async def wait_idle(self, timeout: float) -> int:
        """Wait until no request is in flight, at most `timeout` seconds; returns how many are left."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        return self.num_in_flight()

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
        self._idle.clear()

    def _ended(self, routed: Routed, outcome: str) -> None:
        with self._lock:
            if self._routed.get(routed.rid) is routed:
                del self._routed[routed.rid]
            self.requests_served += 1
            idle = not self._routed
        if idle:
            self._idle.set()
        self.metrics.ended(outcome, time.monotonic() - routed.received)

    def _settle(self, coro: Coroutine) -> asyncio.Task:
        """Run a Prefill call as a task the dispatcher holds until it ends (it may outlive its request)."""
        task = asyncio.ensure_future(coro)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task
