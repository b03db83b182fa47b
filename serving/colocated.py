"""gRPC services of a colocated node (`kvbridge serve`): Generation, plus what every node
serves (serving/server.py: Admin, health, reflection, /metrics) on one port.

The node is a RankGroup (rank processes) behind a NodeFront (per-request event streams);
this module only translates between the wire and the front, and maps errors to status
codes.
"""

from __future__ import annotations

import uuid

import grpc

from kvbridge.common import sampling, tracing
from kvbridge.pipeline.group import RankGroup
from kvbridge.serving.config import NodeConfig
from kvbridge.serving.front import NodeFront, Overloaded
from kvbridge.serving.server import NodeServer
from kvbridge.v1 import generation_pb2, generation_pb2_grpc

SERVICES = ("kvbridge.v1.Generation", "kvbridge.v1.Admin", "kvbridge.v1.KVEvents")


class ColocatedGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, server: NodeServer):
        self.server = server

    @tracing.served("kvbridge.v1.Generation/Generate")
    async def Generate(self, request, context):
        await self.server.admit(context)
        front = self.server.node.front
        rid = request.rid or uuid.uuid4().hex
        try:
            ids = await front.prompt_ids(request.prompt)
            params = sampling.from_proto(request.sampling)
            deltas = front.submit(ids, params, rid, cache_salt=request.cache_salt, resumed=request.resume_ids)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        async for d in deltas:
            if d.error:
                await context.abort(getattr(grpc.StatusCode, d.code or "UNAVAILABLE"), d.error)
            yield d.response(rid)

    async def GetModelInfo(self, request, context):
        if self.server.node is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.server.role} node is still loading")
        node = self.server.node.ranks
        return generation_pb2.ModelInfo(
            model=node.config.model,
            fingerprint=node.model.fingerprint,
            max_context=node.max_context,
            role=self.server.role,
        )


class ColocatedNode:
    """A colocated node: its rank processes and its front."""

    def __init__(self, config: NodeConfig, progress: bool = False):
        self.ranks = RankGroup(config.engine, config.pp, progress=progress)
        self.front = NodeFront(self.ranks)

    def shutdown(self):
        self.front.close()
        return self.ranks.shutdown()


class ColocatedServer(NodeServer):
    """`kvbridge serve`: Generation and Admin on one port; `stop()` returns the rank reports."""

    role = "colocated"
    SERVICES = SERVICES

    def servicers(self):
        return [(generation_pb2_grpc.add_GenerationServicer_to_server, ColocatedGeneration(self)), *super().servicers()]
