"""In-test nodes that follow the contract, for the router's tests: FakeNode serves Generation (a
colocated or decode node) or Prefill (a prefill node) on a free port, fails, stalls or holds on
cue, and records what it received; fake decode nodes wait on the room their paired prefill node
prefilled (Rooms), but stream at once on a local route (they compute the prompt themselves). With
kv_events=True a node also serves KVEvents (its Watch streams driven by the
test through FakeKV: stores, removals, a lost batch, a lagged snapshot, a broken stream; its
GetTokenizer a real byte-level tokenizer) and Admin.ClearPrefixCache. Plus the requests and waits
the router tests share. The `fleet` fixture that
puts a router in front of them is in tests/router/conftest.py."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from kvbridge.common import rpc
from kvbridge.common.text.tokenizer import Tokenizer
from kvbridge.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    kv_events_pb2,
    kv_events_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

FINGERPRINT = "f00"  # the fake model's
TOKENIZER = Tokenizer.byte_level(259)  # what GetTokenizer hands out: ids = 3 + the bytes' rank, ChatML specials


@dataclass
class Rooms:
    """What the fake prefill nodes did, by room; fake decode nodes wait on it like real ones."""

    prefilled: dict[int, str] = field(default_factory=dict)  # room -> address of the P that prefilled it
    cond: threading.Condition = field(default_factory=threading.Condition)


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams `tokens` tokens (ids 100, 101, ..., text "t0 t1 ..."), one per message, then a last
    message with finish_reason and usage, as a colocated or decode node does; a request with
    resume_ids (a migration) goes on after them (token i is 100 + i whoever streams it). One that
    asks for prompt_logprobs k gets them with its first token (`fake_prompt_logprobs`)."""

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
        if request.HasField("prefill") and not request.prefill.local:  # decode node: the KV comes from its P
            room, deadline = request.prefill.room, time.monotonic() + 10
            with node.rooms.cond:
                while room not in node.rooms.prefilled and context.is_active() and time.monotonic() < deadline:
                    node.rooms.cond.wait(0.02)
            if node.rooms.prefilled.get(room) != request.prefill.prefill_addr:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"room {room} never arrived")
        n = request.sampling.max_new_tokens or node.tokens
        asked = request.sampling.HasField("prompt_logprobs") and not request.resume_ids
        for i in range(len(request.resume_ids), n):
            if not context.is_active():
                return
            if node.fail is not None and i == node.fail_after:
                context.abort(node.fail, f"{node.address} fails as told after {i} tokens")
            if i == node.stall_after:  # hang (until cancelled)
                while context.is_active():
                    time.sleep(0.01)
                return
            time.sleep(node.token_s)
            resp = generation_pb2.GenerateResponse(rid=request.rid, token_ids=[100 + i], text=f"t{i} ")
            if asked and i == 0:
                resp.prompt_logprobs.extend(fake_prompt_logprobs(request.prompt.token_ids.ids, request.sampling))
            yield resp
        node.completed.append(request.rid)
        yield generation_pb2.GenerateResponse(
            rid=request.rid,
            finish_reason="length",
            usage=common_pb2.Usage(
                prompt_tokens=len(request.prompt.token_ids.ids), completion_tokens=n, cached_tokens=node.cached_tokens
            ),
        )

    def GetModelInfo(self, request, context):
        node = self.node
        return generation_pb2.ModelInfo(
            model="fake", fingerprint=node.fingerprint, max_context=node.max_context, role=node.role
        )


def fake_prompt_logprobs(ids, sampling: common_pb2.SamplingParams) -> list[common_pb2.TokenLogprob]:
    """A prompt's logprobs as a node sends them: none for its first token; for token i (text "p{id}"),
    logprob -i/1024, rank 1, and sampling.prompt_logprobs alternatives (ids 3.., texts "a{j}")."""
    k = sampling.prompt_logprobs
    out = [common_pb2.TokenLogprob(token_id=ids[0], token=f"p{ids[0]}")] if ids else []
    for i, t in enumerate(ids[1:], start=1):
        out.append(common_pb2.TokenLogprob(
            token_id=t, token=f"p{t}", logprob=-i / 1024, rank=1, top_ids=range(3, 3 + k),
            top_tokens=[f"a{j}" for j in range(k)], top_logprobs=[-j / 8 for j in range(k)],
        ))  # fmt: skip
    return out


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
        return prefill_pb2.PrefillResponse(
            rid=request.rid, prompt_tokens=3, first_token=100, cached_tokens=node.cached_tokens
        )


_END = object()  # a FakeKV stream item: end the stream


class FakeKV:
    """A node's prefix cache as its KVEvents tell it: what it holds, its seq, and the Watch streams
    open on it. Each change is sent to every open stream as one batch (seq + 1); `lose` makes one
    without sending it (a gap on the next); `lag` sends a fresh snapshot on the open streams; `end`
    ends them (normally, or failing with a code); while `refuse` is set, new streams fail with it."""

    def __init__(self, role: str, page_size: int):
        self.role, self.page_size = role, page_size
        self.blocks: set[int] = set()
        self.seq = 0
        self.opened = 0  # Watch streams opened so far
        self.refuse: grpc.StatusCode | None = None
        self.refused = 0  # Watch streams refused so far
        self.open: list[queue.Queue] = []  # of the streams open now
        self.lock = threading.Lock()

    def batch(self, kind: int, hashes=(), snapshot: bool = False) -> kv_events_pb2.KVEventBatch:
        event = kv_events_pb2.KVEvent(kind=kind, block_hashes=list(hashes))
        return kv_events_pb2.KVEventBatch(
            seq=self.seq, snapshot=snapshot, events=[event], page_size=self.page_size, role=self.role
        )

    def snapshot(self) -> kv_events_pb2.KVEventBatch:
        return self.batch(kv_events_pb2.KVEvent.STORED, sorted(self.blocks), snapshot=True)

    def store(self, hashes, send: bool = True) -> None:
        self._change(kv_events_pb2.KVEvent.STORED, hashes, send)

    def remove(self, hashes, send: bool = True) -> None:
        self._change(kv_events_pb2.KVEvent.REMOVED, hashes, send)

    def clear(self, send: bool = True) -> None:
        self._change(kv_events_pb2.KVEvent.CLEARED, (), send)

    def lose(self, hashes) -> None:
        """Store `hashes` with a batch that never reaches the watchers."""
        self.store(hashes, send=False)

    def lag(self) -> None:
        with self.lock:
            self._send(self.snapshot())

    def end(self, code: grpc.StatusCode | None = None) -> None:
        with self.lock:
            self._send(_END if code is None else code)

    def _change(self, kind: int, hashes, send: bool) -> None:
        with self.lock:
            if kind == kv_events_pb2.KVEvent.STORED:
                self.blocks.update(hashes)
            elif kind == kv_events_pb2.KVEvent.REMOVED:
                self.blocks.difference_update(hashes)
            else:
                self.blocks.clear()
            self.seq += 1
            if send:
                self._send(self.batch(kind, hashes))

    def _send(self, item) -> None:
        for q in self.open:
            q.put(item)


class FakeKVEvents(kv_events_pb2_grpc.KVEventsServicer):
    def __init__(self, node: FakeNode):
        self.node = node

    def Watch(self, request, context):
        kv, q = self.node.kv, queue.Queue()
        if kv.refuse is not None:
            kv.refused += 1
            context.abort(kv.refuse, f"{self.node.address} refuses KV event streams, as told")
        with kv.lock:
            kv.opened += 1
            kv.open.append(q)
            q.put(kv.snapshot())
        try:
            while context.is_active():
                try:
                    item = q.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is _END:
                    return
                if isinstance(item, grpc.StatusCode):
                    context.abort(item, f"{self.node.address} ends its KV events as told")
                yield item
        finally:
            with kv.lock:
                kv.open.remove(q)

    def GetTokenizer(self, request, context):
        node = self.node
        node.tokenizer_calls += 1
        if node.tokenizer_fail is not None:
            context.abort(node.tokenizer_fail, f"{node.address} has no tokenizer to give, as told")
        return kv_events_pb2.TokenizerInfo(
            tokenizer_json=TOKENIZER.to_json(),
            model_fingerprint=node.fingerprint,
            page_size=node.kv.page_size,
            max_context=node.max_context,
        )


class FakeAdmin(admin_pb2_grpc.AdminServicer):
    def __init__(self, node: FakeNode):
        self.node = node

    def ClearPrefixCache(self, request, context):
        if self.node.fail_clear is not None:
            context.abort(self.node.fail_clear, f"{self.node.address} cannot clear, as told")
        dropped = len(self.node.kv.blocks)
        self.node.kv.clear()
        return admin_pb2.ClearPrefixCacheResponse(pages_dropped=dropped)


class FakeNode:
    def __init__(
        self,
        role: str,
        rooms: Rooms,
        tokens: int = 4,
        token_s: float = 0.0,
        first_s: float = 0.0,
        kv_events: bool = False,
        page_size: int = 4,
        max_context: int = 64,
    ):
        self.role, self.rooms = role, rooms
        self.tokens, self.token_s, self.first_s = tokens, token_s, first_s  # tokens per request, seconds
        self.max_context = max_context  # what GetModelInfo and GetTokenizer say (the router bounds prompts by it)
        self.fingerprint = FINGERPRINT  # the model GetModelInfo and GetTokenizer name
        self.requests: list = []  # every request received, in order
        self.arrived: list[float] = []  # time.monotonic() of each Generate's arrival
        self.cancelled: list[str] = []  # rids whose call ended before its last message (cancel, deadline, abort)
        self.completed: list[str] = []  # rids whose stream was produced to the end
        self.fail: grpc.StatusCode | None = None  # abort every request with this code
        self.fail_after = 0  # ... after this many tokens
        self.fail_late_s: float | None = None  # prefill: fail only this long after the room was prefilled
        self.stall_after: int | None = None  # stream this many tokens, then send nothing until cancelled
        self.hold: threading.Event | None = None  # prefill: block until set or cancelled
        self.cached_tokens = 0  # what its answers say it found cached (PrefillResponse, Usage)
        self.kv = FakeKV(role, page_size)  # served only with kv_events=True
        self.tokenizer_calls = 0
        self.tokenizer_fail: grpc.StatusCode | None = None  # GetTokenizer fails with this code
        self.fail_clear: grpc.StatusCode | None = None  # Admin.ClearPrefixCache fails with this code
        if role == "prefill":
            services = [(prefill_pb2_grpc.add_PrefillServicer_to_server, FakePrefill(self))]
            names = ["kvbridge.v1.Prefill"]
        else:
            services = [(generation_pb2_grpc.add_GenerationServicer_to_server, FakeGeneration(self))]
            names = ["kvbridge.v1.Generation"]
        if kv_events:
            services += [
                (kv_events_pb2_grpc.add_KVEventsServicer_to_server, FakeKVEvents(self)),
                (admin_pb2_grpc.add_AdminServicer_to_server, FakeAdmin(self)),
            ]
            names += ["kvbridge.v1.KVEvents", "kvbridge.v1.Admin"]
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
