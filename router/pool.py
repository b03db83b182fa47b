"""The router's view of its nodes: health, outstanding requests, and which node gets the next one.

Each node has a watcher thread holding a `grpc.health.v1.Health/Watch` stream on the service its
role needs (Generation for colocated and decode nodes, Prefill for prefill nodes). A node is
eligible while its last report was SERVING; NOT_SERVING, SERVICE_UNKNOWN or an unreachable node
make it ineligible until a later report says SERVING. Among eligible nodes the one with the fewest
outstanding requests (counted here, by the router) wins; ties go round-robin, so equal nodes
share the traffic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge import rpc
from kvbridge.v1 import generation_pb2, generation_pb2_grpc

SERVICE_OF_ROLE = {
    "colocated": "kvbridge.v1.Generation",
    "decode": "kvbridge.v1.Generation",
    "prefill": "kvbridge.v1.Prefill",
}
WATCH_DEADLINE_S = 60.0  # a health stream is re-opened this often (every call has a deadline)
MODEL_INFO_DEADLINE_S = 5.0


@dataclass(eq=False)
class Node:
    role: str  # "colocated" | "prefill" | "decode"
    address: str  # host:port of the node's gRPC server
    channel: grpc.Channel | None = None  # None only in tests of the selection logic
    healthy: bool = False  # the last health report was SERVING
    reported: bool = False  # a health report (or a failure to get one) has arrived
    outstanding: int = 0  # requests routed here and not finished yet
    routed: int = 0  # requests routed here since the router started
    model: generation_pb2.ModelInfo | None = None  # GetModelInfo, fetched when it turns healthy (not prefill)
    watch: grpc.Future | None = field(default=None, repr=False)  # the health stream, to cancel on close

    @property
    def key(self) -> str:
        return f"{self.role}/{self.address}"


class NodePool:
    def __init__(self, nodes: list[tuple[str, str]], health_retry_s: float = 1.0, connect: bool = True):
        """nodes: (role, address) pairs. connect=False makes channel-less nodes (selection tests)."""
        self.nodes = [Node(role, addr, rpc.make_channel(addr) if connect else None) for role, addr in nodes]
        self.health_retry_s = health_retry_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._turns: dict[tuple[str, ...], int] = {}  # round-robin position per role set
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listeners: list[Callable[[], None]] = []  # called (outside the lock) after a health change

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

    # ------------------------------------------------------------------ health

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def set_health(self, node: Node, healthy: bool) -> None:
        with self._lock:
            changed = node.healthy != healthy or not node.reported
            node.healthy, node.reported = healthy, True
            self._changed.notify_all()
        if changed:
            for callback in self._listeners:
                callback()

    def start(self) -> None:
        for node in self.nodes:
            t = threading.Thread(target=self._watch, args=(node,), name=f"kvbridge-health-{node.address}", daemon=True)
            t.start()
            self._threads.append(t)

    def wait_reported(self, timeout: float) -> bool:
        """Block until every node has had a first health report, at most `timeout` seconds."""
        with self._lock:
            return self._changed.wait_for(lambda: all(n.reported for n in self.nodes), timeout)

    def close(self) -> None:
        self._closed.set()
        for node in self.nodes:
            if node.watch is not None:
                node.watch.cancel()
            if node.channel is not None:
                node.channel.close()
        for t in self._threads:
            t.join(timeout=5)

    def _watch(self, node: Node) -> None:
        stub = health_pb2_grpc.HealthStub(node.channel)
        request = health_pb2.HealthCheckRequest(service=SERVICE_OF_ROLE[node.role])
        while not self._closed.is_set():
            try:
                node.watch = stub.Watch(request, timeout=WATCH_DEADLINE_S)
                for resp in node.watch:
                    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and not node.healthy and node.role != "prefill":
                        node.model = self._model_info(node)  # (re)started: it may serve another model now
                    self.set_health(node, serving)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the stream's own deadline: the last report still holds
                if self._closed.is_set():
                    return
                self.set_health(node, False)
            self._closed.wait(self.health_retry_s)

    def _model_info(self, node: Node) -> generation_pb2.ModelInfo | None:
        try:
            stub = generation_pb2_grpc.GenerationStub(node.channel)
            return stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_DEADLINE_S)
        except grpc.RpcError:
            return None
