"""The router's gRPC services, on grpc.aio (coroutines on the router's event loop): Generation
(checked, then forwarded through the dispatcher) and Admin (status, the requests in flight, abort,
drain and resume, config, the fleet, and clearing every node's prefix cache)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import grpc

from kvbridge import __version__
from kvbridge.common import rpc, security, tracing
from kvbridge.common.limits import listed_room, normalized_address, room_tag
from kvbridge.common.logs import log_event
from kvbridge.router.checks import check_generate
from kvbridge.router.config import RouterConfig
from kvbridge.router.dispatch import Dispatcher
from kvbridge.router.failures import RouteError
from kvbridge.router.planner import SwitchRefused, switch
from kvbridge.router.pool import ROLES, Node, PoolFull
from kvbridge.router.routed import OPERATOR_ABORTED, PHASES, Routed
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

SERVICES = ("kvbridge.v1.Generation", "kvbridge.v1.Admin")
DEFAULT_PAGE = 100  # ListRequests page_size 0
MAX_PAGE = 1000
CLEAR_DEADLINE_S = 10.0  # each node's ClearPrefixCache
log = logging.getLogger("kvbridge.router")


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher

    async def Generate(self, request, context):
        try:
            check_generate(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if problem := self.dispatcher.prompts.size_problem(request.prompt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        parent = tracing.extract(context.invocation_metadata())  # (the caller's trace, W3C traceparent)
        routed = self.dispatcher.route(request, timeout_s=context.time_remaining(), parent=parent)
        try:
            # write() rather than yield: every await stays in this task, so a client that leaves
            # (grpc cancels the task) or a failed write closes `routed`, which cancels upstream
            async with contextlib.aclosing(routed) as responses:
                async for resp in responses:
                    await context.write(resp)
        except RouteError as e:
            await context.abort(e.code, e.message)

    async def GetModelInfo(self, request, context):
        models = self.dispatcher.pool.models()
        if not models:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy node has reported its model yet")
        info = generation_pb2.ModelInfo()
        info.CopyFrom(models[0])
        info.role = "router"
        return info


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, dispatcher: Dispatcher, config: RouterConfig, on_drain: Callable[[], None]):
        """on_drain: called after draining starts or ends (the router sets its health)."""
        self.dispatcher, self.pool, self.config = dispatcher, dispatcher.pool, config
        self.on_drain = on_drain
        self.started = time.monotonic()

    async def GetStatus(self, request, context):
        d, model, in_flight = self.dispatcher, self.pool.agreed_model(), self.dispatcher.num_in_flight()
        return admin_pb2.Status(
            role="router",
            model=model.model if model else "",
            model_fingerprint=model.fingerprint if model else "",
            queues={"routed": in_flight, **self.pool.outstanding()},
            requests_served=d.requests_served,
            requests_in_flight=in_flight,
            draining=d.draining,
            serving=d.accepting(),
            version=__version__,
            uptime_s=time.monotonic() - self.started,
            nodes=[node_info(n) for n in self.pool.nodes],
            planner_moves=list(d.planner.moves) if d.planner is not None else [],
        )

    async def ListRequests(self, request, context):
        size = request.page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_size must be at most {MAX_PAGE}, got {size}")
        if request.phase and request.phase not in PHASES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"phase must be one of {', '.join(PHASES)} (or empty), got {rpc.shown(request.phase)}",
            )
        start = rpc.page_offset(request.page_token)
        if start is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"page_token {rpc.shown(request.page_token)} is not one we issued"
            )
        matching = [r for r in self.dispatcher.in_flight() if not request.phase or r.phase == request.phase]
        return admin_pb2.ListRequestsResponse(
            requests=[request_info(r) for r in matching[start : start + size]],
            next_page_token=str(start + size) if start + size < len(matching) else "",
            total=len(matching),
        )

    async def AbortRequest(self, request, context):
        if not request.rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rid is required")
        routed = self.dispatcher.find(request.rid)
        if routed is None:
            message = f"no request {rpc.shown(request.rid)} in flight at the router"
            await context.abort(grpc.StatusCode.NOT_FOUND, message)
        phase = routed.phase
        routed.cancel(OPERATOR_ABORTED)
        log_event(log, "abort", rid=routed.rid, room=room_tag(routed.room), phase=phase, source="admin")
        return admin_pb2.AbortRequestResponse(rid=routed.rid, phase=phase)

    async def Drain(self, request, context):
        if not request.wait_s >= 0:  # NaN too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must be >= 0, got {request.wait_s}")
        d = self.dispatcher
        d.set_draining(True)
        self.on_drain()
        log_event(log, "drain", wait_s=request.wait_s, requests_in_flight=d.num_in_flight())
        left = await d.wait_idle(request.wait_s) if request.wait_s > 0 else d.num_in_flight()
        return admin_pb2.DrainResponse(draining=d.draining, requests_in_flight=left, empty=d.draining and left == 0)

    async def Resume(self, request, context):
        d = self.dispatcher
        d.set_draining(False)
        self.on_drain()
        log_event(log, "resume", requests_in_flight=d.num_in_flight())
        return admin_pb2.DrainResponse(draining=False, requests_in_flight=d.num_in_flight(), empty=False)

    async def GetConfig(self, request, context):
        settings = asdict(self.config) | {"nodes": [{"role": n.role, "address": n.address} for n in self.pool.nodes]}
        return admin_pb2.Config(role="router", version=__version__, json=json.dumps(settings, sort_keys=True))

    async def ListNodes(self, request, context):
        return admin_pb2.ListNodesResponse(nodes=[node_info(n) for n in self.pool.nodes])

    async def AddNode(self, request, context):
        try:
            node = self.pool.add(request.role, request.address)
        except PoolFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log_event(log, "node_added", role=node.role, address=node.address)
        return node_info(node)

    async def RemoveNode(self, request, context):
        try:
            node = self.pool.remove(request.address, request.role)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, e.args[0])
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log_event(log, "node_removed", role=node.role, address=node.address, outstanding=node.outstanding)
        return node_info(node)

    async def SetRole(self, request, context):
        """Switch one elastic node's role (with this router's admin key), unless it is the last healthy
        node of its role, or comes to be while it waits (ABORTED: withdrawn, router/planner.py
        `switch`); the pool takes the new role from the node's answer at once."""
        try:
            address = normalized_address(request.node, "node")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e} (the address of the node to switch)")
        node = next((n for n in self.pool.nodes if n.address == address and n.channel is not None), None)
        if node is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no node {rpc.shown(address)} in the pool")
        if request.role not in ROLES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"role must be one of {', '.join(ROLES)}, got {rpc.shown(request.role)}",
            )
        try:
            answer = await switch(self.pool, node, request.role, request.wait_s, request.migrate)
        except SwitchRefused as e:
            await context.abort(e.code, str(e))
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"{node.address}: {e.details()}")
        log_event(log, "node_role_set", address=node.address, old=answer.old_role, role=answer.role)
        return answer

    async def ClearPrefixCache(self, request, context):
        """Every node's Admin.ClearPrefixCache at once (with this router's admin key); the pages
        dropped in all. A node that fails it: UNAVAILABLE naming it (the others are cleared)."""
        nodes = [n for n in self.pool.nodes if n.channel is not None]
        results = await asyncio.gather(*(_clear(n) for n in nodes), return_exceptions=True)
        failed = [f"{n.key} ({_why(r)})" for n, r in zip(nodes, results) if isinstance(r, BaseException)]
        if failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"ClearPrefixCache failed on {', '.join(failed)}")
        dropped = sum(r.pages_dropped for r in results)
        log_event(log, "prefix_cache_cleared", nodes=len(nodes), pages_dropped=dropped)
        return admin_pb2.ClearPrefixCacheResponse(pages_dropped=dropped)


async def _clear(node: Node) -> admin_pb2.ClearPrefixCacheResponse:
    metadata = security.auth_metadata(rpc.security().admin_key)
    stub = admin_pb2_grpc.AdminStub(node.channel)
    return await stub.ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=CLEAR_DEADLINE_S, metadata=metadata)


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {rpc.shown(e.details() or '')}"
    return rpc.shown(e)


def node_info(n: Node) -> admin_pb2.NodeInfo:
    return admin_pb2.NodeInfo(
        role=n.role,
        address=n.address,
        healthy=n.healthy,
        reported=n.reported,
        outstanding=n.outstanding,
        routed=n.routed,
        model=n.model.model if n.model is not None else "",
        elastic=n.elastic,
        role_epoch=n.role_epoch,
        switching_to=n.switching_to,
    )


def request_info(r: Routed) -> admin_pb2.RequestInfo:
    return admin_pb2.RequestInfo(
        rid=r.rid,
        room=listed_room(r.room, bool(rpc.security().admin_key)),
        phase=r.phase,
        age_s=r.age_s(),
        peer=r.peer,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.output_tokens,
    )
