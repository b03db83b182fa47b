"""The prefill node's gRPC front: Prefill (the router's half of a request), Bootstrap
(layout and registration, for decode nodes), Admin, health and reflection on one port."""

from __future__ import annotations

import grpc

from kvbridge.common import rpc, sampling, tracing
from kvbridge.common.rpc import peer_host, shown
from kvbridge.common.security import message_proof, message_proof_ok
from kvbridge.kv_transfer import adapters as kv_wire
from kvbridge.kv_transfer.handoff import Registration
from kvbridge.kv_transfer.layout import incompatibility
from kvbridge.pipeline.messages import Pairing
from kvbridge.prefill_node.node import PrefillNode
from kvbridge.serving.front import Overloaded
from kvbridge.serving.server import NodeServer
from kvbridge.v1 import prefill_pb2, prefill_pb2_grpc

SERVICES = ("kvbridge.v1.Prefill", "kvbridge.v1.Bootstrap", "kvbridge.v1.Admin", "kvbridge.v1.KVEvents")
NONCE_BYTES = (16, 64)  # a GetLayout nonce's length, [min, max]


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, server: NodeServer):
        self.server = server

    @tracing.served("kvbridge.v1.Prefill/Prefill")
    async def Prefill(self, request, context):
        await self.server.admit(context)
        front = self.server.node.front
        if not request.rid or not request.room:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"rid and room are required, got {shown(request.rid)} {request.room}"
            )
        try:
            ids = await front.prompt_ids(request.prompt)
            params = sampling.from_proto(request.sampling)
            if params.n > 1:
                raise ValueError(
                    f"sampling.n is {params.n}: a prefill node computes choice 0 (the decode node forks the others)"
                )
            pairing = Pairing(request.room, caller=peer_host(context.peer()))  # (what one caller holds is bounded)
            deltas = front.submit(ids, params, request.rid, pairing, request.cache_salt, request.resume_ids)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        first, prompt_logprobs = [], []
        async for d in deltas:
            first += d.token_ids
            prompt_logprobs += d.prompt_logprobs
            if d.finish_reason:
                if d.error:
                    await context.abort(getattr(grpc.StatusCode, d.code or "UNAVAILABLE"), d.error)
                return prefill_pb2.PrefillResponse(
                    rid=request.rid,
                    prompt_tokens=d.prompt_tokens,
                    first_token=first[0],
                    kv_bytes=d.kv_bytes,
                    cached_tokens=d.cached_tokens,
                    prompt_logprobs=prompt_logprobs,
                )
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill node stopped")


REVOKE_WAIT_S = 30.0  # longest wait for every rank to drop a revoked room (DEADLINE_EXCEEDED: the caller asks again)


class BootstrapService(prefill_pb2_grpc.BootstrapServicer):
    """Served while draining too: the rooms of requests in flight still get registered (and revoked).
    Every call proves the fleet key: GetLayout signs its answer over the caller's nonce, and
    Register and Revoke are refused unless signed with it (only a decode node of the fleet names
    pages to write, or takes them back)."""

    def __init__(self, server: NodeServer):
        self.server = server
        self.fleet_key = rpc.security().fleet()  # (read now: a key file that cannot be read fails the start)

    @property
    def node(self) -> PrefillNode:
        return self.server.node

    async def GetLayout(self, request, context):
        if not NONCE_BYTES[0] <= len(request.nonce) <= NONCE_BYTES[1]:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"nonce must be {NONCE_BYTES[0]}..{NONCE_BYTES[1]} bytes, got {len(request.nonce)}",
            )
        if self.node is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill node is still loading")
        answer = prefill_pb2.GetLayoutResponse(layout=kv_wire.layout_to_proto(self.node.layout))
        answer.proof = message_proof(self.fleet_key, answer, request.nonce)
        return answer

    async def Register(self, request, context):
        if not message_proof_ok(self.fleet_key, request):  # before anything else: nothing is kept of it
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"room {request.room}: registration not signed by a fleet member (RegisterRequest.proof is not "
                "the fleet key's; SECURITY.md)",
            )
        if self.node is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill node is still loading")
        try:
            decode = kv_wire.layout_from_proto(request.decode_layout)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"decode_layout: {e}")
        problem = incompatibility(self.node.layout, decode)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if request.backend not in self.node.layout.backends:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"backend {shown(request.backend)} is not one of {', '.join(self.node.layout.backends)}",
            )
        bad = [p for p in request.page_ids if p >= decode.num_pages]
        if len(set(request.page_ids)) != len(request.page_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"room {request.room}: page ids repeat")
        if not request.room or not (request.page_ids or request.held_pages) or bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"room {request.room} needs page ids in [0, {decode.num_pages}), got {list(request.page_ids)[:8]}",
            )
        if request.held_pages > decode.num_pages:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"room {request.room}: held_pages {request.held_pages} is more than the decode pool's "
                f"{decode.num_pages} pages",
            )
        if len(request.secret) != 16:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"room {request.room}: secret must be 16 bytes, got {len(request.secret)}",
            )
        registration = Registration(
            room=request.room,
            secret=bytes(request.secret),
            backend=request.backend,
            page_ids=tuple(request.page_ids),
            held_pages=request.held_pages,
            decode=decode,
            decode_addr=request.decode_addr,
        )
        wait_s = self.node.ranks.config.bootstrap_timeout_s  # rank 0 answers between steps, behind its queue
        try:
            verdict = await self.node.front.register(registration, timeout=wait_s)
        except TimeoutError:
            why = f"rank 0 did not rule on the registration of room {request.room} within {wait_s:g} s"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)
        if verdict["code"]:
            await context.abort(getattr(grpc.StatusCode, verdict["code"]), verdict["error"])
        return prefill_pb2.RegisterResponse()

    async def Revoke(self, request, context):
        """A decode node gave up on a room: answered once no rank of this node writes into it (its
        request here ends CANCELLED); NOT_FOUND for a room not known here."""
        if not message_proof_ok(self.fleet_key, request):  # before anything else: nothing is kept of it
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"room {request.room}: revocation not signed by a fleet member (RevokeRequest.proof is not the "
                "fleet key's; SECURITY.md)",
            )
        if not request.room:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "room is required")
        if self.node is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill node is still loading")
        remaining = context.time_remaining()
        wait_s = REVOKE_WAIT_S if remaining is None else min(REVOKE_WAIT_S, remaining)
        try:
            verdict = await self.node.front.revoke(request.room, timeout=wait_s)
        except TimeoutError:
            why = f"room {request.room}: not every rank dropped it within {wait_s:g} s"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)
        if verdict["code"]:
            await context.abort(getattr(grpc.StatusCode, verdict["code"]), verdict["error"])
        return prefill_pb2.RevokeResponse()


class PrefillServer(NodeServer):
    role = "prefill"
    SERVICES = SERVICES

    def servicers(self):
        return [
            (prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillService(self)),
            (prefill_pb2_grpc.add_BootstrapServicer_to_server, BootstrapService(self)),
            *super().servicers(),
        ]
