"""The router's view of its nodes: health, outstanding requests, and which node gets the next one.

Each node has a watcher thread holding a `grpc.health.v1.Health/Watch` stream on the service its
role needs (Generation for colocated and decode nodes, Prefill for prefill nodes). A node is
eligible while its last report was SERVING; NOT_SERVING, SERVICE_UNKNOWN or an unreachable node
make it ineligible until a later report says SERVING. Among eligible nodes the one with the fewest
outstanding requests (counted here, by the router) wins; ties go round-robin, so equal nodes
share the traffic.

The fleet can change at run time: `add` watches a new node at once, `remove` takes one out of
selection at once. A node's channel is closed only when nothing can use it any more: it was
removed (or the pool closed), its watcher has ended, and every request routed to it was released.
(Starting an RPC on a closed channel crashes the process in grpcio, so this order is a must.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge import rpc
from kvbridge.rpc import shown
from kvbridge.v1 import generation_pb2, generation_pb2_grpc
from router.config import parse_address

SERVICE_OF_ROLE = {
    "colocated": "kvbridge.v1.Generation",
    "prefill": "kvbridge.v1.Prefill",
    "decode": "kvbridge.v1.Generation",
}
ROLES = tuple(SERVICE_OF_ROLE)
WATCH_DEADLINE_S = 60.0  # a health stream is re-opened this often (every call has a deadline)
MODEL_INFO_DEADLINE_S = 5.0
WATCHER_JOIN_S = 5.0  # close() waits this long at most for each watcher thread


@dataclass(eq=False)
class Node:
    role: str  # "colocated" | "prefill" | "decode"
    address: str  # host:port of the node's gRPC server
    channel: grpc.Channel | None = None  # None only in tests of the selection logic
    healthy: bool = False  # the last health report was SERVING
    reported: bool = False  # a health report (or a failure to get one) has arrived
    outstanding: int = 0  # requests routed here and not finished yet
    routed: int = 0  # requests routed here since it was added
    model: generation_pb2.ModelInfo | None = None  # GetModelInfo, fetched when it turns healthy (not prefill)
    watch: grpc.Future | None = field(default=None, repr=False)  # the health stream, to cancel on close
    retired: bool = False  # removed from the pool (or the pool closed): its channel closes once idle
    watching: bool = False  # its watcher thread is running (and may start RPCs on the channel)
    stopped: threading.Event = field(default_factory=threading.Event, repr=False)  # ends its watcher

    @property
    def key(self) -> str:
        return f"{self.role}/{self.address}"


class NodePool:
    def __init__(self, nodes: list[tuple[str, str]], health_retry_s: float = 1.0, connect: bool = True):
        """nodes: (role, address) pairs. connect=False makes channel-less nodes (selection tests)."""
        self.health_retry_s = health_retry_s
        self.connect = connect
        self.nodes: list[Node] = []  # replaced, never mutated in place: a reader may iterate it unlocked
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._turns: dict[tuple[str, ...], int] = {}  # round-robin position per role set
        self._started = False  # watchers run (start() was called); add() starts a new node's at once
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._listeners: list[Callable[[], None]] = []  # called (outside the lock) after a change
        for role, address in nodes:
            self.add(role, address)

    # ------------------------------------------------------------------ the fleet

    def add(self, role: str, address: str) -> Node:
        """A new node, eligible once its first health report says SERVING. ValueError on a bad
        role or address, or a (role, address) already in the pool."""
        if role not in SERVICE_OF_ROLE:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        parse_address(address, role)
        with self._lock:
            if self._closed:
                raise ValueError("the node pool is closed")
            if any(n.role == role and n.address == address for n in self.nodes):
                raise ValueError(f"a {role} node {address!r} is already in the pool")
            node = Node(role, address, rpc.make_channel(address) if self.connect else None)
            self.nodes = [*self.nodes, node]
            start = self._started and node.channel is not None
            node.watching = start
        if start:
            self._start_watcher(node)
        self._notify()
        return node

    def remove(self, address: str, role: str = "") -> Node:
        """Take a node out of the pool: no request is routed to it from now on, its health watch
        ends, and its channel closes once the requests it is serving end. role "" = whichever
        role `address` has. KeyError when no such node; ValueError when role is bad or "" is
        ambiguous (the address is in the pool under two roles)."""
        if role and role not in SERVICE_OF_ROLE:
            raise ValueError(f"role must be one of {', '.join(ROLES)} (or empty), got {shown(role)}")
        parse_address(address)
        with self._lock:
            found = [n for n in self.nodes if n.address == address and (not role or n.role == role)]
            if not found:
                raise KeyError(f"no {role + ' ' if role else ''}node {shown(address)} in the pool")
            if len(found) > 1:
                roles = " and ".join(n.role for n in found)
                raise ValueError(f"{shown(address)} is in the pool as {roles}: say which role to remove")
            [node] = found
            self.nodes = [n for n in self.nodes if n is not node]
            node.retired = True
        self._stop_watcher(node)
        self._close_if_idle(node)
        self._notify()
        return node

    # ------------------------------------------------------------------ selection and accounting

    def acquire(self, roles: Collection[str], exclude: Collection[Node] = ()) -> Node | None:
        """The eligible node of one of `roles` with the fewest outstanding requests (ties
        round-robin), counted as outstanding from now on; None when none is eligible."""
        with self._lock:
            live = [n for n in self.nodes if n.role in roles and n.healthy and n not in exclude]
            if not live:
                return None
            low = min(n.outstanding for n in live)
            tied = [n for n in live if n.outstanding == low]
            turn = tuple(sorted(roles))
            node = tied[self._turns.get(turn, 0) % len(tied)]
            self._turns[turn] = self._turns.get(turn, 0) + 1
            node.outstanding += 1
            node.routed += 1
            return node

    def release(self, node: Node) -> None:
        with self._lock:
            assert node.outstanding > 0, f"release of {node.key} with nothing outstanding"
            node.outstanding -= 1
        self._close_if_idle(node)

    def has_eligible(self, role: str, exclude: Collection[Node] = ()) -> bool:
        with self._lock:
            return any(n.healthy for n in self.nodes if n.role == role and n not in exclude)

    def outstanding(self) -> dict[str, int]:
        """Outstanding requests per node, keyed role/address."""
        with self._lock:
            return {n.key: n.outstanding for n in self.nodes}

    def models(self) -> list[generation_pb2.ModelInfo]:
        """ModelInfo of the healthy nodes that serve Generation, one per distinct model name."""
        with self._lock:
            infos = [n.model for n in self.nodes if n.healthy and n.model is not None]
        return list({m.model: m for m in infos}.values())

    def agreed_model(self) -> generation_pb2.ModelInfo | None:
        """The model every healthy Generation node reports (same name and fingerprint); None when
        they differ or none has reported one."""
        with self._lock:
            infos = [n.model for n in self.nodes if n.healthy and n.model is not None]
        return infos[0] if len({(m.model, m.fingerprint) for m in infos}) == 1 else None

    # ------------------------------------------------------------------ health

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` after every change of a node's health and every add or remove."""
        self._listeners.append(callback)

    def set_health(self, node: Node, healthy: bool) -> None:
        with self._lock:
            changed = node.healthy != healthy or not node.reported
            node.healthy, node.reported = healthy, True
            self._changed.notify_all()
        if changed:
            self._notify()

    def start(self) -> None:
        with self._lock:
            self._started = True
            watched = [n for n in self.nodes if n.channel is not None]
            for node in watched:
                node.watching = True
        for node in watched:
            self._start_watcher(node)

    def wait_reported(self, timeout: float) -> bool:
        """Block until every node has had a first health report, at most `timeout` seconds."""
        with self._lock:
            return self._changed.wait_for(lambda: all(n.reported for n in self.nodes), timeout)

    def close(self) -> None:
        """Stop every watcher; each channel closes once the requests still using it are released
        (cancel them first to close everything now)."""
        with self._lock:
            self._closed = True
            nodes, self.nodes = self.nodes, []
            for node in nodes:
                node.retired = True
        for node in nodes:
            self._stop_watcher(node)
        for t in self._threads:
            t.join(timeout=WATCHER_JOIN_S)
        for node in nodes:
            self._close_if_idle(node)

    # ------------------------------------------------------------------ internals

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    def _start_watcher(self, node: Node) -> None:
        t = threading.Thread(target=self._watch, args=(node,), name=f"kvbridge-health-{node.address}", daemon=True)
        with self._lock:
            self._threads = [*(old for old in self._threads if old.is_alive()), t]
        t.start()

    def _stop_watcher(self, node: Node) -> None:
        node.stopped.set()
        if node.watch is not None:
            node.watch.cancel()

    def _close_if_idle(self, node: Node) -> None:
        """Close a retired node's channel once no request and no watcher can use it (once only)."""
        with self._lock:
            idle = node.retired and node.outstanding == 0 and not node.watching and node.channel is not None
            channel = node.channel if idle else None
            if idle:
                node.channel = None
        if channel is not None:
            channel.close()

    def _watch(self, node: Node) -> None:
        try:
            self._watch_health(node)
        finally:
            with self._lock:
                node.watching = False
            self._close_if_idle(node)

    def _watch_health(self, node: Node) -> None:
        stub = health_pb2_grpc.HealthStub(node.channel)
        request = health_pb2.HealthCheckRequest(service=SERVICE_OF_ROLE[node.role])
        while not node.stopped.is_set():
            try:
                node.watch = stub.Watch(request, timeout=WATCH_DEADLINE_S)
                if node.stopped.is_set():  # stopped while the stream was being opened
                    node.watch.cancel()
                for resp in node.watch:
                    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and not node.healthy and node.role != "prefill":
                        node.model = self._model_info(node)  # (re)started: it may serve another model now
                    self.set_health(node, serving)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the stream's own deadline: the last report still holds
                if node.stopped.is_set():
                    return
                self.set_health(node, False)
            node.stopped.wait(self.health_retry_s)

    def _model_info(self, node: Node) -> generation_pb2.ModelInfo | None:
        try:
            stub = generation_pb2_grpc.GenerationStub(node.channel)
            return stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_DEADLINE_S)
        except grpc.RpcError:
            return None
