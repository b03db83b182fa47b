"""Every gRPC server and channel of kvbridge is made here, so that TLS and keys apply to all
of them: `configure(security)` once per process (common/security.py), and every server
presents the process's certificate (asking for a client one under mutual TLS) and checks
bearer keys in one place (KeyCheck); every channel presents it and trusts the process's CA.
Servers get health checking and reflection.

The request plane (node fronts, the router) serves on asyncio: an `AioServer` runs a
`grpc.aio` server on its own event loop thread, so a stream costs a coroutine, never a
worker thread, and Admin, Bootstrap and health answer however many streams are open.

    server = AioServer("127.0.0.1", 0, [(add_GenerationServicer_to_server, servicer)],
                       ["kvbridge.v1.Generation"])     # bound and started; server.port
    server.health.set("", SERVING)                     # from any thread
    server.loop.run(coro)                              # run a coroutine on its loop, from another thread
    server.stop(grace_s=2.0)

`make_server` is the threaded server, kept for tests' fake peers (the KV plane's receivers
are AioServers too: kv_transfer/service.py). Clients: `make_channel`
(blocking) and `make_aio_channel` (inside an event loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import ipaddress
import queue
import ssl
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvbridge.common.rpc_parse import parse_checked
from kvbridge.common.security import Security, bearer
from kvbridge.common.shown import shown as shown  # (where servers have imported it from)

MAX_MESSAGE_BYTES = 8 << 20  # every request and answer but KV pages stays far below
KV_MESSAGE_BYTES = 64 << 20  # the KV plane (KVReceiver): page chunks of up to SenderConfig.grpc_chunk_bytes
DEFAULT_DEADLINE_S = 30.0  # unary calls between kvbridge processes
# trailing metadata of a status whose fault its code does not say: a decode node that refuses the
# prefill node it was paired with (their layouts differ) answers FAILED_PRECONDITION, which to a direct
# caller is right, but it is the pair's fault, not the request's: a router tries another pair
FAULT_KEY = "kvbridge-fault"
PAIR_FAULT = ((FAULT_KEY, "pair"),)


def fault_of(e: grpc.aio.AioRpcError) -> str:
    """The fault an upstream status names in its trailing metadata ("pair"), or ""."""
    return next((value for key, value in e.trailing_metadata() or () if key == FAULT_KEY), "")


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


_security = Security()


def configure(security: Security) -> None:
    """This process's TLS and keys, for every server and channel made from now on."""
    global _security
    _security = security


def security() -> Security:
    return _security


class KeyCheck:
    """The key check of a guarded servicer: Admin needs the admin key and, on the router,
    Generation the API key (`authorization: Bearer KEY`; UNAUTHENTICATED without one,
    PERMISSION_DENIED for another). A refused call never reaches the servicer's method.

    It wraps the servicer's methods when the server is built, not as a grpc.aio
    ServerInterceptor: an interceptor runs on every call of every service, and under a burst of
    2,000 streams it cost a third more time and ended ~1% of the calls CANCELLED (measured with
    tests/e2e/test_load.py); unguarded services (Prefill, Bootstrap, KVReceiver, health) pay nothing."""

    def __init__(self, servicer, key: str):
        self._servicer, self._key = servicer, key

    def __getattr__(self, name: str):
        method = getattr(self._servicer, name)
        if not (name[:1].isupper() and callable(method)):  # RPC methods are CamelCase
            return method
        check = self._check
        if inspect.isasyncgenfunction(method):  # a server-streaming RPC

            async def stream(request, context):
                await check(context)
                async for response in method(request, context):
                    yield response

            return stream

        async def unary(request, context):
            await check(context)
            return await method(request, context)

        return unary

    async def _check(self, context) -> None:
        refusal = bearer(context.invocation_metadata(), self._key)
        if refusal == "UNAUTHENTICATED":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs an authorization: Bearer key")
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong key")


def guarded(servicer):
    """`servicer`, or its KeyCheck when this process has a key for its service."""
    from kvbridge.v1 import admin_pb2_grpc, generation_pb2_grpc

    if isinstance(servicer, admin_pb2_grpc.AdminServicer) and _security.admin_key:
        return KeyCheck(servicer, _security.admin_key)
    if isinstance(servicer, generation_pb2_grpc.GenerationServicer) and _security.api_key:
        return KeyCheck(servicer, _security.api_key)
    return servicer


def _bind(server, host: str, port: int, client_certs: str = "required") -> int:
    """Add the listening port (TLS under `configure`); its number, 0 when it cannot be bound.
    client_certs: what the port asks of clients under mutual TLS (security.CLIENT_CERT_REQS). grpcio
    can only require a certificate or not ask for one: "optional" asks for none, like "none"."""
    addr = f"{host}:{port}"
    try:
        if not _security.tls:
            return server.add_insecure_port(addr)
        cert, key, ca = _security.pem()
        required = _security.client_certs(client_certs) == ssl.CERT_REQUIRED
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=required)
        return server.add_secure_port(addr, creds)
    except RuntimeError:  # grpcio >= 1.6x raises instead of returning 0
        return 0


def _channel_credentials() -> grpc.ChannelCredentials:
    cert, key, ca = _security.pem()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *SERVER_OPTIONS,
    ]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *CHANNEL_OPTIONS,
    ]


SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    # let peers' keepalive pings through (see make_channel): a silent dead host is found in seconds
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
CHANNEL_OPTIONS = [
    # a peer whose host vanished (no reset) is declared dead within ~15 s: a ping every 10 s, also
    # while no call is sending data (health watches), answered within 5 s
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a node restarted on the same address is seen again within seconds, not minutes
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


class EventLoop:
    """An asyncio event loop running on a thread of its own: where a process's request plane
    lives. Other threads hand it work with `run` (wait for a coroutine's result) or `call`
    (schedule a plain function); code already on the loop awaits directly."""

    def __init__(self, name: str = "kvbridge-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def on_loop(self) -> bool:
        """The caller runs on this loop's thread (where blocking on the loop would deadlock)."""
        return threading.current_thread() is self._thread

    def run(self, coro: Awaitable, timeout: float | None = None):
        """Run `coro` on the loop and wait for its result (from another thread only)."""
        assert not self.on_loop, "EventLoop.run called on its own thread: await instead"
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None

    def invoke(self, fn: Callable, *args, timeout: float | None = 10.0):
        """Run plain `fn(*args)` on the loop and return its result (at once when already on the loop)."""
        if self.on_loop:
            return fn(*args)

        async def call():
            return fn(*args)

        return self.run(call(), timeout)

    def call(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` on the loop soon (from any thread); a closed loop drops it."""
        if self.on_loop:
            fn(*args)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is stopping
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        """Halt the loop's thread. The loop is left open, not closed: grpc.aio has one poller per
        process that hands late events to their loop with call_soon_threadsafe, and one for a
        closed loop would raise inside whichever other loop is handling that batch."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class AioHealth:
    """An AioServer's grpc.health.v1 statuses. `set` may be called from any thread: the change is
    applied on the loop, in call order; callers off the loop wait for it (at most `wait_s`)."""

    def __init__(self, servicer, loop: EventLoop):
        self.servicer, self.loop = servicer, loop
        self._tail: asyncio.Future | None = None  # the last change scheduled: each waits for the one before

    def set(self, service: str, status, wait_s: float = 1.0) -> None:
        self._apply(lambda: self.servicer.set(service, status), wait_s)

    def enter_graceful_shutdown(self, wait_s: float = 1.0) -> None:
        """Every service NOT_SERVING for good."""
        self._apply(self.servicer.enter_graceful_shutdown, wait_s)

    def _apply(self, change: Callable[[], Awaitable], wait_s: float) -> None:
        done = threading.Event()

        def schedule() -> None:
            before = self._tail

            async def apply() -> None:
                if before is not None:
                    await asyncio.shield(before)
                await change()
                done.set()

            self._tail = asyncio.ensure_future(apply())

        if self.loop.on_loop:
            schedule()
        else:
            self.loop.call(schedule)
            done.wait(wait_s)


class AioServer:
    """A grpc.aio server bound to host:port (0 = a free port) and started, on its own event loop
    (or on `loop`, shared with other servers of the process). `port` is the bound port; `health`
    starts SERVING for "" and every named service (NOT_SERVING with serving=False). ValueError
    when the address cannot be bound. `client_certs`: what the port asks of clients under mutual
    TLS (see _bind); only the router's client-facing port asks for less than a certificate."""

    def __init__(
        self,
        host: str,
        port: int,
        services: Sequence[tuple[Callable, object]],
        service_names: Sequence[str],
        serving: bool = True,
        loop: EventLoop | None = None,
        name: str = "kvbridge-grpc",
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        client_certs: str = "required",
    ):
        self._own_loop = loop is None
        self.loop = loop or EventLoop(name)
        start = self._start(host, port, services, service_names, serving, max_message_bytes, client_certs)
        try:
            self.server, self.port, servicer = self.loop.run(start)
        except BaseException:
            if self._own_loop:
                self.loop.stop()
            raise
        self.health = AioHealth(servicer, self.loop)

    async def _start(self, host, port, services, service_names, serving, max_message_bytes, client_certs):
        server = grpc.aio.server(options=server_options(max_message_bytes))
        for add, servicer in services:
            parse_checked(add, guarded(servicer), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        initial = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *service_names):
            await health_servicer.set(name, initial)
        reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        bound = _bind(server, host, port, client_certs)
        if bound == 0:
            raise ValueError(f"cannot bind {host}:{port}")
        await server.start()
        return server, bound, health_servicer

    def stop(self, grace_s: float | None = 2.0) -> None:
        """Stop serving: calls in flight get `grace_s` to finish, then are cancelled."""
        if not self.loop.running:
            return
        with contextlib.suppress(TimeoutError, RuntimeError):
            self.loop.run(self.server.stop(grace_s), timeout=(grace_s or 0) + 10)
        if self._own_loop:
            self.loop.stop()


def make_server(
    host: str,
    port: int,
    services: Sequence[tuple[Callable, object]],
    service_names: Sequence[str],
    max_workers: int = 32,
    serving: bool = True,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[grpc.Server, int, Health]:
    """A started-later server bound to host:port (0 = a free port); returns it, the bound port, and
    its health (every named service and "" start SERVING, or NOT_SERVING with serving=False)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvbridge-grpc"),
        options=server_options(max_message_bytes),
    )
    for add, servicer in services:
        add(servicer, server)
    health_servicer = _HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    initial = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        health_servicer.set(name, initial)  # no Watch stream yet: nothing can block
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = _bind(server, host, port)
    if bound == 0:
        raise ValueError(f"cannot bind {host}:{port}")
    return server, bound, Health(health_servicer)


def make_channel(addr: str, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    options = channel_options(max_message_bytes)
    if _security.tls:
        return grpc.secure_channel(addr, _channel_credentials(), options=options)
    return grpc.insecure_channel(addr, options=options)


def make_aio_channel(addr: str) -> grpc.aio.Channel:
    """A channel for coroutines (call it on the event loop that will use it)."""
    if _security.tls:
        return grpc.aio.secure_channel(addr, _channel_credentials(), options=channel_options())
    return grpc.aio.insecure_channel(addr, options=channel_options())


def peer_host(peer: str) -> str:
    """The host of a caller as a servicer's context.peer() names it: "ipv4:10.0.0.5:41234" and
    "ipv6:[::ffff:10.0.0.5]:41234" are "10.0.0.5", "ipv6:%5B::1%5D:41234" is "::1"; anything else
    (a unix socket) as it is. Per-caller limits count by it."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    host = rest.rpartition(":")[0].strip("[]")
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host)
        return str(getattr(ip, "ipv4_mapped", None) or ip)
    return host


def page_offset(token: str) -> int | None:
    """The offset in a page_token we issued ("" = 0), or None for anything else."""
    token = token or "0"
    return int(token) if token.isascii() and token.isdigit() and len(token) <= 4000 else None  # (int() caps digits)
