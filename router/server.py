"""Start and stop a router: one event loop (its own thread) runs the node pool's health watches,
the dispatcher's requests, the gRPC server (grpc.aio) and the HTTP server (uvicorn). Only the
metrics server (common.metrics, scraped now and then) keeps a thread of its own."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from common import rpc
from common.metrics import MetricsServer
from kvbridge.v1 import admin_pb2_grpc, generation_pb2_grpc
from router.config import RouterConfig
from router.discovery import Discovery, parse_target
from router.dispatch import Dispatcher
from router.http import HTTPFront
from router.pool import NodePool
from router.routed import ROUTER_STOPPING
from router.service import SERVICES, AdminService, GenerationService

STOP_SLACK_S = 1.0  # gRPC calls still open this long after the grace period (and the cancels) are cut


class Router:
    """A running router. `port`, `http_port` and `metrics_port` are the bound ports (useful with 0
    in the config); metrics_port is -1 when metrics are off."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.loop = rpc.EventLoop("kvbridge-router")
        self.pool: NodePool | None = None
        self.http: HTTPFront | None = None
        self.server: rpc.AioServer | None = None
        self.metrics_server: MetricsServer | None = None
        self._stopped = False
        try:
            rpc.security().fleet()  # (read now: a fleet key file that cannot be read fails the start, not a request)
            self.pool = NodePool(config.nodes, config.health_retry_s, self.loop, policy=config.policy)
            targets = [parse_target(spec) for spec in config.discover]
            self.discovery = Discovery(self.pool, targets) if targets else None
            self._discovering: asyncio.Task | None = None
            self.dispatcher = Dispatcher(self.pool, config)
            # HTTP first: a bad host fails here with a clean message (gRPC's core also logs its own)
            self.http = HTTPFront(config, self.dispatcher)
            admin = AdminService(self.dispatcher, config, self._update_health)
            services = [
                (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationService(self.dispatcher)),
                (admin_pb2_grpc.add_AdminServicer_to_server, admin),
            ]
            try:
                self.server = rpc.AioServer(config.host, config.port, services, SERVICES, serving=False, loop=self.loop)
            except ValueError:
                raise ValueError(f"cannot bind {config.host}:{config.port} for gRPC") from None
            if config.metrics_port >= 0:
                self.metrics_server = MetricsServer(config.host, config.metrics_port, self.dispatcher.metrics.registry)
        except BaseException:
            self._abandon()
            raise
        self.port = self.server.port
        self.health = self.server.health
        self.http_port = self.http.port
        self.metrics_port = self.metrics_server.port if self.metrics_server is not None else -1
        self._update_health()
        self.pool.add_listener(self._update_health)

    def start(self) -> None:
        self.pool.start()
        if self.discovery is not None:  # (its first answer is in before the wait for health reports)
            self.loop.run(self.discovery.refresh(), timeout=60)
            every = self.config.discover_interval_s
            self._discovering = self.loop.invoke(lambda: asyncio.ensure_future(self.discovery.run(every)))
        self.pool.wait_reported(self.config.startup_wait_s)
        self.loop.run(self.http.start(), timeout=10)

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop taking requests, give those in flight (gRPC and HTTP) `grace_s` to finish, then
        cancel whatever is still open upstream."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.loop.run(self._stop(grace_s), timeout=grace_s + 60)
        self._halt_loop()
        if self.metrics_server is not None:
            self.metrics_server.stop()

    async def _stop(self, grace_s: float) -> None:
        grpc_stopped = asyncio.ensure_future(self.server.server.stop(grace_s + STOP_SLACK_S))
        self.http.stop_accepting(grace_s)
        await self.dispatcher.wait_idle(grace_s)
        self.dispatcher.cancel_all(ROUTER_STOPPING)
        await self.http.stop()
        await grpc_stopped
        await self.dispatcher.aclose()
        if self._discovering is not None:
            self._discovering.cancel()
        await self.pool.aclose()

    def _abandon(self) -> None:
        """Undo a construction that failed half way."""
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.server is not None:
            self.server.stop(0)
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
        if not self.loop.on_loop:
            self.loop.call(self._update_health)
            return
        serving = self.dispatcher.accepting()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", "kvbridge.v1.Generation"):
            self.health.set(service, status)


def start_router(config: RouterConfig) -> Router:
    """Bind every port, watch the nodes' health (waiting at most config.startup_wait_s for every
    node's first report), and start serving."""
    router = Router(config)
    router.start()
    return router
