"""Nodes that die under load, on real processes: `kill -9` of a prefill node while requests are in
flight on it, then of a decode node. A request in flight completes with the tokens of a run before
the kill: retried elsewhere before its first token, migrated to the other decode node after it
(tests/e2e/test_migration.py has more), or it did not need the dead node any more; a prefill
node's request whose only pair is gone may fail with UNAVAILABLE within LIVENESS_BOUND_S of the
kill. The surviving nodes free every page; new requests keep being served.

The nodes are subprocesses (`python -m kvbridge prefill|decode`), so that they can be killed; the
router runs in the test process. Faults (engine/faults.py) slow the nodes so that requests are
caught in every phase."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import admin_pb2, common_pb2, generation_pb2, generation_pb2_grpc
from tests.pd import admin, token_prompt

LIVENESS_BOUND_S = 3.0  # a killed node's requests are retried or failed within this: at once (a reset connection,
# ~0.1 s here), not after a keepalive timeout (15 s); the margin is a loaded 2-core host's
HARD_TIMEOUT_S = 300  # the whole module (the hard_timeout fixture, tests/conftest.py)
MAX_NEW_TOKENS = 12
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(18 + i)] for i in range(8)]  # 18..25 tokens: two chunks of 16
SAMPLING = common_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
STARTED: list[NodeProcess] = []  # every node process of the module, killed on the hard timeout
pytestmark = pytest.mark.usefixtures("hard_timeout")  # tests/conftest.py: HARD_TIMEOUT_S, before_hard_exit


def before_hard_exit() -> None:
    """On the hard timeout, before the stacks are dumped and the run exits: kill the node processes."""
    for node in STARTED:
        node.kill()


class NodeProcess:
    """`python -m kvbridge ROLE` on a free port; its stderr is drained by a thread (last lines kept)."""

    def __init__(self, role: str, *flags: str):
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge", role, "--model", "tiny-random", "--port", "0", "--page-size", "4",
             "--chunked-prefill-size", "16", "--kv-cache-tokens", "4096", "--log-level", "warning", "--quiet", *flags],
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        STARTED.append(self)
        self.address = ""
        self.lines: list[str] = []  # the last stderr lines
        self._ready = threading.Event()
        threading.Thread(target=self._drain, name=f"stderr-{role}", daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines = [*self.lines[-50:], line]
            if line.startswith(f"kvbridge {self.role}: listening on "):
                self.address = line.split("listening on ")[1].strip()
                self._ready.set()
        self._ready.set()  # EOF: exited

    def wait_ready(self, timeout: float = 120) -> str:
        assert self._ready.wait(timeout) and self.address, f"{self.role} node not ready:\n{''.join(self.lines)}"
        return self.address

    def kill(self) -> None:
        """kill -9 the node's process (its rank processes see their parent die and exit)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        with contextlib.suppress(ProcessLookupError):  # anything of the node's session still alive
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_processes(specs: dict[str, tuple[str, ...]]) -> dict[str, NodeProcess]:
    """name -> (role, *flags), started at once and waited for together."""
    nodes = {name: NodeProcess(*spec) for name, spec in specs.items()}
    for node in nodes.values():
        node.wait_ready()
    return nodes


def pages_used(addr: str) -> list[int]:
    return [r.kv_pages_used for r in admin(addr).GetStatus(admin_pb2.GetStatusRequest(), timeout=10).ranks]


def wait_for(predicate, timeout: float, what: str) -> float:
    """Poll until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def poll(find, timeout: float, what: str):
    """Call `find` until it returns something; returns that."""
    deadline = time.monotonic() + timeout
    while not (found := find()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return found


def node_phases(addr: str) -> Counter:
    requests = admin(addr).ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests
    return Counter(r.phase for r in requests)


class Call:
    """A Generate call through the router, read in a thread: tokens, error, when it ended."""

    def __init__(self, port: int, index: int, rid: str = ""):
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{port}"))
        req = generation_pb2.GenerateRequest(rid=rid, prompt=token_prompt(PROMPTS[index]), sampling=SAMPLING)
        self.index = index
        self.stream = stub.Generate(req, timeout=60)
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.ended = 0.0  # time.monotonic() when the call ended
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for resp in self.stream:
                self.tokens += resp.token_ids
        except grpc.RpcError as e:
            self.error = e
        self.ended = time.monotonic()

    def result(self, timeout: float = 60) -> Call:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"call {self.index} did not end"
        return self


def moves(router_phases) -> list[tuple[float, dict]]:
    """The router's `phase=retry|migrate` lines so far (tests/conftest.py router_phases)."""
    return [(t, f) for t, f in router_phases if f["phase"] in ("retry", "migrate")]


def make_router(prefill: list[str], decode: list[str]):
    return start_router(
        RouterConfig(
            port=0, http_port=0, prefill=tuple(prefill), decode=tuple(decode), health_retry_s=0.2, startup_wait_s=30
        )
    )


def reference(port: int) -> list[list[int]]:
    """Each prompt's tokens through the router, before anything is killed; then every node's prefix
    cache is emptied (the router's Admin asks them all), so that the same prompts sent again prefill
    whole and stay in each phase as long as the fault delays say."""
    calls = [Call(port, i) for i in range(len(PROMPTS))]
    results = [c.result() for c in calls]
    assert [c.error for c in results] == [None] * len(PROMPTS)
    assert all(len(c.tokens) == MAX_NEW_TOKENS for c in results)
    admin(f"127.0.0.1:{port}").ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=10)
    return [c.tokens for c in results]


def router_peers(router) -> list[admin_pb2.RequestInfo]:
    return list(admin(f"127.0.0.1:{router.port}").ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests)


# ---------------------------------------------------------------------- a prefill node dies


@pytest.mark.long
def test_a_killed_prefill_node_has_its_requests_retried_and_the_decode_node_frees_their_pages(router_phases):
    # P: 0.3 s a step (a prompt prefills in two: a wide window to catch some prefilling), and each
    # request held 1.5 s in `transferring`;
    # D: 0.05 s a step, so that requests stay in flight
    slow_p = ("--fault-inject", "step_delay_ms=300,transfer_delay_ms=1500")
    nodes = start_processes(
        {"p1": ("prefill", *slow_p), "p2": ("prefill", *slow_p), "d": ("decode", "--fault-inject", "step_delay_ms=50")}
    )
    p_addrs, d = [nodes["p1"].address, nodes["p2"].address], nodes["d"]
    router = make_router(p_addrs, [d.address])
    try:
        expected = reference(router.port)
        wait_for(lambda: pages_used(d.address) == [0], 30, "the decode node idle after the reference run")

        calls = [Call(router.port, i, rid=f"victim-{i}") for i in range(len(PROMPTS))]

        # the victim: a prefill node with requests transferring (D has their KV) and prefilling at once
        def caught(addr: str) -> bool:
            phases = node_phases(addr)
            return phases["transferring"] > 0 and phases["bootstrap"] + phases["prefilling"] > 0

        victim_addr = poll(
            lambda: next((a for a in p_addrs if caught(a)), None), 30, "a prefill node transferring and prefilling"
        )
        on_victim = {r.rid for r in router_peers(router) if r.peer.startswith(victim_addr + " ")}
        victim = next(n for n in nodes.values() if n.address == victim_addr)
        killed = time.monotonic()
        victim.kill()
        victim_node = router.pool.nodes[p_addrs.index(victim_addr)]
        down = wait_for(lambda: not victim_node.healthy, LIVENESS_BOUND_S, "the router sees the victim down")

        results = [c.result() for c in calls]
        for c in results:
            if c.error is None:
                assert c.tokens == expected[c.index], c.index
            else:  # only a request that had a token out may fail, and then at once
                assert c.error.code() == grpc.StatusCode.UNAVAILABLE, (c.index, c.error)
                assert c.ended - killed < LIVENESS_BOUND_S, (c.index, c.ended - killed)
        retry_lines = moves(router_phases)
        retried = {fields["rid"] for _, fields in retry_lines}
        assert retried <= on_victim and retried, (retried, on_victim)
        assert max(t for t, _ in retry_lines) - killed < LIVENESS_BOUND_S
        assert all(f["code"] == "UNAVAILABLE" for _, f in retry_lines)
        print(
            f"prefill kill: {len(on_victim)} requests on the victim, {len(retried)} retried, retries within "
            f"{max(t for t, _ in retry_lines) - killed:.3f} s; completed "
            f"{sum(c.error is None for c in results)}/{len(results)}; the router saw it down after {down:.3f} s"
        )

        # the decode node's pages all came back
        wait_for(lambda: pages_used(d.address) == [0], 30, "the decode node's pages back")
        survivor = next(a for a in p_addrs if a != victim_addr)
        wait_for(lambda: pages_used(survivor) == [0], 30, "the surviving prefill node's pages back")
        # and new requests are served, token for token as before
        after = [Call(router.port, i).result() for i in range(4)]
        assert [(c.error, c.tokens) for c in after] == [(None, expected[i]) for i in range(4)]
        wait_for(lambda: router.dispatcher.num_in_flight() == 0, 10, "the router idle")
        wait_for(lambda: pages_used(d.address) == [0] and pages_used(survivor) == [0], 30, "all idle")
    finally:
        router.stop(grace_s=0)
        for node in nodes.values():
            node.stop()


# ---------------------------------------------------------------------- a decode node dies

NODE_TIMEOUT_S = 3.0  # the prefill nodes' --bootstrap-timeout-s and --transfer-timeout-s


@pytest.mark.long
def test_a_killed_decode_node_has_its_streams_migrated_or_retried_and_the_prefill_nodes_free_its_rooms(router_phases):
    # P: 0.2 s a step, so that prompts finish prefilling one after another; D: 0.1 s a step
    p_flags = ("--fault-inject", "step_delay_ms=200", "--bootstrap-timeout-s", str(NODE_TIMEOUT_S),
               "--transfer-timeout-s", str(NODE_TIMEOUT_S))  # fmt: skip
    d_flags = ("--fault-inject", "step_delay_ms=100")
    nodes = start_processes(
        {
            "p1": ("prefill", *p_flags),
            "p2": ("prefill", *p_flags),
            "d1": ("decode", *d_flags),
            "d2": ("decode", *d_flags),
        }
    )
    p_addrs, d_addrs = [nodes["p1"].address, nodes["p2"].address], [nodes["d1"].address, nodes["d2"].address]
    router = make_router(p_addrs, d_addrs)
    try:
        expected = reference(router.port)
        calls = [Call(router.port, i, rid=f"victim-{i}") for i in range(len(PROMPTS))]

        # the victim: a decode node streaming to some of its clients while others wait for a first token
        def on(addr: str) -> list[admin_pb2.RequestInfo]:
            return [r for r in router_peers(router) if r.peer.endswith(" -> " + addr)]

        def caught(addr: str) -> bool:
            tokens = [r.output_tokens for r in on(addr)]
            return any(tokens) and not all(tokens)

        victim_addr = poll(
            lambda: next((a for a in d_addrs if caught(a)), None), 30, "a decode node streaming and waiting at once"
        )
        victim = next(n for n in nodes.values() if n.address == victim_addr)
        listed = {r.rid: r.output_tokens for r in on(victim_addr)}  # a moment before the kill
        killed = time.monotonic()
        victim.kill()

        # every call completes with the tokens of the run before: those with tokens out moved on
        # to the other decode node (migrated), those without were retried
        results = [c.result() for c in calls]
        assert [(c.error, c.tokens) for c in results] == [(None, want) for want in expected]
        retry_lines = moves(router_phases)
        migrated = {f["rid"]: t for t, f in retry_lines if f["phase"] == "migrate"}
        retried = {f["rid"] for _, f in retry_lines if f["phase"] == "retry"}
        assert migrated and retried, (listed, migrated, retried)
        assert {rid for rid, n in listed.items() if n} <= set(migrated) and set(migrated) | retried == set(listed)
        assert max(t for t, _ in retry_lines) - killed < LIVENESS_BOUND_S
        print(
            f"decode kill: {len(listed)} requests on the victim, {len(migrated)} migrated (tokens out), "
            f"{len(retried)} retried, all within {max(t for t, _ in retry_lines) - killed:.3f} s"
        )

        # the prefill nodes free the pages of the victim's rooms (at the latest at their timeouts)
        freed = wait_for(lambda: all(pages_used(a) == [0] for a in p_addrs), NODE_TIMEOUT_S + 2, "prefill pages")
        print(f"prefill pages back {freed:.3f} s after the last call ended")
        survivor = next(a for a in d_addrs if a != victim_addr)
        wait_for(lambda: pages_used(survivor) == [0], 30, "the surviving decode node's pages back")
        after = [Call(router.port, i).result() for i in range(4)]
        assert [(c.error, c.tokens) for c in after] == [(None, expected[i]) for i in range(4)]
        wait_for(lambda: router.dispatcher.num_in_flight() == 0, 10, "the router idle")
        wait_for(lambda: all(pages_used(a) == [0] for a in [*p_addrs, survivor]), 30, "all idle")
    finally:
        router.stop(grace_s=0)
        for node in nodes.values():
            node.stop()
