"""Every gRPC server and channel of kvbridge is made here, so that TLS and token
authentication (planned) land in one place. Servers get health checking and reflection.

    server, port, health = make_server("127.0.0.1", 0, [(add_GenerationServicer_to_server, servicer)],
                                       ["kvbridge.v1.Generation"])
    server.start()
    channel = make_channel(f"127.0.0.1:{port}")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 << 20  # page chunks stay far below; this bounds a hostile peer's message
DEFAULT_DEADLINE_S = 30.0  # unary calls between kvbridge processes


def make_server(
    host: str,
    port: int,
    services: Sequence[tuple[Callable, object]],
    service_names: Sequence[str],
    max_workers: int = 32,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started-later server bound to host:port (0 = a free port); returns it, the bound port, and
    its health servicer (every named service starts SERVING)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvbridge-grpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    for add, servicer in services:
        add(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio >= 1.6x raises instead of returning 0
        bound = 0
    if bound == 0:
        raise ValueError(f"cannot bind {host}:{port}")
    return server, bound, health_servicer


def make_channel(addr: str) -> grpc.Channel:
    return grpc.insecure_channel(
        addr,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # a node restarted on the same address is seen again within seconds, not minutes
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 5_000),
        ],
    )


def abort_on_cancel(context: grpc.ServicerContext, abort: Callable[[], None]) -> None:
    """Run `abort` when the call ends early (client cancel, deadline), or now if it already has:
    add_callback refuses a call that ended before the handler got to it."""
    if not context.add_callback(abort):
        abort()
