"""What every node process (colocated, prefill, decode) serves besides its role's own API:
Admin, health, reflection and /metrics, and the node's admission state.

A server is bound before its node loads, so that operators and routers see it at once:

    server = PrefillServer(host, port, settings)      # bound; health NOT_SERVING, Admin answers
    server.load(lambda: PrefillNode(config, pp))      # ranks start; SERVING when every one is ready

Health (every service of the node and "") is SERVING only while the node is loaded, not
draining, and every rank process is alive; a watcher thread notices a dead rank within
`WATCH_S`, fails the requests the node can no longer finish, and turns health NOT_SERVING
for good. Role services call `await admit(context)` before taking a request.

Every service is a grpc.aio servicer on the server's event loop (`self.loop`, where the node's
front lives too): a stream is a coroutine, so Admin, Bootstrap and health answer however many
Generate or Prefill streams are open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict

import grpc
from grpc_health.v1 import health_pb2

from kvbridge import __version__
from kvbridge.common import rpc
from kvbridge.common.limits import listed_room
from kvbridge.common.logs import log_event
from kvbridge.common.metrics import MetricsServer, StatusCollector
from kvbridge.kv_transfer import remove_segments_of
from kvbridge.serving.kv_events import KVEventsService
from kvbridge.serving.metrics import NodeRecorder
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, kv_events_pb2_grpc

WATCH_S = 0.25  # how often rank liveness is checked
CHECK_IDLE_S = 5.0  # how often an idle node checks its invariants
STATUS_TIMEOUT_S = 5.0  # rank 0 answers status questions within this (it answers between steps)
MAX_PAGE = 1000  # ListRequests page size cap
log = logging.getLogger("kvbridge.node")


LIVE: weakref.WeakSet = weakref.WeakSet()  # servers loaded and not stopped (tests check them after each test)


class NodeServer:
    role = ""  # "colocated" | "prefill" | "decode"
    elastic = False  # its role can change (elastic_node/service.py ElasticServer)
    role_epoch = 0  # role switches made
    switching = ""  # the role a switch under way goes to
    SERVICES: tuple[str, ...] = ()  # the gRPC services this node serves (health is set for each)

    def __init__(self, host: str, port: int, metrics_port: int = -1, settings: dict | None = None):
        self.node = None  # the role's node (has .node: RankGroup, .front: NodeFront), once loaded
        self.host = host
        self.settings = dict(settings or {})  # role flags, for GetConfig
        self.draining = False
        self.dead: list[int] = []  # ranks found dead
        # called (from the watcher thread) once a rank died: `kvbridge serve|prefill|decode` exits
        # non-zero then, so that a supervisor restarts the node; in-process users read .dead
        self.on_death: Callable[[], None] | None = None
        self.started = time.monotonic()
        self.recorder = NodeRecorder()  # the front and this server count here
        self.registry = self.recorder.registry
        self._stopped = threading.Event()
        self._serving: bool | None = None
        self.server = rpc.AioServer(host, port, self.servicers(), self.SERVICES, serving=False, name="kvbridge-node")
        self.port, self.health, self.loop = self.server.port, self.server.health, self.server.loop
        self.address = f"{host}:{self.port}"
        self._serving = False
        try:
            self.metrics_server = MetricsServer(host, metrics_port, self.registry) if metrics_port >= 0 else None
        except ValueError:
            self.server.stop(0)
            raise
        self.metrics_port = self.metrics_server.port if self.metrics_server else -1

    def servicers(self) -> list[tuple[Callable, object]]:
        """(add_XServicer_to_server, servicer) pairs: the role's services; Admin and KVEvents are added here."""
        return [
            (admin_pb2_grpc.add_AdminServicer_to_server, NodeAdminService(self)),
            (kv_events_pb2_grpc.add_KVEventsServicer_to_server, KVEventsService(self)),
        ]

    # ------------------------------------------------------------------ life

    def load(self, make_node: Callable[[], object]) -> NodeServer:
        """Build the node (starts its ranks; blocks until they are ready), then serve."""
        try:
            node = make_node()
        except BaseException:
            self._close_servers(0)
            raise
        node.front.recorder = self.recorder
        node.front.kv_events.role = self.role
        node.front.attach(self.loop)
        self.registry.register(StatusCollector(self.status, node.ranks.config.model, node.ranks.config.page_size))
        node.ranks.rank_files.collector(self.registry)
        self.node = node
        self.violations = 0  # invariant violations found so far
        self.loaded()
        LIVE.add(self)
        threading.Thread(target=self._watch, name="kvbridge-rank-watch", daemon=True).start()
        self._update_health()
        log_event(log, "ready", role=self.role, address=self.address, metrics_port=self.metrics_port)
        return self

    def loaded(self) -> None:
        """Hook: the node is up (roles finish wiring here)."""

    def shutdown_gracefully(self, grace_s: float) -> list:
        """SIGTERM: stop admitting, let requests in flight finish for up to `grace_s`, then fail the
        rest (UNAVAILABLE) and stop everything (shared memory freed). Returns the rank reports."""
        if self.node is not None and not self.dead:
            self.set_draining(True)
            deadline = time.monotonic() + grace_s
            left = None
            while time.monotonic() < deadline:
                try:
                    left = self.node.front.status(timeout=STATUS_TIMEOUT_S)["requests_in_flight"]
                except Exception:
                    break
                if left == 0:
                    break
                time.sleep(0.05)
            log_event(log, "shutdown", role=self.role, address=self.address, unfinished=left or 0)
        return self.stop()

    def stop(self, grace_s: float = 2.0):
        """Stop serving and shut the node down; returns the ranks' reports ([] if it never loaded)."""
        self._stopped.set()
        LIVE.discard(self)
        self.health.enter_graceful_shutdown()
        self._close_servers(grace_s)
        if self.node is None:
            return []
        if self.dead:  # rank 0 may be gone: nobody would order the others to stop
            self.node.front.close()
            for pid in self.node.ranks.kill():
                remove_segments_of(pid)  # the pools of ranks that could not close them
            return []
        return self.node.shutdown()

    def _close_servers(self, grace_s: float) -> None:
        self.server.stop(grace_s)
        if self.metrics_server is not None:
            self.metrics_server.stop()

    # ------------------------------------------------------------------ admission and health

    @property
    def serving(self) -> bool:
        return self.node is not None and not self.draining and not self.dead

    async def admit(self, context: grpc.aio.ServicerContext) -> None:
        """Abort the call with UNAVAILABLE (a router retries elsewhere) unless new requests are taken."""
        if self.node is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.role} node is still loading")
        if self.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.role} node lost pipeline rank {self.dead[0]}")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.role} node is draining")

    def set_draining(self, draining: bool) -> None:
        if draining != self.draining:
            self.draining = draining
            log_event(log, "drain" if draining else "resume", role=self.role, address=self.address)
        self._update_health()

    def _update_health(self) -> None:
        serving = self.serving
        if serving != self._serving:
            self._set_health(serving)

    def _set_health(self, serving: bool) -> None:
        self._serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.SERVICES):
            self.health.set(name, status)

    def _watch(self) -> None:
        next_check = time.monotonic() + CHECK_IDLE_S
        while not self._stopped.wait(WATCH_S):
            if time.monotonic() > next_check and not self.dead:
                next_check = time.monotonic() + CHECK_IDLE_S
                try:
                    if self.node.front.status(timeout=STATUS_TIMEOUT_S)["requests_in_flight"] == 0:
                        self.check_invariants()
                except Exception:  # rank 0 busy or stopping: the next round checks
                    pass
            dead = self.node.ranks.dead_ranks()
            if dead and not self.dead:
                self.dead = dead
                self._update_health()
                error = f"pipeline rank {dead[0]} of the {self.role} node died"
                try:
                    failed = self.node.front.fail_all(error)
                except TimeoutError:  # the front's loop did not answer (stopping): still end the node
                    failed = "unknown"
                log_event(log, "rank_died", logging.ERROR, role=self.role, ranks=dead, failed_requests=failed)
                if self.on_death is not None:
                    self.on_death()

    # ------------------------------------------------------------------ state

    def check_invariants(self, settle_s: float = 1.0) -> list[str]:
        """Rank 0's checks (pages owned = pages of live requests, each live request in one queue)
        and every local rank at the same decision log position (given `settle_s` for decisions in
        transit to catch up). Violations are logged as errors and counted; returns them."""
        answer = self.node.front.check(timeout=STATUS_TIMEOUT_S)
        problems = list(answer["problems"])
        deadline = time.monotonic() + settle_s
        made = answer["log"]
        while (positions := self.node.ranks.log_positions()) and set(positions.values()) != {made}:
            if time.monotonic() > deadline:
                problems.append(f"decision log positions differ: {positions} (rank 0 made {made})")
                break
            if max(positions.values()) > made:  # rank 0 decided more since it answered: ask again
                made = self.node.front.check(timeout=STATUS_TIMEOUT_S)["log"]
            else:
                time.sleep(0.02)
        for problem in problems:
            log_event(log, "invariant_violation", logging.ERROR, role=self.role, problem=problem)
        self.violations += len(problems)
        if problems:
            self.recorder.violations(len(problems))
        return problems

    def status(self) -> dict:
        """The node's state as Admin and /metrics show it; raises if rank 0 does not answer (any
        thread but the loop's)."""
        return self._with_ranks(None if self.dead else self.node.front.status(timeout=STATUS_TIMEOUT_S))

    async def astatus(self) -> dict:
        """status(), on the loop."""
        return self._with_ranks(None if self.dead else await self.node.front.astatus(timeout=STATUS_TIMEOUT_S))

    def _with_ranks(self, st: dict | None) -> dict:
        node = self.node.ranks
        if st is None:  # a rank died: rank 0 may not answer any more
            st = {"pages_used": 0, "pages_total": node.config.total_pages, "queues": {}, "served": 0}
            st |= {"requests_in_flight": 0, "transfers_in_flight": 0}
        alive = set(range(node.pp.pp_size)) - set(self.dead)
        st["ranks"] = [
            {"rank": r, "alive": r in alive, "kv_pages_used": st["pages_used"], "kv_pages_total": st["pages_total"]}
            for r in range(node.pp.pp_size)
        ]  # every rank holds the same page ids (its own layers of them): rank 0's allocator counts for all
        st["draining"] = self.draining
        return st

    def config_json(self) -> str:
        out = {"role": self.role, "address": self.address, "metrics_port": self.metrics_port, **self.settings}
        if self.node is not None:
            node = self.node.ranks
            out |= {"engine": asdict(node.config), "pp": asdict(node.pp), "rank_pids": [p.pid for p in node.procs]}
        return json.dumps(out, sort_keys=True)


class NodeAdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, server: NodeServer):
        self.server = server

    async def _loaded(self, context):
        if self.server.node is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.server.role} node is still loading")
        return self.server.node

    async def _rank0_silent(self, context) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"rank 0 did not answer within {STATUS_TIMEOUT_S:g} s")

    async def GetStatus(self, request, context):
        s = self.server
        out = admin_pb2.Status(
            role=s.role,
            version=__version__,
            uptime_s=time.monotonic() - s.started,
            draining=s.draining,
            serving=s.serving,
            model=s.settings.get("model", ""),
            elastic=s.elastic,
            role_epoch=s.role_epoch,
            switching_to=s.switching,
        )
        if s.node is None:
            return out  # loading: what is known before the ranks are up
        node = s.node.ranks
        try:
            st = await s.astatus()
        except (TimeoutError, asyncio.TimeoutError):
            await self._rank0_silent(context)
        out.model, out.model_fingerprint, out.pp_size = node.config.model, node.model.fingerprint, node.pp.pp_size
        out.ranks.extend(admin_pb2.RankStatus(**r) for r in st["ranks"])
        out.queues.update(st["queues"])
        out.requests_served = st["served"]
        out.requests_in_flight = st["requests_in_flight"]
        out.transfers_in_flight = st["transfers_in_flight"]
        out.prefix_cache.CopyFrom(admin_pb2.PrefixCacheStatus(**st.get("prefix_cache", {"enabled": False})))
        return out

    async def ClearPrefixCache(self, request, context):
        node = await self._loaded(context)
        try:
            dropped = await node.front.clear_cache(timeout=STATUS_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            await self._rank0_silent(context)
        log_event(log, "clear_prefix_cache", role=self.server.role, pages_dropped=dropped)
        return admin_pb2.ClearPrefixCacheResponse(pages_dropped=dropped)

    async def ListRequests(self, request, context):
        node = await self._loaded(context)
        size = request.page_size or 100
        if size > MAX_PAGE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_size must be at most {MAX_PAGE}, got {size}")
        start = rpc.page_offset(request.page_token)
        if start is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"page_token {rpc.shown(request.page_token)} is not one we issued"
            )
        try:
            reqs = await node.front.arequests(timeout=STATUS_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            await self._rank0_silent(context)
        reqs = sorted((r for r in reqs if not request.phase or r["phase"] == request.phase), key=lambda r: -r["age_s"])
        page = reqs[start : start + size]
        more = start + size < len(reqs)
        full = bool(rpc.security().admin_key)  # the caller passed the admin key check
        return admin_pb2.ListRequestsResponse(
            requests=[admin_pb2.RequestInfo(**(r | {"room": listed_room(r["room"], full)})) for r in page],
            next_page_token=str(start + size) if more else "",
            total=len(reqs),
        )

    async def AbortRequest(self, request, context):
        node = await self._loaded(context)
        if not request.rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rid is required")
        try:
            listed = await node.front.arequests(STATUS_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            await self._rank0_silent(context)
        phase = next((r["phase"] for r in listed if r["rid"] == request.rid), None)
        why = f"aborted by an operator (Admin.AbortRequest on the {self.server.role} node {self.server.address})"
        if phase is None or not node.front.abort(request.rid, why, source="admin"):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {rpc.shown(request.rid)} on this node")
        log_event(log, "abort", role=self.server.role, rid=request.rid, phase=phase, source="admin")
        return admin_pb2.AbortRequestResponse(rid=request.rid, phase=phase)

    async def Drain(self, request, context):
        s = self.server
        if not request.wait_s >= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must be >= 0, got {request.wait_s}")
        s.set_draining(True)
        deadline = time.monotonic() + request.wait_s
        while True:  # (a caller that goes away cancels this coroutine)
            left = await self._in_flight(context)
            if left == 0 or time.monotonic() >= deadline:
                return admin_pb2.DrainResponse(draining=s.draining, requests_in_flight=left, empty=left == 0)
            await asyncio.sleep(0.05)

    async def Resume(self, request, context):
        self.server.set_draining(False)
        left = await self._in_flight(context)
        return admin_pb2.DrainResponse(draining=False, requests_in_flight=left, empty=False)

    async def _in_flight(self, context) -> int:
        if self.server.node is None or self.server.dead:
            return 0
        try:
            return (await self.server.node.front.astatus(timeout=STATUS_TIMEOUT_S))["requests_in_flight"]
        except (TimeoutError, asyncio.TimeoutError):
            await self._rank0_silent(context)

    async def GetConfig(self, request, context):
        return admin_pb2.Config(role=self.server.role, version=__version__, json=self.server.config_json())

    async def SetRole(self, request, context):
        s = self.server
        if not s.elastic:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the {s.role} node {s.address} was not started with --elastic: its role is fixed",
            )
        if request.node and request.node != s.address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node {rpc.shown(request.node)} is not this node ({s.address}): name a node only to a router",
            )
        return await s.set_role(request, context)

    async def _router_only(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"a {self.server.role} node has no nodes: ask the router")

    ListNodes = AddNode = RemoveNode = _router_only
