"""An elastic node's gRPC front: every role's services on one port, each refusing while the node has
another role, and the switch itself (Admin.SetRole: serving/server.py calls `set_role`).

gRPC services cannot be added to a running server, so all are registered at start: Generation (as a
colocated or a decode node), Prefill and Bootstrap (as a prefill node), Admin, KVEvents. Health
follows the role: "" (the node), Admin and KVEvents are SERVING while it serves; Generation only as
colocated or decode, Prefill and Bootstrap only as prefill. During a switch every one is
NOT_SERVING, so routers stop picking the node; they learn its new role from GetModelInfo (`role`,
`role_epoch`: served in every role), which they fetch when it turns SERVING again.

A switch, on the server's loop:
1. new requests are refused (UNAVAILABLE: a router tries another node);
2. rank 0 waits until nothing is live (or ends what is live, with migrate: UNAVAILABLE, resumed
   by the router elsewhere), then every rank switches at one entry of its log;
3. the node serves in its new role. A switch that cannot finish within wait_s changes nothing.
A SetRole for the role the node has, while a switch waits, withdraws it: rank 0 drops the switch
(whose caller is told ABORTED) and the node serves on as before; had rank 0 switched already, it is
a switch back. A router withdraws its own switch so when the fleet changed under it (router/planner.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time

import grpc
from grpc_health.v1 import health_pb2

from kvbridge.common.logs import log_event
from kvbridge.common.shown import shown
from kvbridge.decode_node.service import DecodeGenerationService
from kvbridge.elastic_node.role import ROLE_NAMES
from kvbridge.pipeline.messages import Preallocated, Quarantined
from kvbridge.prefill_node.service import BootstrapService, PrefillService
from kvbridge.serving.colocated import ColocatedGeneration
from kvbridge.serving.server import WATCH_S, NodeServer
from kvbridge.v1 import admin_pb2, generation_pb2_grpc, prefill_pb2_grpc

GENERATION, PREFILL, BOOTSTRAP = "kvbridge.v1.Generation", "kvbridge.v1.Prefill", "kvbridge.v1.Bootstrap"
SERVICES = (GENERATION, PREFILL, BOOTSTRAP, "kvbridge.v1.Admin", "kvbridge.v1.KVEvents")
ROLE_SERVICES = {"colocated": (GENERATION,), "decode": (GENERATION,), "prefill": (PREFILL, BOOTSTRAP)}
DEFAULT_WAIT_S = 120.0  # SetRole's wait_s when the caller gives none
log = logging.getLogger("kvbridge.node")


class ElasticGeneration(generation_pb2_grpc.GenerationServicer):
    """Generation as the role the node has now: a colocated node's or a decode node's."""

    def __init__(self, server: ElasticServer):
        self.server = server
        self.colocated = ColocatedGeneration(server)
        self.decode = DecodeGenerationService(server, server.settings.get("transfer_backend", "auto"))

    async def Generate(self, request, context):
        impl = {"colocated": self.colocated, "decode": self.decode}.get(self.server.role)
        if impl is None:
            await self.server.refuse(context, GENERATION)
        async for response in impl.Generate(request, context):
            yield response

    async def GetModelInfo(self, request, context):
        info = await self.colocated.GetModelInfo(request, context)
        info.elastic, info.role_epoch = True, self.server.role_epoch
        return info


class ElasticPrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, server: ElasticServer):
        self.server, self.inner = server, PrefillService(server)

    async def Prefill(self, request, context):
        if self.server.role != "prefill":
            await self.server.refuse(context, PREFILL)
        return await self.inner.Prefill(request, context)


class ElasticBootstrap(prefill_pb2_grpc.BootstrapServicer):
    """Served while the node is a prefill node (and while it switches away: its last rooms register)."""

    def __init__(self, server: ElasticServer):
        self.server, self.inner = server, BootstrapService(server)

    async def GetLayout(self, request, context):
        await self._as_prefill(context)
        return await self.inner.GetLayout(request, context)

    async def Register(self, request, context):
        await self._as_prefill(context)
        return await self.inner.Register(request, context)

    async def Revoke(self, request, context):
        # in any role: a node that switched away from prefill has no room left (NOT_FOUND, elastic_node/role.py)
        return await self.inner.Revoke(request, context)

    async def _as_prefill(self, context) -> None:
        if self.server.role != "prefill":
            why = f"{self.server.address} is a {self.server.role} node now (an elastic node that switched role)"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)


class ElasticServer(NodeServer):
    """`kvbridge prefill|decode|serve --elastic`: starts as that role; Admin.SetRole changes it."""

    SERVICES = SERVICES
    elastic = True

    def __init__(self, host: str, port: int, metrics_port: int = -1, settings: dict | None = None):
        self.role = (settings or {}).get("role", "")
        if self.role not in ROLE_NAMES:
            raise ValueError(f"role must be one of {', '.join(ROLE_NAMES)}, got {self.role!r}")
        self.role_epoch = 0  # switches made
        self.switching = ""  # the role a switch under way goes to (its own while a withdrawal is under way)
        self._asks = 0  # SetRoles sent to rank 0 and not answered yet: 1, or 2 while one withdraws the other
        self._switch_began = 0.0
        super().__init__(host, port, metrics_port, settings)

    def servicers(self):
        self.generation = ElasticGeneration(self)
        return [
            (generation_pb2_grpc.add_GenerationServicer_to_server, self.generation),
            (prefill_pb2_grpc.add_PrefillServicer_to_server, ElasticPrefill(self)),
            (prefill_pb2_grpc.add_BootstrapServicer_to_server, ElasticBootstrap(self)),
            *super().servicers(),
        ]

    def loaded(self) -> None:
        # as a decode node: rank 0 preallocated a request's pages; register its room with the prefill node
        # (and revoke it there if its hand-off fails under way)
        self.node.front.handlers[Preallocated] = self.generation.decode.on_preallocated
        self.node.front.handlers[Quarantined] = self.generation.decode.on_quarantined

    def stop(self, grace_s: float = 2.0):
        if self.loop.running:
            self.loop.run(self.generation.decode.close(), timeout=10)
        return super().stop(grace_s)

    # ------------------------------------------------------------------ admission and health

    @property
    def serving(self) -> bool:
        return super().serving and not self.switching

    async def admit(self, context: grpc.aio.ServicerContext) -> None:
        if self.switching:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the node is switching from {self.role} to {self.switching}"
            )
        await super().admit(context)

    async def refuse(self, context, service: str) -> None:
        """A call to a service of another role (UNAVAILABLE: a router tries a node that has the role)."""
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"{self.address} is a {self.role} node now (an elastic node): it does not serve {service}",
        )

    def _set_health(self, serving: bool) -> None:
        self._serving = serving
        up, down = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICES):
            mine = name not in (GENERATION, PREFILL, BOOTSTRAP) or name in ROLE_SERVICES[self.role]
            self.health.set(name, up if serving and mine else down)

    # ------------------------------------------------------------------ the switch

    async def set_role(self, request, context) -> admin_pb2.SetRoleResponse:
        """Admin.SetRole (the admin key was checked): switch, or abort the call saying why not."""
        role, old = request.role, self.role
        if role not in ROLE_NAMES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"role must be one of {', '.join(ROLE_NAMES)}, got {shown(role)}"
            )
        if not (request.wait_s >= 0 and math.isfinite(request.wait_s)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must be >= 0, got {request.wait_s}")
        withdraw = bool(self.switching) and role == old and self._asks == 1  # back to its role: withdraw the switch
        if self.switching and not withdraw:
            ago, to = time.monotonic() - self._switch_began, self.switching if self._asks == 1 else "(withdrawn)"
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"a switch from {old} to {to} is in progress (asked {ago:.1f} s ago): ask again when "
                f"it is done (Admin GetStatus: switching_to), or ask for {old} to withdraw it",
            )
        if not withdraw and (self.node is None or self.dead or self.draining):
            state = "still loading" if self.node is None else "lost a rank" if self.dead else "draining"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the {old} node is {state}: it cannot switch")
        answer = admin_pb2.SetRoleResponse(old_role=old, role=role, role_epoch=self.role_epoch, node=self.address)
        if role == old and not withdraw:
            return answer
        began, withdrawn = time.monotonic(), self.switching
        self.switching = role  # (withdrawing: its own role; NOT_SERVING still, until both answers are in)
        if not withdraw:
            self._switch_began = began
            self._update_health()  # NOT_SERVING: routers stop picking it
        event = "role_switch_withdraw" if withdraw else "role_switch_begin"
        log_event(log, event, old=old, role=role, address=self.address, migrate=request.migrate)
        wait_s = request.wait_s or DEFAULT_WAIT_S
        # (the switch goes on if the caller goes away: its end, whenever, sets the role and health)
        asked = asyncio.ensure_future(self.node.front.set_role(role, wait_s, request.migrate))
        self._asks += 1
        asked.add_done_callback(functools.partial(self._switch_done, role))
        done = await self._answer_of(asked, wait_s)
        if done["code"]:
            log_event(log, "role_switch_failed", logging.WARNING, old=old, role=role, error=done["error"])
            await context.abort(getattr(grpc.StatusCode, done["code"]), done["error"])
        if done.get("withdrew"):  # rank 0 had not switched yet: it stays, the switch's asker is told ABORTED
            log_event(log, "role_switch_withdrawn", role=old, withdrawn=withdrawn, address=self.address)
            return answer
        switch_s = time.monotonic() - began
        answer.role_epoch, answer.drain_s, answer.switch_s = done["epoch"], done["waited_s"], switch_s
        log_event(
            log, "role_switch", old=old, role=role, epoch=done["epoch"], address=self.address,
            drain_s=round(done["waited_s"], 3), switch_s=round(switch_s, 3),
        )  # fmt: skip
        return answer

    async def _answer_of(self, asked: asyncio.Future, wait_s: float) -> dict:
        """Rank 0's answer to the switch, or why there is none (a rank died, it did not answer)."""
        while not asked.done():
            await asyncio.wait({asked}, timeout=WATCH_S)
            if self.dead and not asked.done():
                asked.cancel()
                return {"code": "UNAVAILABLE", "error": f"the node lost pipeline rank {self.dead[0]} while switching"}
        if asked.cancelled() or asked.exception() is not None:  # (TimeoutError; the front closed)
            return {"code": "UNAVAILABLE", "error": f"rank 0 did not answer the switch within {wait_s + 5:g} s"}
        return asked.result()

    def _switch_done(self, role: str, asked: asyncio.Future) -> None:
        """A SetRole to rank 0 ended. Two may be out at once (a switch, and the SetRole back that
        withdraws it or, once it was made, switches back), their answers in either order: the role
        is the one of the latest switch made (its epoch), and the node serves again once both ended."""
        done = None if asked.cancelled() or asked.exception() else asked.result()
        if done is not None and not done["code"] and done["epoch"] > self.role_epoch:  # (a switch made)
            self.role = self.node.role = role
            self.node.front.kv_events.role = role
            self.role_epoch = done["epoch"]
        self._asks -= 1
        if not self._asks:
            self.switching = ""
            self._set_health(self.serving)  # (the role's services, even if `serving` did not change)
