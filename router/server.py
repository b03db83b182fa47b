"""Start and stop a router: node pool, dispatcher, gRPC server, HTTP server."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from kvbridge import rpc
from kvbridge.v1 import admin_pb2_grpc, generation_pb2_grpc
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.http import HTTPFront
from router.pool import NodePool
from router.service import SERVICES, AdminService, GenerationService


class Router:
    """A running router. `port` and `http_port` are the bound ports (useful with 0 in the config)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.pool = NodePool(config.nodes, health_retry_s=config.health_retry_s)
        self.dispatcher = Dispatcher(self.pool, config.request_timeout_s)
        try:  # HTTP first: a bad host fails here with a clean message (gRPC's core also logs its own)
            self.http = HTTPFront(config.host, config.http_port, self.dispatcher)
        except ValueError:
            self.pool.close()
            raise
        services = [
            (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationService(self.dispatcher)),
            (admin_pb2_grpc.add_AdminServicer_to_server, AdminService(self.dispatcher)),
        ]
        try:
            self.server, self.port, self.health = rpc.make_server(
                config.host, config.port, services, SERVICES, max_workers=config.grpc_workers
            )
        except ValueError:  # the port cannot be bound
            self.http.server.server_close()
            self.pool.close()
            raise ValueError(f"cannot bind {config.host}:{config.port} for gRPC") from None
        self.http_port = self.http.port
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
        self.pool.close()

    def _update_health(self) -> None:
        """The router's Generation is SERVING while some request could be routed."""
        serving = self.dispatcher.can_route()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("kvbridge.v1.Generation", status)


def start_router(config: RouterConfig) -> Router:
    """Bind both ports, watch the nodes' health (waiting at most config.startup_wait_s for every
    node's first report), and start serving."""
    router = Router(config)
    router.start()
    return router
