"""The decode node's gRPC front: Generation (the router's half of a disaggregated request),
Admin, health and reflection on one port. It checks the prefill node's layout, picks the
transfer engine, and registers each preallocated room with the prefill node."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_node.node import DecodeNode
from engine.config import EngineConfig, PPConfig
from engine.frontend import Overloaded
from engine.server import NodeServer
from kv_transfer import NodeLayout, choose_backend, incompatibility
from kv_transfer import wire as kv_wire
from kvbridge import convert, rpc
from kvbridge.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

SERVICES = ("kvbridge.v1.Generation", "kvbridge.v1.Admin")
CALL_DEADLINE_S = 10.0  # GetLayout and Register on the prefill node
WATCH_DEADLINE_S = 60.0  # a peer's health stream is re-opened this often


class PrefillPeers:
    """Channels and layouts of the prefill nodes this decode node has met (layout fetched once),
    each watched while known: a peer whose health stream breaks (its process died: the connection
    resets at once; its host vanished: keepalive notices within ~15 s) is forgotten, and
    `on_down(addr)` fails the requests still waiting for its KV. Draining (NOT_SERVING) is not
    down: a draining prefill node still finishes the rooms it has."""

    def __init__(self, on_down: Callable[[str], None] = lambda addr: None):
        self.on_down = on_down
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[prefill_pb2_grpc.BootstrapStub, NodeLayout]] = {}
        self._watches: dict[str, grpc.Future] = {}
        self._closed = False

    def get(self, addr: str) -> tuple[prefill_pb2_grpc.BootstrapStub, NodeLayout]:
        """Raises grpc.RpcError (unreachable) or ValueError (a malformed layout)."""
        with self._lock:
            if addr in self._peers:
                return self._peers[addr]
        channel = rpc.make_channel(addr)
        stub = prefill_pb2_grpc.BootstrapStub(channel)
        layout = convert.layout_from_proto(stub.GetLayout(prefill_pb2.GetLayoutRequest(), timeout=CALL_DEADLINE_S))
        with self._lock:
            if addr not in self._peers:
                self._peers[addr] = (stub, layout)
                threading.Thread(
                    target=self._watch, args=(addr, channel), name="kvbridge-peer-watch", daemon=True
                ).start()
            return self._peers[addr]

    def _watch(self, addr: str, channel: grpc.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="kvbridge.v1.Bootstrap")
        while not self._closed:
            try:
                stream = health.Watch(request, timeout=WATCH_DEADLINE_S)
                with self._lock:
                    self._watches[addr] = stream
                for _ in stream:
                    pass
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    continue  # the stream's own deadline, or closing
                with self._lock:
                    self._peers.pop(addr, None)  # a restarted node may have a new layout: fetch it again
                    self._watches.pop(addr, None)
                if not self._closed:
                    self.on_down(addr)
                return

    def close(self) -> None:
        self._closed = True
        with self._lock:
            watches = list(self._watches.values())
        for w in watches:
            w.cancel()


class DecodeGenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, server: NodeServer, backend: str = "auto"):
        self.server, self.backend = server, backend
        self.peers = PrefillPeers(on_down=self._peer_down)
        self.pending: dict[str, tuple] = {}  # rid -> (bootstrap stub, room, backend) until registered
        self.registrar = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvbridge-register")

    @property
    def node(self) -> DecodeNode:
        return self.server.node

    def Generate(self, request, context):
        self.server.admit(context)
        front, route = self.node.front, request.prefill
        rid = request.rid or uuid.uuid4().hex
        if not route.prefill_addr or not route.room:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a decode node serves disaggregated requests: prefill.room and prefill.prefill_addr are required, "
                f"got {route.room} {rpc.shown(route.prefill_addr)}",
            )
        try:
            stub, layout = self.peers.get(route.prefill_addr)
        except grpc.RpcError as e:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"prefill node {route.prefill_addr[:120]}: {(e.details() or '')[:200]}"
            )
        except ValueError as e:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"prefill node {route.prefill_addr[:120]}: {str(e)[:200]}"
            )
        problem = incompatibility(layout, self.node.layout)
        if problem:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        backend = self.backend if self.backend != "auto" else choose_backend(layout, self.node.layout, self.node.device)
        if backend not in layout.backends:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"transfer backend {backend!r} is not one the prefill node drives ({', '.join(layout.backends)})",
            )
        entry = (stub, route.room, backend)  # until rank 0 preallocated the pages (see _register)
        try:
            ids = convert.prompt_ids(request.prompt, front.tokenizer)
            params = convert.sampling_params(request.sampling)
            sources = [(s.rank, s.layer_start, s.layer_end) for s in kv_wire.sources_of(layout)]
            if self.pending.setdefault(rid, entry) is not entry:  # (the front would refuse it too, but later)
                raise ValueError(f"duplicate request id {rpc.shown(rid)}")
            extra = {"room": route.room, "sources": sources, "backend": backend, "peer": route.prefill_addr}
            deltas = front.submit(ids, params, rid, extra)
        except ValueError as e:
            self._forget(rid, entry)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            self._forget(rid, entry)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        rpc.abort_on_cancel(context, lambda: front.abort(rid))  # client gone: free the request's pages
        try:
            yield from self._responses(rid, deltas, ids, backend, context)
        finally:
            self._forget(rid, entry)  # ended before its pages were preallocated

    def _forget(self, rid: str, entry: tuple) -> None:
        if self.pending.get(rid) is entry:
            self.pending.pop(rid, None)

    def _responses(self, rid, deltas, ids, backend, context):
        first = True
        for d in deltas:
            if d.error:
                context.abort(getattr(grpc.StatusCode, d.code or "UNAVAILABLE"), d.error)
            resp = generation_pb2.GenerateResponse(rid=rid, token_ids=d.token_ids, text=d.text)
            if first:
                first = False
                page_bytes = self.node.layout.geometry.layer_block_bytes * self.node.layout.num_layers
                pages = -(-len(ids) // self.node.layout.geometry.page_size)
                stats = generation_pb2.TransferStats(backend=backend, kv_bytes=pages * page_bytes, seconds=d.kv_seconds)
                resp.transfer.CopyFrom(stats)
            if d.finish_reason:
                resp.finish_reason = d.finish_reason
                resp.usage.CopyFrom(
                    common_pb2.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens)
                )
            yield resp

    def _register(self, ev: dict) -> None:
        """Rank 0 preallocated the pages of `rid`: tell the prefill node where they are."""
        rid = ev["rid"]
        stub, room, backend = self.pending.pop(rid, (None, 0, ""))
        if stub is None:
            return
        req = prefill_pb2.RegisterRequest(
            rid=rid,
            room=room,
            backend=backend,
            decode_layout=kv_wire.layout_to_proto(self.node.layout),
            page_ids=ev["page_ids"],
            decode_addr=self.server.address,
        )
        try:
            stub.Register(req, timeout=CALL_DEADLINE_S)
        except grpc.RpcError as e:
            self.node.fail(rid, e.code().name, f"registration with the prefill node failed: {e.details()}")

    def _peer_down(self, addr: str) -> None:
        if self.node is not None:
            self.node.node.inbox.put(("peer_down", addr))

    def GetModelInfo(self, request, context):
        if self.node is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the decode node is still loading")
        node = self.node.node
        return generation_pb2.ModelInfo(
            model=node.config.model, fingerprint=node.model.fingerprint, max_context=node.max_context, role="decode"
        )


class DecodeServer(NodeServer):
    role = "decode"
    SERVICES = SERVICES

    def servicers(self):
        self.generation = DecodeGenerationService(self, self.settings.get("transfer_backend", "auto"))
        return [(generation_pb2_grpc.add_GenerationServicer_to_server, self.generation), *super().servicers()]

    def loaded(self) -> None:
        # rank 0 preallocated a request's pages: register its room with the prefill node (off the dispatch thread)
        self.node.front.handlers["preallocated"] = lambda ev: self.generation.registrar.submit(
            self.generation._register, ev
        )

    def stop(self, grace_s: float = 2.0):
        self.generation.peers.close()
        reports = super().stop(grace_s)
        self.generation.registrar.shutdown(wait=False)
        return reports


def start_decode(
    config: EngineConfig,
    pp: PPConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    backend: str = "auto",
    metrics_port: int = -1,
    progress: bool = False,
) -> DecodeServer:
    server = DecodeServer(host, port, metrics_port, {"model": config.model, "transfer_backend": backend})
    return server.load(lambda: DecodeNode(config, pp, host, progress=progress))
