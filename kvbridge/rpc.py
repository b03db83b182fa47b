"""Every gRPC server and channel of kvbridge is made here, so that TLS and token
authentication (planned) land in one place. Servers get health checking and reflection.

    server, port, health = make_server("127.0.0.1", 0, [(add_GenerationServicer_to_server, servicer)],
                                       ["kvbridge.v1.Generation"])
    server.start()
    channel = make_channel(f"127.0.0.1:{port}")
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 << 20  # page chunks stay far below; this bounds a hostile peer's message
DEFAULT_DEADLINE_S = 30.0  # unary calls between kvbridge processes


class _HealthServicer(health.HealthServicer):
    """grpc_health's servicer without its deadlock: the library sends a status change to every Watch
    stream while holding its lock, and a stream closing at that moment runs a callback (on the
    server's event thread) that takes the same lock, so the send, which needs that thread, never
    completes. Here the lock only guards the state; sends happen outside it (Health orders them)."""

    def set(self, service, status):
        with self._lock:
            if self._gracefully_shutting_down:
                return
            self._server_status[service] = status
            callbacks = list(self._send_response_callbacks.get(service, ()))
        for send in callbacks:
            send(health_pb2.HealthCheckResponse(status=status))

    def enter_graceful_shutdown(self):
        with self._lock:
            if self._gracefully_shutting_down:
                return
            services = list(self._server_status)
        for service in services:
            self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        with self._lock:
            self._gracefully_shutting_down = True


class Health:
    """The server's grpc.health.v1 statuses, changed off the caller's thread.

    The library sends a change to every Watch stream inline, holding its lock; a stream whose
    peer went away without the server noticing yet can block that send until the server stops.
    So changes are applied by one worker thread, in order, and callers wait at most `wait_s`
    for theirs (normally it takes microseconds)."""

    def __init__(self, servicer: health.HealthServicer):
        self.servicer = servicer
        self._changes: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="kvbridge-health", daemon=True)
        self._worker.start()

    def set(self, service: str, status, wait_s: float = 1.0) -> None:
        self._apply(lambda: self.servicer.set(service, status), wait_s)

    def enter_graceful_shutdown(self, wait_s: float = 1.0) -> None:
        """Every service NOT_SERVING for good (then stop the server: that unblocks any stuck send)."""
        self._apply(self.servicer.enter_graceful_shutdown, wait_s)

    def close(self) -> None:
        self._changes.put(None)

    def _apply(self, change: Callable[[], None], wait_s: float) -> None:
        done = threading.Event()
        self._changes.put((change, done))
        done.wait(wait_s)

    def _run(self) -> None:
        while (item := self._changes.get()) is not None:
            change, done = item
            change()
            done.set()


def make_server(
    host: str,
    port: int,
    services: Sequence[tuple[Callable, object]],
    service_names: Sequence[str],
    max_workers: int = 32,
    serving: bool = True,
) -> tuple[grpc.Server, int, Health]:
    """A started-later server bound to host:port (0 = a free port); returns it, the bound port, and
    its health (every named service and "" start SERVING, or NOT_SERVING with serving=False)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvbridge-grpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # let peers' keepalive pings through (see make_channel): a silent dead host is found in seconds
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    for add, servicer in services:
        add(servicer, server)
    health_servicer = _HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    initial = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        health_servicer.set(name, initial)  # no Watch stream yet: nothing can block
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio >= 1.6x raises instead of returning 0
        bound = 0
    if bound == 0:
        raise ValueError(f"cannot bind {host}:{port}")
    return server, bound, Health(health_servicer)


def make_channel(addr: str) -> grpc.Channel:
    return grpc.insecure_channel(
        addr,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # a peer whose host vanished (no reset) is declared dead within ~15 s: a ping every 10 s, also
            # while no call is sending data (health watches), answered within 5 s
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # a node restarted on the same address is seen again within seconds, not minutes
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 5_000),
        ],
    )


def shown(value: object, limit: int = 80) -> str:
    """A client-supplied value for an error message: repr, cut to `limit` characters (a status
    message over gRPC's 8-16 KiB limit is dropped, and the client would see another code)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def page_offset(token: str) -> int | None:
    """The offset in a page_token we issued ("" = 0), or None for anything else."""
    token = token or "0"
    return int(token) if token.isascii() and token.isdigit() and len(token) <= 4000 else None  # (int() caps digits)


def abort_on_cancel(context: grpc.ServicerContext, abort: Callable[[], None]) -> None:
    """Run `abort` when the call ends early (client cancel, deadline), or now if it already has:
    add_callback refuses a call that ended before the handler got to it."""
    if not context.add_callback(abort):
        abort()
