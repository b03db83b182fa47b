"""The decode node's gRPC front: Generation (the router's half of a disaggregated request),
Admin, health and reflection on one port. It checks the prefill node's layout, picks the
transfer engine, and registers each preallocated room with the prefill node."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from decode_node.node import DecodeNode
from engine.config import EngineConfig, PPConfig
from engine.service import AdminService
from kv_transfer import NodeLayout, choose_backend, incompatibility
from kv_transfer import wire as kv_wire
from kvbridge import convert, rpc
from kvbridge.v1 import (
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

SERVICES = ("kvbridge.v1.Generation", "kvbridge.v1.Admin")
CALL_DEADLINE_S = 10.0  # GetLayout and Register on the prefill node


class PrefillPeers:
    """Channels and layouts of the prefill nodes this decode node has met (layout fetched once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[prefill_pb2_grpc.BootstrapStub, NodeLayout]] = {}

    def get(self, addr: str) -> tuple[prefill_pb2_grpc.BootstrapStub, NodeLayout]:
        """Raises grpc.RpcError (unreachable) or ValueError (a malformed layout)."""
        with self._lock:
            if addr in self._peers:
                return self._peers[addr]
        stub = prefill_pb2_grpc.BootstrapStub(rpc.make_channel(addr))
        layout = convert.layout_from_proto(stub.GetLayout(prefill_pb2.GetLayoutRequest(), timeout=CALL_DEADLINE_S))
        with self._lock:
            self._peers[addr] = (stub, layout)
        return stub, layout


class DecodeGenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, node: DecodeNode, backend: str = "auto"):
        self.node, self.backend = node, backend
        self.peers = PrefillPeers()
        self.pending: dict[str, tuple] = {}  # rid -> (bootstrap stub, room, backend) until registered
        self.registrar = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvbridge-register")
        node.front.handlers["preallocated"] = lambda ev: self.registrar.submit(self._register, ev)

    def Generate(self, request, context):
        front, route = self.node.front, request.prefill
        rid = request.rid or uuid.uuid4().hex
        if not route.prefill_addr or not route.room:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a decode node serves disaggregated requests: prefill.room and prefill.prefill_addr are required, "
                f"got {route.room} {route.prefill_addr!r}",
            )
        try:
            stub, layout = self.peers.get(route.prefill_addr)
        except grpc.RpcError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill node {route.prefill_addr}: {e.details()}")
        except ValueError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"prefill node {route.prefill_addr}: {e}")
        problem = incompatibility(layout, self.node.layout)
        if problem:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        backend = self.backend if self.backend != "auto" else choose_backend(layout, self.node.layout, self.node.device)
        if backend not in layout.backends:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"transfer backend {backend!r} is not one the prefill node drives ({', '.join(layout.backends)})",
            )
        try:
            ids = convert.prompt_ids(request.prompt, front.tokenizer)
            params = convert.sampling_params(request.sampling)
            sources = [(s.rank, s.layer_start, s.layer_end) for s in kv_wire.sources_of(layout)]
            self.pending[rid] = (stub, route.room, backend)
            deltas = front.submit(ids, params, rid, {"room": route.room, "sources": sources, "backend": backend})
        except ValueError as e:
            self.pending.pop(rid, None)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rpc.abort_on_cancel(context, lambda: front.abort(rid))  # client gone: free the request's pages
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
        )
        try:
            stub.Register(req, timeout=CALL_DEADLINE_S)
        except grpc.RpcError as e:
            self.node.fail(rid, e.code().name, f"registration with the prefill node failed: {e.details()}")

    def GetModelInfo(self, request, context):
        node = self.node.node
        return generation_pb2.ModelInfo(
            model=node.config.model, fingerprint=node.model.fingerprint, max_context=node.max_context, role="decode"
        )


class DecodeServer:
    def __init__(self, node: DecodeNode, host: str, port: int, backend: str = "auto"):
        self.node = node
        self.generation = DecodeGenerationService(node, backend)
        services = [
            (generation_pb2_grpc.add_GenerationServicer_to_server, self.generation),
            (admin_pb2_grpc.add_AdminServicer_to_server, AdminService(node.front, "decode")),
        ]
        self.server, self.port, self.health = rpc.make_server(host, port, services, SERVICES)
        self.address = f"{host}:{self.port}"
        self.server.start()

    def stop(self, grace_s: float = 2.0):
        self.server.stop(grace_s).wait()
        self.generation.registrar.shutdown(wait=False)
        return self.node.shutdown()


def start_decode(
    config: EngineConfig, pp: PPConfig, host: str = "127.0.0.1", port: int = 0, backend: str = "auto"
) -> DecodeServer:
    return DecodeServer(DecodeNode(config, pp, host), host, port, backend)
