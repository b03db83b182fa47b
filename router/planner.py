"""The SLO planner (`kvbridge router --planner slo --slo-ttft-ms X --slo-itl-ms Y`): moves elastic
nodes between prefill and decode, one at a time, as the traffic's mix shifts.

Every --planner-interval-s it reads two kinds of figures:
- the router's own: the 90th percentile of time to first token and of the gap between tokens, over
  the requests it relayed in the interval (router/metrics.py feeds a `Window`);
- each node's queues (Admin.GetStatus, with this router's admin key): requests a prefill node has
  not started to compute (`waiting`), and requests a decode node has no KV pages for yet
  (`prealloc`, `retracted`), per node of the role. A decode node takes a request's pages when it
  arrives, before its prompt is computed, so its queue also fills while prompts wait for prefill:
  it is counted in the share of decode pages that decoding requests hold (`running` over `running`
  + `transfer`), the part of it that more decode nodes would serve.

`Planner.decide` (pure: figures in, a move or none out) wants a node more on one side when an SLO
is missed by more than --planner-margin: TTFT, on the side whose queue per node is longer (a first
token waits for prefill, or for a decode node's pages); ITL, on the decode side. It moves one node
once the same want held for --planner-patience intervals in a row, and only a node that may go:
elastic, healthy, switched no sooner than --planner-min-dwell-s ago (nor any node), of a role that keeps another
healthy node, and only when the move evens the queues out (the donors' queue per node after it stays
below the takers'); the donor is the one with the fewest requests outstanding. No move while one is under way.

The move is Admin.SetRole on the node (router/planner.py `switch`, as the router's Admin.SetRole
does): the node drains (or, with --planner-migrate, hands its streams back to be resumed
elsewhere), switches, and the pool routes by the new split at once. Each move is logged
(`event=planner_switch` with the figures), counted in kvbridge_planner_switches_total{from,to,reason},
and listed in the router's Admin status.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from kvbridge.common import rpc, security
from kvbridge.common.logs import log_event
from kvbridge.router.pool import Node, NodePool
from kvbridge.v1 import admin_pb2, admin_pb2_grpc

log = logging.getLogger("kvbridge.router")
SWITCH_WAIT_S = 120.0  # a node's SetRole wait when the caller gives none (elastic_node/service.py's)
STATUS_DEADLINE_S = 2.0
WINDOW_SAMPLES = 20_000  # samples kept per interval and kind (a uniform reservoir past it)
MOVES_LISTED = 20


class SwitchRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


async def switch(pool: NodePool, node: Node, role: str, wait_s: float = 0.0, migrate: bool = False):
    """The node's Admin.SetRole with this router's admin key, unless the pool refuses the switch
    (SwitchRefused: ABORTED while one of the node is under way, FAILED_PRECONDITION for the last node
    of a role); the pool takes the node's new role from its answer. Raises grpc.aio.AioRpcError when
    the node fails it.

    While the node waits to switch (for its requests to end), the fleet may change under it: were
    another node of its role to go (unhealthy, removed, or switched straight at that node, behind
    this router's back), the switch would leave the role with none. The pool says so (on_stranded),
    and the switch is withdrawn: a SetRole back to the node's role, which the node takes as
    withdrawing the switch it waits on or, if it made it already, as a switch back
    (elastic_node/service.py); SwitchRefused ABORTED saying why."""
    loop = asyncio.get_running_loop()
    stranded: asyncio.Future[str] = loop.create_future()

    def on_stranded(why: str) -> None:  # (from whichever thread changed the pool)
        loop.call_soon_threadsafe(lambda: stranded.done() or stranded.set_result(why))

    old, problem = node.role, pool.begin_switch(node, role, on_stranded)
    if problem:
        code = grpc.StatusCode.ABORTED if node.switching_to else grpc.StatusCode.FAILED_PRECONDITION
        raise SwitchRefused(code, problem)
    stub = admin_pb2_grpc.AdminStub(node.channel)
    metadata = security.auth_metadata(rpc.security().admin_key)
    timeout = (wait_s or SWITCH_WAIT_S) + 30
    request = admin_pb2.SetRoleRequest(role=role, wait_s=wait_s, migrate=migrate)
    asked = asyncio.ensure_future(stub.SetRole(request, timeout=timeout, metadata=metadata))
    try:
        await asyncio.wait({asked, stranded}, return_when=asyncio.FIRST_COMPLETED)
        if stranded.done():
            back = admin_pb2.SetRoleRequest(role=old, wait_s=wait_s)
            answer = await stub.SetRole(back, timeout=timeout, metadata=metadata)
            await asyncio.wait({asked})  # (ABORTED: withdrawn; or done, and switched back since)
            pool.set_role(node, answer.role, answer.role_epoch)
            log_event(log, "switch_withdrawn", logging.WARNING, node=node.address, role=role, why=stranded.result())
            message = f"the switch of {node.address} to {role} was withdrawn: {stranded.result()}"
            raise SwitchRefused(grpc.StatusCode.ABORTED, message)
        answer = asked.result()
    finally:
        pool.end_switch(node)
        if not asked.done():
            asked.cancel()  # (the node's switch goes on: a node does not drop one whose caller left)
        asked.add_done_callback(lambda a: a.cancelled() or a.exception())  # (its error is not ours to raise)
    pool.set_role(node, answer.role, answer.role_epoch)
    return answer


class Window:
    """Latency samples of one interval (router/metrics.py adds them; the planner takes them)."""

    def __init__(self, cap: int = WINDOW_SAMPLES, seed: int = 0):
        self.cap, self._rng = cap, random.Random(seed)
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self._seen = {"ttft": 0, "itl": 0}

    def add(self, kind: str, seconds: float) -> None:
        samples = self.ttft if kind == "ttft" else self.itl
        self._seen[kind] += 1
        if len(samples) < self.cap:
            samples.append(seconds)
        elif (j := self._rng.randrange(self._seen[kind])) < self.cap:
            samples[j] = seconds

    def take(self) -> tuple[float | None, float | None]:
        """(TTFT p90, ITL p90) of the samples since the last take (None where there were none)."""
        out = p90(self.ttft), p90(self.itl)
        self.ttft, self.itl, self._seen = [], [], {"ttft": 0, "itl": 0}
        return out


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


@dataclass(frozen=True)
class Signals:
    ttft_p90_s: float | None  # over the last interval (None: no first token in it)
    itl_p90_s: float | None
    prefill_queue: float  # requests waiting to be prefilled, per prefill node
    decode_queue: float  # requests waiting for a decode node's KV pages, per decode node

    def figures(self) -> dict:
        ms = {
            k: None if v is None else round(v * 1000, 1)
            for k, v in (("ttft", self.ttft_p90_s), ("itl", self.itl_p90_s))
        }
        return {
            "ttft_p90_ms": ms["ttft"],
            "itl_p90_ms": ms["itl"],
            "prefill_queue": round(self.prefill_queue, 2),
            "decode_queue": round(self.decode_queue, 2),
        }


@dataclass(frozen=True)
class NodeView:
    """What the planner knows of one node."""

    address: str
    role: str
    healthy: bool = True
    elastic: bool = True
    outstanding: int = 0
    switched_s: float = float("-inf")  # when it last switched (the planner's clock)


@dataclass(frozen=True)
class Move:
    address: str
    old: str
    role: str
    reason: str  # "ttft" | "itl": the SLO missed
    signals: Signals

    def line(self) -> str:
        figures = " ".join(f"{k}={v}" for k, v in self.signals.figures().items())
        return f"{self.address} {self.old} -> {self.role} ({self.reason} over its SLO; {figures})"


@dataclass
class Planner:
    slo_ttft_s: float
    slo_itl_s: float
    patience: int = 2  # intervals in a row the same want must hold
    min_dwell_s: float = 30.0  # a node stays in a role at least this long
    margin: float = 0.1  # an SLO is missed when the p90 exceeds it by this fraction
    _want: tuple[str, str] | None = field(default=None, init=False)
    _streak: int = field(default=0, init=False)
    _moved_s: float = field(default=float("-inf"), init=False)  # when the last move was decided

    def want(self, s: Signals) -> tuple[str, str] | None:
        """(the role that needs a node more, the SLO missed), or None."""
        over = 1 + self.margin
        if s.ttft_p90_s is not None and s.ttft_p90_s > self.slo_ttft_s * over:
            if s.prefill_queue > s.decode_queue:
                return "prefill", "ttft"
            if s.decode_queue > s.prefill_queue:
                return "decode", "ttft"
            return None  # slow with nothing queued: another node of either role would not help
        if s.itl_p90_s is not None and s.itl_p90_s > self.slo_itl_s * over:
            return "decode", "itl"
        return None

    def decide(self, s: Signals, nodes: list[NodeView], now: float) -> Move | None:
        want = self.want(s)
        self._streak = self._streak + 1 if want is not None and want == self._want else int(want is not None)
        self._want = want
        if want is None or self._streak < self.patience or now - self._moved_s < self.min_dwell_s:
            return None  # (and one move's effect shows before the next: the fleet dwells too)
        role, reason = want
        donor_role = "decode" if role == "prefill" else "prefill"
        healthy = [n for n in nodes if n.healthy]
        have = {r: sum(n.role == r for n in healthy) for r in (role, donor_role)}
        if have[donor_role] < 2:
            return None  # never leave a role empty
        # only a move that evens the queues out: the donors' queue per node after it stays below the
        # takers' (else the next interval would want the node back)
        queue = {"prefill": s.prefill_queue, "decode": s.decode_queue}
        after_donor = queue[donor_role] * have[donor_role] / (have[donor_role] - 1)
        if after_donor >= queue[role] * have[role] / (have[role] + 1):
            return None
        donors = [n for n in healthy if n.role == donor_role and n.elastic and now - n.switched_s >= self.min_dwell_s]
        if not donors:
            return None
        donor = min(donors, key=lambda n: (n.outstanding, n.address))
        self._streak, self._moved_s = 0, now  # (the next move needs its own run of intervals)
        return Move(donor.address, donor_role, role, reason, s)


class PlannerLoop:
    """The planner, run on the router's event loop every `interval_s`."""

    def __init__(self, pool: NodePool, planner: Planner, window: Window, interval_s: float, migrate: bool, on_move):
        self.pool, self.planner, self.window = pool, planner, window
        self.interval_s, self.migrate, self.on_move = interval_s, migrate, on_move
        self.switched: dict[str, float] = {}  # address -> when the planner last switched it
        self.moves: deque[str] = deque(maxlen=MOVES_LISTED)  # lines, oldest first
        self.busy = False
        self.moving: asyncio.Task | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.turn()
            except Exception as e:  # a turn that failed must not end the planner
                log_event(log, "planner_error", logging.WARNING, error=f"{type(e).__name__}: {e}")

    async def turn(self) -> Move | None:
        ttft, itl = self.window.take()
        if self.busy:
            return None
        nodes = [n for n in self.pool.nodes if n.channel is not None]
        statuses = await asyncio.gather(*(self._status(n) for n in nodes))
        signals = Signals(ttft, itl, *queues_of([(n.role, st) for n, st in zip(nodes, statuses) if st is not None]))
        now = time.monotonic()
        candidates = [
            NodeView(
                n.address, n.role, n.healthy, n.elastic, n.outstanding, self.switched.get(n.address, float("-inf"))
            )
            for n in nodes
        ]
        move = self.planner.decide(signals, candidates, now)
        log_event(log, "planner_turn", logging.DEBUG, want=str(self.planner.want(signals)), **signals.figures())
        if move is not None:
            node = next(n for n in nodes if n.address == move.address)
            self.busy = True
            self.moving = asyncio.ensure_future(self._move(node, move))  # (held: tasks are weakly kept)
        return move

    async def _move(self, node: Node, move: Move) -> None:
        began = time.monotonic()
        try:
            await switch(self.pool, node, move.role, migrate=self.migrate)
        except (SwitchRefused, grpc.aio.AioRpcError) as e:
            log_event(log, "planner_switch_failed", logging.WARNING, node=move.address, role=move.role, error=str(e))
            return
        finally:
            self.busy = False
            self.switched[move.address] = time.monotonic()
        took = round(time.monotonic() - began, 3)
        self.moves.append(f"{move.line()} in {took} s")
        self.on_move(move)
        log_event(
            log, "planner_switch", node=move.address, old=move.old, role=move.role, reason=move.reason,
            switch_s=took, **move.signals.figures(),
        )  # fmt: skip

    async def _status(self, node: Node) -> admin_pb2.Status | None:
        try:
            stub = admin_pb2_grpc.AdminStub(node.channel)
            metadata = security.auth_metadata(rpc.security().admin_key)
            return await stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=STATUS_DEADLINE_S, metadata=metadata)
        except grpc.aio.AioRpcError:
            return None


def queues_of(statuses: list[tuple[str, admin_pb2.Status]]) -> tuple[float, float]:
    """(prefill queue, decode queue) per node of each role (see the module docstring)."""
    waiting = [st.queues.get("waiting", 0) for role, st in statuses if role == "prefill"]
    decode = [st.queues for role, st in statuses if role == "decode"]
    prefill_queue = sum(waiting) / len(waiting) if waiting else 0.0
    if not decode:
        return prefill_queue, 0.0
    short = sum(q.get("prealloc", 0) + q.get("retracted", 0) for q in decode)
    running, transfer = sum(q.get("running", 0) for q in decode), sum(q.get("transfer", 0) for q in decode)
    return prefill_queue, short * running / max(1, running + transfer) / len(decode)
