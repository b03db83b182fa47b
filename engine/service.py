"""gRPC services of a colocated node (`kvbridge serve`): Generation and Admin on one port.

The node is a PPNode (rank processes) behind a NodeFront (per-request event streams);
this module only translates between the wire and the front, and maps errors to status
codes.
"""

from __future__ import annotations

import time
import uuid

import grpc

from engine.config import EngineConfig, PPConfig
from engine.frontend import NodeFront
from engine.pp.node import PPNode
from kvbridge import __version__, convert, rpc
from kvbridge.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
)

SERVICES = ("kvbridge.v1.Generation", "kvbridge.v1.Admin")


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, front: NodeFront, role: str = "colocated"):
        self.front, self.role = front, role

    def Generate(self, request, context):
        rid = request.rid or uuid.uuid4().hex
        try:
            ids = convert.prompt_ids(request.prompt, self.front.tokenizer)
            params = convert.sampling_params(request.sampling)
            deltas = self.front.submit(ids, params, rid)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rpc.abort_on_cancel(context, lambda: self.front.abort(rid))  # client gone: free the request's pages
        for d in deltas:
            resp = generation_pb2.GenerateResponse(rid=rid, token_ids=d.token_ids, text=d.text)
            if d.finish_reason:
                resp.finish_reason = d.finish_reason
                resp.usage.CopyFrom(
                    common_pb2.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens)
                )
            yield resp

    def GetModelInfo(self, request, context):
        node = self.front.node
        return generation_pb2.ModelInfo(
            model=node.config.model, fingerprint=node.model.fingerprint, max_context=node.max_context, role=self.role
        )


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, front: NodeFront, role: str = "colocated"):
        self.front, self.role = front, role
        self.started = time.monotonic()

    def GetStatus(self, request, context):
        node = self.front.node
        try:
            st = self.front.status(timeout=5)
        except Exception:  # the leader did not answer: report what the front knows
            context.abort(grpc.StatusCode.UNAVAILABLE, "rank 0 did not answer the status request within 5 s")
        alive = {int(p.name.removeprefix("kvbridge-pp")): p.is_alive() for p in node.procs}
        ranks = [
            admin_pb2.RankStatus(
                rank=r, alive=alive.get(r, True), kv_pages_used=st["pages_used"], kv_pages_total=st["pages_total"]
            )
            for r in range(node.pp.pp_size)
        ]
        return admin_pb2.Status(
            role=self.role,
            model_fingerprint=node.model.fingerprint,
            pp_size=node.pp.pp_size,
            ranks=ranks,
            queues=st["queues"],
            requests_served=st["served"],
            version=__version__,
            uptime_s=time.monotonic() - self.started,
        )


class ServingNode:
    """A node with its gRPC server; `stop()` shuts everything down and returns the rank reports."""

    def __init__(self, node: PPNode, host: str, port: int, role: str = "colocated"):
        self.node = node
        self.front = NodeFront(node)
        services = [
            (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationService(self.front, role)),
            (admin_pb2_grpc.add_AdminServicer_to_server, AdminService(self.front, role)),
        ]
        self.server, self.port, self.health = rpc.make_server(host, port, services, SERVICES)
        self.address = f"{host}:{self.port}"
        self.server.start()

    def stop(self, grace_s: float = 2.0):
        self.server.stop(grace_s).wait()
        self.front.close()
        return self.node.shutdown()


def start_colocated(
    config: EngineConfig, pp: PPConfig, host: str = "127.0.0.1", port: int = 0, progress: bool = False
) -> ServingNode:
    return ServingNode(PPNode(config, pp, progress=progress), host, port)
