"""The decode node's gRPC front: Generation (the router's half of a disaggregated request, or a
whole one whose prompt the router chose to have computed here: a local route), Admin, health and
reflection on one port. It checks the route (signed by a fleet member) and the
prefill node's layout (signed over a nonce of its own: a prefill node of the fleet), picks the
transfer backend, registers each preallocated room with the prefill node, signed, and revokes the
room of each hand-off that failed under way (Bootstrap.Revoke, signed), after its registration:
rank 0 keeps the room's pages out of use until the prefill node confirms."""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import Callable
from dataclasses import replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge.common import rpc, sampling, tracing
from kvbridge.common.limits import normalized_address, room_tag
from kvbridge.common.logs import log_event
from kvbridge.common.security import message_proof, message_proof_ok
from kvbridge.decode_node.node import DecodeNode
from kvbridge.decode_node.role import QUARANTINE_MAX_S
from kvbridge.kv_transfer import NodeLayout, choose_backend, incompatibility
from kvbridge.kv_transfer import adapters as kv_wire
from kvbridge.pipeline.messages import Pairing, PeerDown, Preallocated, Quarantined, Revoked
from kvbridge.serving.front import Overloaded
from kvbridge.serving.server import NodeServer
from kvbridge.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

SERVICES = ("kvbridge.v1.Generation", "kvbridge.v1.Admin", "kvbridge.v1.KVEvents")
ROOM_SECRET_BYTES = 16
MAX_PEERS = 256  # prefill nodes known at once (each holds a channel and a health watch)
CALL_DEADLINE_S = 10.0  # GetLayout on the prefill node
WATCH_DEADLINE_S = 60.0  # a peer's health stream is re-opened this often
WATCH_RETRY_S = 0.1  # pause before re-opening a health stream the peer cancelled
NONCE_BYTES = 32  # GetLayout's challenge
REVOKE_DEADLINE_S = 60.0  # one Revoke call (the prefill node answers within its REVOKE_WAIT_S)
REVOKE_RETRY_S = (0.1, 5.0)  # pause before asking again after a failed Revoke: first, longest (doubling)
log = logging.getLogger("kvbridge.decode")


class NotInFleet(Exception):
    """A peer that cannot prove the fleet key: nothing is sent to it."""


class PrefillPeers:
    """Channels and layouts of the prefill nodes this decode node has met (layout fetched once),
    each watched while known: a peer whose health stream breaks (its process died: the connection
    resets at once; its host vanished: keepalive notices within ~15 s) is forgotten, and
    `on_down(addr)` fails the requests still waiting for its KV. Draining (NOT_SERVING) is not
    down: a draining prefill node still finishes the rooms it has. Lives on the server's loop:
    every channel is an aio channel and every watch a task.

    Addresses come from clients (GenerateRequest.prefill.prefill_addr): they are keyed in one
    spelling (common.limits.normalized_address), and at most MAX_PEERS are kept, the least
    recently used forgotten first. A peer is kept only once its layout came signed with the fleet
    key over a fresh nonce: one without the key is never registered with (NotInFleet)."""

    def __init__(self, on_down: Callable[[str], None] = lambda addr: None, fleet_key: bytes = b""):
        self.on_down = on_down
        self.fleet_key = fleet_key or rpc.security().fleet()
        self._peers: dict[str, tuple[prefill_pb2_grpc.BootstrapStub, NodeLayout]] = {}
        self._fetching: dict[str, asyncio.Task] = {}  # addr -> the GetLayout in flight (one per peer)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._watches: dict[str, asyncio.Task] = {}
        self._closed = False

    async def get(self, addr: str) -> tuple[prefill_pb2_grpc.BootstrapStub, NodeLayout]:
        """Raises grpc.RpcError (unreachable), ValueError (a malformed address or layout) or
        NotInFleet (its layout's proof is not the fleet key's)."""
        addr = normalized_address(addr, "prefill_addr")
        if addr in self._peers:
            self._peers[addr] = self._peers.pop(addr)  # the most recently used goes last
            return self._peers[addr]
        fetch = self._fetching.get(addr)
        if fetch is None:
            fetch = self._fetching[addr] = asyncio.ensure_future(self._fetch(addr))
            fetch.add_done_callback(lambda _: self._fetching.pop(addr, None))
        return await asyncio.shield(fetch)  # (one caller going away does not cancel the others' fetch)

    async def _fetch(self, addr: str) -> tuple[prefill_pb2_grpc.BootstrapStub, NodeLayout]:
        channel = rpc.make_aio_channel(addr)
        stub = prefill_pb2_grpc.BootstrapStub(channel)
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            answer = await stub.GetLayout(prefill_pb2.GetLayoutRequest(nonce=nonce), timeout=CALL_DEADLINE_S)
            if not message_proof_ok(self.fleet_key, answer, nonce):
                raise NotInFleet(
                    f"{addr} is not a prefill node of this fleet (its layout is not signed with the fleet key)"
                )
            layout = kv_wire.layout_from_proto(answer.layout)
        except BaseException:
            await channel.close()
            raise
        if self._closed:
            await channel.close()
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the decode node is stopping")
        self._peers[addr] = (stub, layout)
        self._channels[addr] = channel
        self._watches[addr] = asyncio.ensure_future(self._watch(addr, channel))
        while len(self._peers) > MAX_PEERS:
            await self._evict(next(iter(self._peers)))
        return self._peers[addr]

    async def _evict(self, addr: str) -> None:
        """Forget a peer (its next request fetches it again); calls on its channel end CANCELLED."""
        self._peers.pop(addr, None)
        watch, channel = self._watches.pop(addr, None), self._channels.pop(addr, None)
        if watch is not None:
            watch.cancel()
        if channel is not None:
            await channel.close()

    async def _watch(self, addr: str, channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="kvbridge.v1.Bootstrap")
        while not self._closed:
            try:
                async for _ in health.Watch(request, timeout=WATCH_DEADLINE_S):
                    pass
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or self._closed:
                    continue  # the stream's own deadline, or closing
                if e.code() == grpc.StatusCode.CANCELLED:  # (the peer cancelled it: watch again, not in a spin)
                    await asyncio.sleep(WATCH_RETRY_S)
                    continue
                # a restarted node may have a new layout: fetch it again
                self._peers.pop(addr, None)
                self._watches.pop(addr, None)
                old = self._channels.pop(addr, None)
                self.on_down(addr)
                if old is not None:
                    await old.close()
                return

    async def close(self) -> None:
        self._closed = True
        for task in self._watches.values():
            task.cancel()
        await asyncio.gather(*self._watches.values(), return_exceptions=True)  # ended before their channels close
        for channel in self._channels.values():
            await channel.close()
        self._peers.clear()
        self._channels.clear()
        self._watches.clear()


class DecodeGenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, server: NodeServer, backend: str = "auto"):
        self.server, self.backend = server, backend
        self.peers = PrefillPeers(on_down=self._peer_down)
        self.pending: dict[str, tuple] = {}  # rid -> (bootstrap stub, room, backend, secret) until registered
        self._registering: dict[str, asyncio.Task] = {}  # rid -> its Register call in flight (held: weakly kept)
        self._revoking: dict[asyncio.Task, str] = {}  # Revoke tasks -> the prefill node they ask

    @property
    def node(self) -> DecodeNode:
        return self.server.node

    @tracing.served("kvbridge.v1.Generation/Generate")
    async def Generate(self, request, context):
        await self.server.admit(context)
        front, route = self.node.front, request.prefill
        rid = request.rid or uuid.uuid4().hex
        if route.local:  # the router's choice while the prefill queue is long (router/local_prefill.py)
            async for resp in self._local(request, rid, context):
                yield resp
            return
        if not route.prefill_addr or not route.room:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a decode node serves disaggregated requests: prefill.room and prefill.prefill_addr are required, "
                f"got {route.room} {rpc.shown(route.prefill_addr)}",
            )
        if not message_proof_ok(self.peers.fleet_key, route):  # the router's: no caller picks rooms or peers
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"prefill route (room {route.room}) not signed by a fleet member (PrefillRoute.proof is not the "
                "fleet key's; SECURITY.md)",
            )
        try:
            prefill_addr = normalized_address(route.prefill_addr, "prefill.prefill_addr")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            stub, layout = await self.peers.get(prefill_addr)
        except grpc.RpcError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"prefill node {prefill_addr}: {(e.details() or '')[:200]}"
            )
        except NotInFleet as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ValueError as e:
            why = f"prefill node {prefill_addr}: {str(e)[:200]}"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why, rpc.PAIR_FAULT)
        # the two nodes cannot work together: the pair's fault, not the request's (a router tries another)
        problem = incompatibility(layout, self.node.layout)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem, rpc.PAIR_FAULT)
        backend = self.backend if self.backend != "auto" else choose_backend(layout, self.node.layout, self.node.device)
        if backend not in layout.backends:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"transfer backend {backend!r} is not one the prefill node drives ({', '.join(layout.backends)})",
                rpc.PAIR_FAULT,
            )
        # the room's write key: only the prefill node it is registered with can write its pages
        secret = secrets.token_bytes(ROOM_SECRET_BYTES)
        entry = (stub, route.room, backend, secret)  # until rank 0 preallocated the pages (see _register)
        try:
            ids = await front.prompt_ids(request.prompt)
            params = replace(sampling.from_proto(request.sampling), prompt_logprobs=None)  # (P computes the prompt)
            sources = tuple(kv_wire.sources_of(layout))
            if self.pending.setdefault(rid, entry) is not entry:  # (the front would refuse it too, but later)
                raise ValueError(f"duplicate request id {rpc.shown(rid)}")
            pairing = Pairing(route.room, prefill_addr, sources, backend, secret)
            deltas = front.submit(ids, params, rid, pairing, request.cache_salt, request.resume_ids)
            ids = [*ids, *request.resume_ids]  # (the KV moved covers the resumed outputs too)
        except ValueError as e:
            self._forget(rid, entry)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            self._forget(rid, entry)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        try:
            async for resp in self._responses(rid, deltas, ids, backend, context):
                yield resp
        finally:
            self._forget(rid, entry)  # ended before its pages were preallocated

    async def _local(self, request, rid: str, context):
        """The prompt computed here, with no prefill node (a route with `local`, signed by the router):
        rank 0 schedules it as any request, its chunks beside the running decodes within the
        chunked-prefill budget, from the longest prefix this node's cache holds (decode_node/role.py)."""
        route, front = request.prefill, self.node.front
        # (the router's, over the rid: no caller makes a decode node prefill, nor replays another request's route)
        if not request.rid or not message_proof_ok(self.peers.fleet_key, route, request.rid.encode()):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "local prefill route not signed by a fleet member for this rid (PrefillRoute.proof is not the "
                "fleet key's over the request's rid; SECURITY.md)",
            )
        if route.room or route.prefill_addr:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a local prefill route names no room and no prefill node, got {route.room} "
                f"{rpc.shown(route.prefill_addr)}",
            )
        try:
            ids = await front.prompt_ids(request.prompt)
            params = sampling.from_proto(request.sampling)
            deltas = front.submit(ids, params, rid, None, request.cache_salt, request.resume_ids)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        async for resp in self._responses(rid, deltas, ids, None, context):
            yield resp

    def _forget(self, rid: str, entry: tuple) -> None:
        if self.pending.get(rid) is entry:
            self.pending.pop(rid, None)

    async def _responses(self, rid, deltas, ids, backend, context):
        """backend None: a local prefill (no transfer; the cached tokens are this node's)."""
        first = True
        async for d in deltas:
            if d.error:
                await context.abort(getattr(grpc.StatusCode, d.code or "UNAVAILABLE"), d.error)
            if backend is None:
                yield d.response(rid)
                continue
            resp = d.response(rid, cached_tokens=False)
            if first and d.index == 0:  # (choice 0's: the request the prefill node handed off)
                first = False
                page_bytes = self.node.layout.geometry.layer_block_bytes * self.node.layout.num_layers
                pages = -(-len(ids) // self.node.layout.geometry.page_size) - d.pages_skipped
                stats = generation_pb2.TransferStats(
                    backend=backend, kv_bytes=pages * page_bytes, seconds=d.kv_seconds, pages_skipped=d.pages_skipped
                )
                resp.transfer.CopyFrom(stats)
            yield resp

    def on_preallocated(self, ev: Preallocated) -> None:
        """Rank 0 preallocated the pages of `rid` (called on the loop): register its room with the
        prefill node, in a task of its own."""
        task = asyncio.ensure_future(self._register(ev))
        self._registering[ev.rid] = task
        task.add_done_callback(lambda _: self._registering.pop(ev.rid, None))

    async def _register(self, ev: Preallocated) -> None:
        rid = ev.rid
        stub, room, backend, secret = self.pending.pop(rid, (None, 0, "", b""))
        if stub is None:
            return
        req = prefill_pb2.RegisterRequest(
            rid=rid,
            room=room,
            backend=backend,
            decode_layout=kv_wire.layout_to_proto(self.node.layout),
            page_ids=ev.page_ids,
            held_pages=ev.held_pages,
            decode_addr=self.server.address,
            secret=secret,
        )
        req.proof = message_proof(self.peers.fleet_key, req)  # the pages are this node's: only it names them
        try:
            # answered once the prefill node's rank 0 ruled on it: under a burst, behind its queue
            await stub.Register(req, timeout=self.node.ranks.config.transfer_timeout_s)
        except grpc.RpcError as e:
            self.node.fail(rid, e.code().name, f"registration with the prefill node failed: {e.details()}")

    def on_quarantined(self, ev: Quarantined) -> None:
        """Rank 0 failed a hand-off under way (called on the loop): ask the prefill node to revoke its
        room, in a task of its own; rank 0 frees the pages once it has (Revoked)."""
        task = asyncio.ensure_future(self._revoke(ev))
        self._revoking[task] = ev.peer
        task.add_done_callback(self._revoking.pop)

    async def _revoke(self, ev: Quarantined) -> None:
        """Bootstrap.Revoke until the prefill node answers that no rank of it writes into the room (or
        knows no such room: NOT_FOUND), asked again after a failure, for at most QUARANTINE_MAX_S
        (rank 0 then releases the pages itself). Never before the room's Register call ended: a
        registration that came after the revocation would route the KV into pages reused by then."""
        registering = self._registering.get(ev.rid)
        if registering is not None:
            await asyncio.wait([registering])
        self.pending.pop(ev.rid, None)  # (not preallocated yet: it is never registered now)
        request = prefill_pb2.RevokeRequest(room=ev.room)
        request.proof = message_proof(self.peers.fleet_key, request)  # the pages are this node's: only it gives them up
        loop = asyncio.get_running_loop()
        give_up, pause = loop.time() + QUARANTINE_MAX_S, REVOKE_RETRY_S[0]
        while True:
            try:
                stub, _ = await self.peers.get(ev.peer)
                await stub.Revoke(request, timeout=REVOKE_DEADLINE_S)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:  # no such room there: nothing of that node writes it
                    break
                error = f"{e.code().name}: {(e.details() or '')[:200]}"
            except (NotInFleet, ValueError) as e:
                error = str(e)[:200]
            if loop.time() + pause > give_up:
                return  # (rank 0 releases the pages at its own bound, with an error)
            room = room_tag(ev.room)
            log_event(log, "revoke_retry", logging.WARNING, rid=ev.rid, room=room, peer=ev.peer, error=error)
            await asyncio.sleep(pause)
            pause = min(2 * pause, REVOKE_RETRY_S[1])
        self.node.ranks.inbox.put(Revoked(ev.rid, ev.room))

    def _peer_down(self, addr: str) -> None:
        """The prefill node at `addr` died: its rooms need no revoking (rank 0 frees their pages after
        a grace for its ranks to exit: decode_node/role.py PREFILL_GONE_GRACE_S)."""
        for task, peer in list(self._revoking.items()):
            if peer == addr:
                task.cancel()
        if self.node is not None:
            self.node.ranks.inbox.put(PeerDown(addr))

    async def close(self) -> None:
        """At the node's stop: no more revoking, every peer's channel closed."""
        for task in list(self._revoking):
            task.cancel()
        await self.peers.close()

    async def GetModelInfo(self, request, context):
        if self.node is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode node is still loading")
        node = self.node.ranks
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
        # rank 0 preallocated a request's pages: register its room with the prefill node; rank 0 failed
        # a hand-off under way: revoke its room there
        self.node.front.handlers[Preallocated] = self.generation.on_preallocated
        self.node.front.handlers[Quarantined] = self.generation.on_quarantined

    def stop(self, grace_s: float = 2.0):
        if self.loop.running:
            self.loop.run(self.generation.close(), timeout=10)
        return super().stop(grace_s)
