"""The router's view of its nodes: health, outstanding requests, and which node gets the next one.

Each node's health is watched by a task on the router's event loop (router/health_watch.py), holding
a `grpc.health.v1.Health/Watch` stream (an aio channel) on the service its role needs (Generation for
colocated and decode nodes, Prefill for prefill nodes; an elastic node's own health, and its role from
its ModelInfo). A node is eligible while its last report was SERVING; NOT_SERVING, SERVICE_UNKNOWN or
an unreachable node make it ineligible until a later report says SERVING. Among eligible nodes the
routing policy picks one (router/policy.py: cache_aware, least_loaded, round_robin), from the
outstanding requests and pending prompt tokens counted here, by the router, and the node's cached
blocks.

Beside it, a KV-event watch (router/kv_watch.py) keeps each node's `BlockIndex` of its prefix cache.

Switches of elastic nodes that this router makes (router/planner.py `switch`) never leave a role with
no healthy node: `begin_switch` refuses the last one (nodes switching away count as gone), and a
switch under way that comes to leave its role empty all the same (another node of it went away
meanwhile, or was switched straight at the node, which the node cannot know to refuse) is told so,
for its caller to withdraw it.

The fleet can change at run time: `add` watches a new node at once, `remove` takes one out of
selection at once. A node's channel is closed only when nothing can use it any more: it was removed
(or the pool closed), its watcher has ended, and every request routed to it was released.

Selection and accounting hold one lock, briefly and never across an await, so any thread may use
them (the metrics scrape reads the pool from its own thread; selection tests drive a pool made with
connect=False from theirs). Channels, watchers and channel closing live on the loop (other threads
hand that work to it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from kvbridge.common import rpc
from kvbridge.common.limits import normalized_address
from kvbridge.common.security import auth_metadata
from kvbridge.common.shown import shown
from kvbridge.router.health_watch import SERVICE_OF_ROLE, watch_health
from kvbridge.router.kv_index import BlockIndex
from kvbridge.router.kv_watch import watch_kv
from kvbridge.router.policy import Policy
from kvbridge.v1 import generation_pb2

if TYPE_CHECKING:
    from kvbridge.router.prompts import PromptBlocks


class PoolFull(ValueError):
    """The pool holds MAX_NODES nodes."""


ROLES = tuple(SERVICE_OF_ROLE)
MAX_NODES = 1024  # nodes in one pool (AddNode past it: RESOURCE_EXHAUSTED)
CLOSE_WAIT_S = 5.0  # aclose() waits this long at most for the watchers to end, and again for the channels


@dataclass(frozen=True)
class Pick:
    """A node acquired for a request, and why."""

    node: Node
    reason: str  # router/policy.py REASONS
    tokens: int  # added to node.pending_tokens: hand it back to release()
    cached: int = 0  # prompt tokens its prefix cache holds, as far as the router knows (cache-aware policies)


@dataclass(eq=False)
class Node:
    role: str  # "colocated" | "prefill" | "decode"
    address: str  # host:port of the node's gRPC server
    channel: grpc.aio.Channel | None = None  # None in tests of the selection logic, and once closed
    healthy: bool = False  # the last health report was SERVING
    reported: bool = False  # a health report (or a failure to get one) has arrived
    outstanding: int = 0  # requests routed here and not finished yet
    routed: int = 0  # requests routed here since it was added
    pending_tokens: int = 0  # prompt tokens routed here that it is expected to compute still (released with it)
    blocks: BlockIndex = field(default_factory=BlockIndex, repr=False)  # what its prefix cache holds
    kv_events: bool = True  # it may serve KVEvents (False once it answered UNIMPLEMENTED)
    model: generation_pb2.ModelInfo | None = None  # GetModelInfo, fetched when it turns healthy
    elastic: bool = False  # its role can change (its ModelInfo said so): its role is learned from it
    role_epoch: int = 0  # an elastic node's switches, as last learned
    switching_to: str = ""  # a switch this router asked for is under way (Admin.SetRole, the planner)
    retired: bool = False  # removed from the pool (or the pool closed): its channel closes once idle
    watching: bool = False  # its watcher is running or about to (and may start RPCs on the channel)
    watcher: asyncio.Task | None = field(default=None, repr=False)  # the health and KV-event watches, on the loop

    @property
    def key(self) -> str:
        return f"{self.role}/{self.address}"

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]


class NodePool:
    def __init__(
        self,
        nodes: list[tuple[str, str]],
        health_retry_s: float = 1.0,
        loop: rpc.EventLoop | None = None,
        connect: bool = True,
        policy: Policy | None = None,
    ):
        """nodes: (role, address) pairs; loop: where the channels and watchers live (required unless
        connect=False, which makes channel-less nodes for selection tests); policy: how a node is
        picked (cache_aware by default)."""
        if connect and loop is None:
            raise ValueError("a pool that connects to its nodes needs the event loop its channels live on")
        self.health_retry_s = health_retry_s
        # the router's API key, presented on every Generation call to a node: a node that guards its
        # own Generation with the same key (kvbridge serve --http-port --api-key-file) takes them
        self.call_metadata = auth_metadata(rpc.security().api_key)
        self.connect = connect
        self.policy = policy or Policy()
        self.on_resync: Callable[[str], None] = lambda reason: None  # a KV index was cleared to resync, and why
        self.loop = loop
        self.nodes: list[Node] = []  # replaced, never mutated in place: a reader may iterate it unlocked
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._turns: dict[tuple[str, ...], int] = {}  # round-robin position per role set
        self._started = False  # watchers run (start() was called); add() starts a new node's at once
        self._closed = False
        self._closing: set[asyncio.Task] = set()  # channel.close() calls under way (held: tasks are weakly kept)
        self._listeners: list[Callable[[], None]] = []  # called (outside the lock) after a change
        self._stranding: dict[Node, Callable[[str], None]] = {}  # switches under way -> on_stranded (begin_switch)
        for role, address in nodes:
            self.add(role, address)

    # ------------------------------------------------------------------ the fleet

    def add(self, role: str, address: str) -> Node:
        """A new node, eligible once its first health report says SERVING. ValueError on a bad
        role or address, or a (role, address) already in the pool."""
        if role not in SERVICE_OF_ROLE:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {shown(role)}")
        address = normalized_address(address, role)
        with self._lock:
            self._check_addable(role, address)
        channel = self._make_channel(address) if self.connect else None
        with self._lock:
            try:
                self._check_addable(role, address)  # (again: another add may have come in meanwhile)
            except ValueError:
                if channel is not None:
                    self._close_channel(channel)
                raise
            node = Node(role, address, channel)
            self.nodes = [*self.nodes, node]
            start = self._started and node.channel is not None
            node.watching = start
        if start:
            self.loop.call(self._start_watcher, node)
        self._notify()
        return node

    def remove(self, address: str, role: str = "") -> Node:
        """Take a node out of the pool: no request is routed to it from now on, its health watch
        ends, and its channel closes once the requests it is serving end. role "" = whichever
        role `address` has. KeyError when no such node; ValueError when role is bad or "" is
        ambiguous (the address is in the pool under two roles)."""
        if role and role not in SERVICE_OF_ROLE:
            raise ValueError(f"role must be one of {', '.join(ROLES)} (or empty), got {shown(role)}")
        address = normalized_address(address)
        with self._lock:
            found = [n for n in self.nodes if n.address == address and (not role or n.role == role)]
            if not found:
                raise KeyError(f"no {role + ' ' if role else ''}node {shown(address)} in the pool")
            if len(found) > 1:
                roles = " and ".join(n.role for n in found)
                raise ValueError(f"{shown(address)} is in the pool as {roles}: say which role to remove")
            [node] = found
            self.nodes = [n for n in self.nodes if n is not node]
            node.retired = True
        node.blocks.clear()
        if self.loop is not None:
            self.loop.call(self._stop_watcher, node)
        self._close_if_idle(node)
        self._notify()
        return node

    # ------------------------------------------------------------------ selection and accounting

    def pick(
        self,
        roles: Collection[str],
        exclude: Collection[Node] = (),
        prompt: PromptBlocks | None = None,
        among: Collection[Node] = (),
    ) -> Pick | None:
        """The eligible node of one of `roles` the policy picks for a prompt with these blocks
        (None: unknown), counted as outstanding (and its share of the prompt as pending) from now
        on; None when none is eligible. `among`: only these nodes (a gateway's choice; reason
        "gateway"), or any when none of them is eligible."""
        cached = self._cached(roles, exclude, prompt)  # (outside the lock: indexes have their own)
        with self._lock:
            # (a node switching role refuses new requests: it turns NOT_SERVING a moment later)
            live = [n for n in self.nodes if n.role in roles and n.healthy and not n.switching_to and n not in exclude]
            chosen = [n for n in live if n in among]
            live = chosen or live
            if not live:
                return None
            turn = tuple(sorted(roles))
            at = self._turns.get(turn, 0)
            self._turns[turn] = at + 1
            tokens = prompt.tokens if prompt is not None else 0
            overlaps = None if cached is None else [cached.get(n, 0) for n in live]
            choice = self.policy.choose(live, at, tokens, overlaps)
            node = live[choice.index]
            node.outstanding, node.routed = node.outstanding + 1, node.routed + 1
            node.pending_tokens += choice.tokens
            reason, cached_tokens = "gateway" if chosen else choice.reason, overlaps[choice.index] if overlaps else 0
            return Pick(node, reason, choice.tokens, cached_tokens)

    def prefill_nodes_at(self, addresses: Collection[str]) -> list[Node]:
        """The pool's prefill nodes at these addresses (a gateway's prefill choice): the node at the
        address, else the one prefill node on its host (a gateway names a pod by its IP and the
        pool's target port, not the node's gRPC port). ValueError naming the first address that is
        neither: a request may not steer the router to any other host."""
        with self._lock:
            prefill = [n for n in self.nodes if n.role == "prefill"]
        out = []
        for a in addresses:
            try:
                key = normalized_address(a, "address")
            except ValueError:
                raise ValueError(f"{shown(a)} is not a prefill node of this router") from None
            host = key.rpartition(":")[0]
            same = [n for n in prefill if n.address == key] or [n for n in prefill if n.host == host]
            if len(same) != 1:
                raise ValueError(f"{shown(a)} is not a prefill node of this router")
            out.append(same[0])
        return out

    def acquire(self, roles: Collection[str], exclude: Collection[Node] = ()) -> Node | None:
        """pick() without a prompt: the least loaded (ties round-robin) under least_loaded and
        cache_aware, the next in turn under round_robin."""
        picked = self.pick(roles, exclude)
        return picked.node if picked is not None else None

    def release(self, node: Node, tokens: int = 0) -> None:
        """The request acquired on `node` ended; tokens: its Pick.tokens."""
        with self._lock:
            assert node.outstanding > 0, f"release of {node.key} with nothing outstanding"
            assert node.pending_tokens >= tokens, f"release of {tokens} tokens from {node.key} holding fewer"
            node.outstanding -= 1
            node.pending_tokens -= tokens
        self._close_if_idle(node)

    def queued_tokens(self, role: str, exclude: Collection[Node] = (), among: Collection[Node] = ()) -> int | None:
        """The fewest pending prompt tokens among the eligible nodes of `role` (of `among` when one of
        them is eligible, as pick() would); None when none is eligible (router/local_prefill.py)."""
        with self._lock:
            live = [n for n in self.nodes if n.role == role and n.healthy and not n.switching_to and n not in exclude]
            return min((n.pending_tokens for n in [n for n in live if n in among] or live), default=None)

    def add_tokens(self, node: Node, tokens: int) -> None:
        """`node` is to compute `tokens` more prompt tokens (fewer, when negative): a decode node's local prefill."""
        with self._lock:
            node.pending_tokens += tokens

    def page_sizes(self) -> set[int]:
        """The page sizes of the nodes whose KV index is synced (what a prompt is hashed at)."""
        return {n.blocks.page_size for n in self.nodes if n.blocks.synced}

    def _cached(
        self, roles: Collection[str], exclude: Collection[Node], prompt: PromptBlocks | None
    ) -> dict[Node, int] | None:
        """Prompt tokens each candidate holds; None without a prompt or when no candidate is indexed."""
        if prompt is None or not self.policy.needs_prompt:
            return None
        nodes = [n for n in self.nodes if n.role in roles and n.healthy and n not in exclude and n.blocks.synced]
        cached = {}
        for n in nodes:
            size = n.blocks.page_size
            if size in prompt.hashes:
                cached[n] = min(n.blocks.overlap(prompt.hashes[size]) * size, prompt.tokens)
        return cached if nodes else None

    def has_role(self, role: str) -> bool:
        """Some node of `role` is in the pool, healthy or not."""
        with self._lock:
            return any(n.role == role for n in self.nodes)

    def has_eligible(self, role: str, exclude: Collection[Node] = ()) -> bool:
        with self._lock:
            return any(n.healthy for n in self.nodes if n.role == role and n not in exclude)

    def outstanding(self) -> dict[str, int]:
        """Outstanding requests per node, keyed role/address."""
        with self._lock:
            return {n.key: n.outstanding for n in self.nodes}

    def models(self) -> list[generation_pb2.ModelInfo]:
        """ModelInfo of the healthy nodes that serve Generation, one per distinct model name."""
        with self._lock:
            infos = [n.model for n in self.nodes if n.healthy and n.model is not None]
        return list({m.model: m for m in infos}.values())

    def agreed_model(self) -> generation_pb2.ModelInfo | None:
        """The model every healthy Generation node reports (same name and fingerprint); None when
        they differ or none has reported one."""
        with self._lock:
            infos = [n.model for n in self.nodes if n.healthy and n.model is not None]
        return infos[0] if len({(m.model, m.fingerprint) for m in infos}) == 1 else None

    # ------------------------------------------------------------------ health

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` after every change of a node's health and every add or remove."""
        self._listeners.append(callback)

    def set_health(self, node: Node, healthy: bool) -> None:
        with self._lock:
            changed = node.healthy != healthy or not node.reported
            node.healthy, node.reported = healthy, True
            self._changed.notify_all()
        if changed:
            self._notify()

    def start(self) -> None:
        """Start watching every node's health (from any thread)."""
        with self._lock:
            self._started = True
            watched = [n for n in self.nodes if n.channel is not None]
            for node in watched:
                node.watching = True
        for node in watched:
            self.loop.call(self._start_watcher, node)

    def wait_reported(self, timeout: float) -> bool:
        """Block until every node has had a first health report, at most `timeout` seconds (from a
        thread other than the loop's)."""
        with self._lock:
            return self._changed.wait_for(lambda: all(n.reported for n in self.nodes), timeout)

    async def aclose(self) -> None:
        """Stop every watcher; each channel closes once the requests still using it are released
        (cancel them first to close everything now). On the loop."""
        nodes = self._retire_all()
        for node in nodes:
            self._stop_watcher(node)
        watchers = [n.watcher for n in nodes if n.watcher is not None]
        if watchers:
            await asyncio.wait(watchers, timeout=CLOSE_WAIT_S)
        for node in nodes:
            self._close_if_idle(node)
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=CLOSE_WAIT_S)

    def close(self) -> None:
        """aclose() from a thread other than the loop's (a pool without a loop only retires its nodes)."""
        if self.loop is None:
            self._retire_all()
            return
        self.loop.run(self.aclose(), timeout=3 * CLOSE_WAIT_S)

    # ------------------------------------------------------------------ internals

    def _check_addable(self, role: str, address: str) -> None:
        if self._closed:
            raise ValueError("the node pool is closed")
        if any(n.role == role and n.address == address for n in self.nodes):
            raise ValueError(f"a {role} node {shown(address)} is already in the pool")
        if len(self.nodes) >= MAX_NODES:
            raise PoolFull(f"the pool holds {len(self.nodes)} nodes, its limit; remove one first")

    def _retire_all(self) -> list[Node]:
        with self._lock:
            self._closed = True
            nodes, self.nodes = self.nodes, []
            for node in nodes:
                node.retired = True
        for node in nodes:
            node.blocks.clear()
        return nodes

    def _notify(self) -> None:
        self._check_switches()
        for callback in self._listeners:
            callback()

    def _make_channel(self, address: str) -> grpc.aio.Channel:
        if self.loop.on_loop:
            return rpc.make_aio_channel(address)

        async def make() -> grpc.aio.Channel:
            return rpc.make_aio_channel(address)

        return self.loop.run(make())

    def _start_watcher(self, node: Node) -> None:  # on the loop
        if node.retired:  # removed before its watcher got going
            with self._lock:
                node.watching = False
            self._close_if_idle(node)
            return
        node.watcher = asyncio.ensure_future(self._watch(node))

    def _stop_watcher(self, node: Node) -> None:  # on the loop
        if node.watcher is not None:
            node.watcher.cancel()

    def _close_if_idle(self, node: Node) -> None:
        """Close a retired node's channel once no request and no watcher can use it (once only)."""
        with self._lock:
            idle = node.retired and node.outstanding == 0 and not node.watching and node.channel is not None
            channel = node.channel if idle else None
            if idle:
                node.channel = None
        if channel is not None:
            self._close_channel(channel)

    def _close_channel(self, channel: grpc.aio.Channel) -> None:
        def close() -> None:
            task = asyncio.ensure_future(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

        self.loop.call(close)

    async def _watch(self, node: Node) -> None:
        try:
            async with asyncio.TaskGroup() as watches:
                watches.create_task(watch_health(self, node))
                watches.create_task(watch_kv(node, self.health_retry_s, self.on_resync))
        finally:
            node.blocks.clear()
            with self._lock:
                node.watching = False
            self._close_if_idle(node)

    def set_role(self, node: Node, role: str, epoch: int) -> bool:
        """An elastic node has `role` since its switch number `epoch` (an older report is ignored);
        True when that changed its role here."""
        if role not in SERVICE_OF_ROLE:
            return False
        with self._lock:
            if epoch < node.role_epoch:
                return False
            changed, node.role, node.role_epoch = node.role != role, role, epoch
        if changed:
            self._notify()
        return changed

    def begin_switch(self, node: Node, role: str, on_stranded: Callable[[str], None] | None = None) -> str:
        """Mark a switch of `node` to `role` as under way (end_switch ends it), or say why it may not
        switch now: a switch of it is under way, or it is the last healthy node of its role (those
        switching away count as gone; the last colocated node may go where a P:D pair serves).
        on_stranded(why): called once (from the thread of the change) if, before end_switch, the
        switch comes to leave its role with no node after all: another node of the role turned
        unhealthy, left the pool or changed role meanwhile (switched straight at the node, say)."""
        with self._lock:
            if node.switching_to:
                return f"a switch of {node.address} to {node.switching_to} is in progress"
            if role == node.role:
                return ""
            if self._strands(node, role):
                return (
                    f"{node.address} is the last {node.role} node serving: switching it to {role} leaves the "
                    f"fleet no {node.role} node"
                )
            node.switching_to = role
            if on_stranded is not None:
                self._stranding[node] = on_stranded
            return ""

    def end_switch(self, node: Node) -> None:
        with self._lock:
            node.switching_to = ""
            self._stranding.pop(node, None)

    def _strands(self, node: Node, role: str) -> bool:
        """Switching `node` to `role` leaves its role with no healthy node (under the lock)."""
        others = [n for n in self.nodes if n.healthy and not n.switching_to and n is not node]
        after = {n.role for n in others} | {role}
        # a P:D role keeps a node; the colocated role may go when a P:D pair serves instead
        return node.role not in after and (node.role != "colocated" or not {"prefill", "decode"} <= after)

    def _check_switches(self) -> None:
        """Tell the switches under way that would now strand their role so (begin_switch's on_stranded)."""
        with self._lock:
            stranded = [(n, tell) for n, tell in self._stranding.items() if self._strands(n, n.switching_to)]
            for n, _ in stranded:
                del self._stranding[n]
        for n, tell in stranded:
            tell(
                f"{n.address} would be the last {n.role} node serving: another {n.role} node turned unhealthy, "
                "left the pool or changed role while it waited to switch"
            )
