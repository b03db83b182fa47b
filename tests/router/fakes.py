"""In-test nodes that follow the contract, for the router's tests: FakeNode serves Generation (a
colocated or decode node) or Prefill (a prefill node) on a free port, fails, stalls or holds on
cue, and records what it received; fake decode nodes wait on the room their paired prefill node
prefilled (Rooms). Plus the requests and waits the router tests share. The `fleet` fixture that
puts a router in front of them is in tests/router/conftest.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from common import rpc
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc


@dataclass
class Rooms:
    """What the fake prefill nodes did, by room; fake decode nodes wait on it like real ones."""

    prefilled: dict[int, str] = field(default_factory=dict)  # room -> address of the P that prefilled it
    cond: threading.Condition = field(default_factory=threading.Condition)


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams `tokens` tokens (ids 100, 101, ..., text "t0 t1 ..."), one per message, then a last
    message with finish_reason and usage, as a colocated or decode node does."""

    def __init__(self, node: FakeNode):
        self.node = node

    def Generate(self, request, context):
        node = self.node
        node.requests.append(request)
        node.arrived.append(time.monotonic())

        def ended() -> None:
            if request.rid not in node.completed:
                node.cancelled.append(request.rid)

        if not context.add_callback(ended):  # the call ended before this handler ran (cancelled early)
            ended()
        if request.prompt.WhichOneof("kind") is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        first = time.monotonic() + node.first_s  # "prefill": nothing is sent until then
        while context.is_active() and time.monotonic() < first:
            time.sleep(0.01)
        if node.fail is not None and not node.fail_after:
            context.abort(node.fail, f"{node.address} fails as told")
        if request.HasField("prefill"):  # decode node: the KV comes from the paired prefill node
            room, deadline = request.prefill.room, time.monotonic() + 10
            with node.rooms.cond:
                while room not in node.rooms.prefilled and context.is_active() and time.monotonic() < deadline:
                    node.rooms.cond.wait(0.02)
            if node.rooms.prefilled.get(room) != request.prefill.prefill_addr:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"room {room} never arrived")
        n = request.sampling.max_new_tokens or node.tokens
        for i in range(n):
            if not context.is_active():
                return
            if node.fail is not None and i == node.fail_after:
                context.abort(node.fail, f"{node.address} fails as told after {i} tokens")
            if i == node.stall_after:  # hang (until cancelled)
                while context.is_active():
                    time.sleep(0.01)
                return
            time.sleep(node.token_s)
            yield generation_pb2.GenerateResponse(rid=request.rid, token_ids=[100 + i], text=f"t{i} ")
        node.completed.append(request.rid)
        yield generation_pb2.GenerateResponse(
            rid=request.rid,
            finish_reason="length",
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt.token_ids.ids), completion_tokens=n),
        )

    def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(model="fake", fingerprint="f00", max_context=64, role=self.node.role)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, node: FakeNode):
        self.node = node

    def Prefill(self, request, context):
        node = self.node
        node.requests.append(request)
        if node.hold is not None:  # stay busy until cancelled or released
            while context.is_active() and not node.hold.wait(0.02):
                pass
            if not context.is_active():
                node.cancelled.append(request.rid)
                return prefill_pb2.PrefillResponse()
        if node.fail is not None and node.fail_late_s is None:
            context.abort(node.fail, f"{node.address} fails as told")
        with node.rooms.cond:
            node.rooms.prefilled[request.room] = node.address
            node.rooms.cond.notify_all()
        if node.fail is not None:  # the KV went out; the call fails while the pushes would settle
            time.sleep(node.fail_late_s)
            context.abort(node.fail, f"{node.address} fails late as told")
        return prefill_pb2.PrefillResponse(rid=request.rid, prompt_tokens=3, first_token=100)


class FakeNode:
    def __init__(self, role: str, rooms: Rooms, tokens: int = 4, token_s: float = 0.0, first_s: float = 0.0):
        self.role, self.rooms = role, rooms
        self.tokens, self.token_s, self.first_s = tokens, token_s, first_s  # tokens per request, seconds
        self.requests: list = []  # every request received, in order
        self.arrived: list[float] = []  # time.monotonic() of each Generate's arrival
        self.cancelled: list[str] = []  # rids whose call ended before its last message (cancel, deadline, abort)
        self.completed: list[str] = []  # rids whose stream was produced to the end
        self.fail: grpc.StatusCode | None = None  # abort every request with this code
        self.fail_after = 0  # ... after this many tokens
        self.fail_late_s: float | None = None  # prefill: fail only this long after the room was prefilled
        self.stall_after: int | None = None  # stream this many tokens, then send nothing until cancelled
        self.hold: threading.Event | None = None  # prefill: block until set or cancelled
        if role == "prefill":
            services = [(prefill_pb2_grpc.add_PrefillServicer_to_server, FakePrefill(self))]
            names = ["kvbridge.v1.Prefill"]
        else:
            services = [(generation_pb2_grpc.add_GenerationServicer_to_server, FakeGeneration(self))]
            names = ["kvbridge.v1.Generation"]
        self.server, port, self.health = rpc.make_server("127.0.0.1", 0, services, names)
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def set_serving(self, serving: bool) -> None:
        s = health_pb2.HealthCheckResponse
        name = "kvbridge.v1.Prefill" if self.role == "prefill" else "kvbridge.v1.Generation"
        self.health.set(name, s.SERVING if serving else s.NOT_SERVING)

    def stop(self) -> None:
        self.server.stop(None).wait()


def make_request(ids=(1, 2, 3), **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=list(ids))),
        sampling=common_pb2.SamplingParams(**sampling),
    )


def router_stub(router) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))


def generate(router, **kw) -> list[generation_pb2.GenerateResponse]:
    return list(router_stub(router).Generate(make_request(**kw), timeout=30))


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
