"""Start and stop a router: node pool, dispatcher, gRPC server, HTTP server, metrics server."""

from __future__ import annotations

import threading

from grpc_health.v1 import health_pb2

from kvbridge import rpc
from kvbridge.metrics import MetricsServer
from kvbridge.v1 import admin_pb2_grpc, generation_pb2_grpc
from router.config import RouterConfig
from router.dispatch import ROUTER_STOPPING, Dispatcher
from router.http import HTTPFront
from router.pool import NodePool
from router.service import SERVICES, AdminService, GenerationService


class Router:
    """A running router. `port`, `http_port` and `metrics_port` are the bound ports (useful with 0
    in the config); metrics_port is -1 when metrics are off."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.pool = NodePool(config.nodes, health_retry_s=config.health_retry_s)
        self.dispatcher = Dispatcher(self.pool, config)
        self.metrics_server: MetricsServer | None = None
        self._health_lock = threading.Lock()
        try:  # HTTP first: a bad host fails here with a clean message (gRPC's core also logs its own)
            self.http = HTTPFront(config.host, config.http_port, self.dispatcher)
        except ValueError:
            self.pool.close()
            raise
        services = [
            (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationService(self.dispatcher)),
            (admin_pb2_grpc.add_AdminServicer_to_server, AdminService(self.dispatcher, config, self._update_health)),
        ]
        try:
            self.server, self.port, self.health = rpc.make_server(
                config.host, config.port, services, SERVICES, max_workers=config.grpc_workers
            )
        except ValueError:  # the port cannot be bound
            self.http.server.server_close()
            self.pool.close()
            raise ValueError(f"cannot bind {config.host}:{config.port} for gRPC") from None
        if config.metrics_port >= 0:
            try:
                self.metrics_server = MetricsServer(config.host, config.metrics_port, self.dispatcher.metrics.registry)
            except ValueError:
                self.server.stop(None)
                self.http.server.server_close()
                self.pool.close()
                raise
        self.http_port = self.http.port
        self.metrics_port = self.metrics_server.port if self.metrics_server is not None else -1
        self._update_health()
        self.pool.add_listener(self._update_health)

    def start(self) -> None:
        self.pool.start()
        self.pool.wait_reported(self.config.startup_wait_s)
        self.server.start()
        self.http.start()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop taking requests, give gRPC streams in flight `grace_s` to finish, then cancel
        whatever is still open upstream (HTTP streams included)."""
        self.health.enter_graceful_shutdown()
        self.http.stop()
        self.server.stop(grace_s).wait()
        self.health.close()
        self.dispatcher.cancel_all(ROUTER_STOPPING)
        self.dispatcher.close()
        self.pool.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()

    def _update_health(self) -> None:
        """The router is SERVING (overall and Generation) while it is not draining and some request
        could be routed. Serialized: health watchers and Admin calls change it from their threads."""
        with self._health_lock:
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
