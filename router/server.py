"""Start and stop a router: one event loop (its own thread) runs the node pool's health watches,
the dispatcher's requests, the gRPC servers (grpc.aio) and the HTTP server (uvicorn). Only the
metrics server (common.metrics, scraped now and then) keeps a thread of its own.

Under mutual TLS the client-facing ports (HTTP, gRPC Generation) ask clients for what
--client-cert-reqs says; the fleet-facing ones (Admin, /metrics) always require a certificate.
Admin shares the gRPC port unless --admin-port gives it one of its own, which it must when that
port takes clients without a certificate (grpcio has no per-service policy)."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from kvbridge.common import rpc
from kvbridge.common.metrics import MetricsServer
from kvbridge.common.security import Security
from kvbridge.router.config import RouterConfig
from kvbridge.router.discovery import Discovery, parse_target
from kvbridge.router.dispatch import Dispatcher
from kvbridge.router.http import HTTPFront
from kvbridge.router.planner import Planner, PlannerLoop, Window
from kvbridge.router.pool import NodePool
from kvbridge.router.routed import ROUTER_STOPPING
from kvbridge.router.service import SERVICES, AdminService, GenerationService
from kvbridge.v1 import admin_pb2_grpc, generation_pb2_grpc

STOP_SLACK_S = 1.0  # gRPC calls still open this long after the grace period (and the cancels) are cut


class Router:
    """A running router. `port`, `http_port`, `metrics_port` and `admin_port` are the bound ports
    (useful with 0 in the config); metrics_port is -1 when metrics are off, admin_port when Admin is
    served on `port`."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.loop = rpc.EventLoop("kvbridge-router")
        self.pool: NodePool | None = None
        self.http: HTTPFront | None = None
        self.server: rpc.AioServer | None = None
        self.admin_server: rpc.AioServer | None = None  # with --admin-port
        self.metrics_server: MetricsServer | None = None
        self._stopped = False
        check_client_certs(config, rpc.security())
        try:
            rpc.security().fleet()  # (read now: a fleet key file that cannot be read fails the start, not a request)
            self.pool = NodePool(config.nodes, config.health_retry_s, self.loop, policy=config.policy)
            targets = [parse_target(spec) for spec in config.discover]
            self.discovery = Discovery(self.pool, targets) if targets else None
            self._discovering: asyncio.Task | None = None
            self.dispatcher = Dispatcher(self.pool, config)
            if config.planner == "slo":
                self.dispatcher.planner = self._planner(config)
            self._planning: asyncio.Task | None = None
            # HTTP first: a bad host fails here with a clean message (gRPC's core also logs its own)
            self.http = HTTPFront(config, self.dispatcher)
            generation = (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationService(self.dispatcher))
            admin = (
                admin_pb2_grpc.add_AdminServicer_to_server,
                AdminService(self.dispatcher, config, self._update_health),
            )
            own_admin_port = config.admin_port >= 0
            front = [generation] if own_admin_port else [generation, admin]
            policy = config.client_cert_reqs
            if config.port >= 0:  # (-1: the HTTP API only, as a colocated node serves it itself)
                self.server = self._serve(
                    config.port, front, SERVICES[: len(front)], serving=False, client_certs=policy
                )
            if own_admin_port:  # (mutual TLS: the default policy)
                self.admin_server = self._serve(config.admin_port, [admin], SERVICES[1:])
            if config.metrics_port >= 0:
                self.metrics_server = MetricsServer(config.host, config.metrics_port, self.dispatcher.metrics.registry)
        except BaseException:
            self._abandon()
            raise
        self.port = self.server.port if self.server is not None else -1
        self.admin_port = self.admin_server.port if self.admin_server is not None else -1
        self.health = self.server.health if self.server is not None else None
        self.http_port = self.http.port
        self.metrics_port = self.metrics_server.port if self.metrics_server is not None else -1
        self._update_health()
        self.pool.add_listener(self._update_health)

    def _serve(self, port: int, services: list, names: tuple[str, ...], **kw) -> rpc.AioServer:
        try:
            return rpc.AioServer(self.config.host, port, services, names, loop=self.loop, **kw)
        except ValueError:
            raise ValueError(f"cannot bind {self.config.host}:{port} for gRPC") from None

    def start(self) -> None:
        self.pool.start()
        if self.discovery is not None:  # (its first answer is in before the wait for health reports)
            self.loop.run(self.discovery.refresh(), timeout=60)
            every = self.config.discover_interval_s
            self._discovering = self.loop.invoke(lambda: asyncio.ensure_future(self.discovery.run(every)))
        self.pool.wait_reported(self.config.startup_wait_s)
        if self.dispatcher.planner is not None:
            self._planning = self.loop.invoke(lambda: asyncio.ensure_future(self.dispatcher.planner.run()))
        self.loop.run(self.http.start(), timeout=10)

    def _planner(self, config: RouterConfig) -> PlannerLoop:
        """The SLO planner, fed by the router's own latencies (its metrics' window)."""
        window = self.dispatcher.metrics.window = Window()
        planner = Planner(
            config.slo_ttft_ms / 1000, config.slo_itl_ms / 1000, config.planner_patience, config.planner_min_dwell_s
        )
        metrics = self.dispatcher.metrics
        return PlannerLoop(
            self.pool, planner, window, config.planner_interval_s, config.planner_migrate,
            on_move=lambda m: metrics.planner_switched(m.old, m.role, m.reason),
        )  # fmt: skip

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop taking requests, give those in flight (gRPC and HTTP) `grace_s` to finish, then
        cancel whatever is still open upstream."""
        if self._stopped:
            return
        self._stopped = True
        if self.health is not None:
            self.health.enter_graceful_shutdown()
        self.loop.run(self._stop(grace_s), timeout=grace_s + 60)
        self._halt_loop()
        if self.metrics_server is not None:
            self.metrics_server.stop()

    async def _stop(self, grace_s: float) -> None:
        servers = [s for s in (self.server, self.admin_server) if s is not None]
        grpc_stopped = asyncio.gather(*(s.server.stop(grace_s + STOP_SLACK_S) for s in servers))
        self.http.stop_accepting(grace_s)
        await self.dispatcher.wait_idle(grace_s)
        self.dispatcher.cancel_all(ROUTER_STOPPING)
        await self.http.stop()
        await grpc_stopped
        await self.dispatcher.aclose()
        for task in (self._discovering, self._planning):
            if task is not None:
                task.cancel()
        await self.pool.aclose()

    def _abandon(self) -> None:
        """Undo a construction that failed half way."""
        if self.metrics_server is not None:
            self.metrics_server.stop()
        for server in (self.server, self.admin_server):
            if server is not None:
                server.stop(0)
        if self.http is not None:
            self.http.sock.close()
        if self.pool is not None:
            self.pool.close()
        self._halt_loop()

    def _halt_loop(self) -> None:
        """Stop the loop's thread but leave the loop open: grpc.aio has one poller for every loop of
        the process and hands each completion to its call's loop with call_soon_threadsafe; one
        arriving late for a closed loop raises in whichever loop is handling the batch (logged,
        and the rest of the batch waits for the next event)."""
        self.loop.loop.call_soon_threadsafe(self.loop.loop.stop)

    def _update_health(self) -> None:
        """The router is SERVING (overall and Generation) while it is not draining and some request
        could be routed. Decided on the loop, where health watches and Admin calls change it, so the
        changes apply in the order they happened."""
        if self.health is None:
            return
        if not self.loop.on_loop:
            self.loop.call(self._update_health)
            return
        serving = self.dispatcher.accepting()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", "kvbridge.v1.Generation"):
            self.health.set(service, status)


def check_client_certs(config: RouterConfig, security: Security) -> None:
    """ValueError when --client-cert-reqs would let clients without a certificate past mutual TLS
    unauthenticated (no API key) or onto Admin (no port of its own)."""
    if not security.mutual or config.client_cert_reqs == "required":
        return
    why = f"--client-cert-reqs {config.client_cert_reqs} takes clients without a certificate"
    if not security.api_key:
        raise ValueError(f"{why}: give --api-key-file, which they must send")
    if config.admin_port < 0:
        raise ValueError(f"{why} on --port, where Admin is served: give --admin-port (Admin keeps mutual TLS there)")


def start_router(config: RouterConfig) -> Router:
    """Bind every port, watch the nodes' health (waiting at most config.startup_wait_s for every
    node's first report), and start serving."""
    router = Router(config)
    router.start()
    return router
