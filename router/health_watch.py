"""A node's health, watched for the router (`grpc.health.v1.Health/Watch`, on the node's channel): it
says whether the pool may pick the node and, for an elastic node, which role it has now.

A fixed node's stream watches the service its role needs (SERVICE_OF_ROLE); an elastic node's
watches the node itself ("": NOT_SERVING while it switches) and its ModelInfo (`role`, `role_epoch`)
is read on each SERVING that starts a stream or ends NOT_SERVING. A role service's first
NOT_SERVING has the ModelInfo read too: a node listed under a role it has left (an elastic node a
planner moved before this router started) is found so. A stream that fails marks the node
unhealthy and is re-opened after the pool's health_retry_s; one that reaches its own deadline
(WATCH_DEADLINE_S) is re-opened at once, the last report still holding.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge.v1 import generation_pb2, generation_pb2_grpc

if TYPE_CHECKING:
    from kvbridge.router.pool import Node, NodePool

SERVICE_OF_ROLE = {
    "colocated": "kvbridge.v1.Generation",
    "prefill": "kvbridge.v1.Prefill",
    "decode": "kvbridge.v1.Generation",
}
WATCH_DEADLINE_S = 60.0  # a health stream is re-opened this often (every call has a deadline)
MODEL_INFO_DEADLINE_S = 5.0


async def watch_health(pool: NodePool, node: Node) -> None:
    """Until cancelled: the node's health and (elastic) role, reported to `pool`."""
    stub = health_pb2_grpc.HealthStub(node.channel)
    while True:
        watched = node.elastic
        request = health_pb2.HealthCheckRequest(service="" if watched else SERVICE_OF_ROLE[node.role])
        try:
            first = True
            async for resp in stub.Watch(request, timeout=WATCH_DEADLINE_S):
                serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                probe = first and not serving and not node.elastic  # elastic, and now in another role?
                if probe or (serving and (not node.healthy or (node.elastic and first))):
                    info = await model_info(node, pool.call_metadata)
                    if not probe:
                        node.model = info  # (re)started: another model now?
                    if info is not None and info.elastic:
                        node.elastic = True
                        pool.set_role(node, info.role, info.role_epoch)
                first = False
                if node.elastic != watched:
                    break
                pool.set_health(node, serving)
            if node.elastic != watched:
                continue  # an elastic node: watch the node itself from now on, not one role's service
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                continue  # the stream's own deadline: the last report still holds
            pool.set_health(node, False)
        await asyncio.sleep(pool.health_retry_s)


async def model_info(node: Node, metadata: tuple) -> generation_pb2.ModelInfo | None:
    """The node's GetModelInfo, or None when it does not answer."""
    try:
        stub = generation_pb2_grpc.GenerationStub(node.channel)
        request = generation_pb2.GetModelInfoRequest()
        return await stub.GetModelInfo(request, timeout=MODEL_INFO_DEADLINE_S, metadata=metadata)
    except grpc.aio.AioRpcError:
        return None
