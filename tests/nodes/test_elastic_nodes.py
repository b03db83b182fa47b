"""Elastic nodes (elastic_node/): a prefill node and a decode node swap roles with Admin.SetRole and
serve disaggregated requests equal to colocated serving before and after, at pp 1 and 2; odd and
hostile calls get clear statuses and change nothing."""

from __future__ import annotations

import secrets
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.router.config import RouterConfig
from kvbridge.router.planner import Move, Signals
from kvbridge.router.server import start_router
from kvbridge.v1 import admin_pb2, common_pb2, generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.conftest import make_llm, make_prompts
from tests.pd import (
    TINY,
    admin,
    in_parallel,
    pd_generate,
    signed_route,
    start_nodes,
    stop_nodes,
    token_prompt,
    wait_idle,
)

MAX_NEW = 10
SERVICES = ("kvbridge.v1.Generation", "kvbridge.v1.Prefill", "kvbridge.v1.Bootstrap")


@pytest.fixture(scope="module")
def pair(hard_timeout):
    """An elastic node that starts as prefill (pp 2) and two that start as decode (pp 1)."""
    nodes = start_nodes({"a": ("prefill", 2), "b": ("decode", 1, "auto"), "c": ("decode", 1, "auto")}, elastic=True)
    yield nodes
    stop_nodes(nodes)


@pytest.fixture(scope="module")
def reference(tiny_model):
    prompts = make_prompts(4, tiny_model.config.vocab_size, seed=7, min_len=3, max_len=60)
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)
    outputs = [c.output_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))]
    return prompts, outputs


def set_role(addr: str, role: str, **fields) -> admin_pb2.SetRoleResponse:
    return admin(addr).SetRole(admin_pb2.SetRoleRequest(role=role, **fields), timeout=60)


def health(addr: str) -> dict[str, str]:
    stub = health_pb2_grpc.HealthStub(rpc.make_channel(addr))
    out = {}
    for name in ("", *SERVICES):
        status = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
        out[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    return out


def model_info(addr: str) -> generation_pb2.ModelInfo:
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(addr))
    return stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)


def served_pd(p_addr: str, d_addr: str, prompts: list[list[int]]) -> list[list[int]]:
    results = in_parallel(lambda ids: pd_generate(p_addr, d_addr, token_prompt(ids), MAX_NEW), [(p,) for p in prompts])
    for _, _, prefill in results:
        assert not isinstance(prefill, grpc.RpcError), prefill
    return [tokens for tokens, _, _ in results]


PREFILL_UP = {"": "SERVING", SERVICES[0]: "NOT_SERVING", SERVICES[1]: "SERVING", SERVICES[2]: "SERVING"}
GENERATION_UP = {"": "SERVING", SERVICES[0]: "SERVING", SERVICES[1]: "NOT_SERVING", SERVICES[2]: "NOT_SERVING"}


def test_two_nodes_swap_roles_and_serve_equal_to_colocated(pair, reference):
    a, b = pair["a"].address, pair["b"].address
    prompts, expected = reference
    assert (health(a), health(b)) == (PREFILL_UP, GENERATION_UP)
    assert served_pd(a, b, prompts) == expected
    # b: decode -> prefill; a: prefill -> decode (a at pp 2: every rank switches)
    first = set_role(b, "prefill")
    assert (first.old_role, first.role, first.role_epoch, first.node) == ("decode", "prefill", 1, b)
    assert 0 <= first.drain_s <= first.switch_s < 30
    second = set_role(a, "decode")
    assert (second.old_role, second.role, second.role_epoch) == ("prefill", "decode", 1)
    assert (health(a), health(b)) == (GENERATION_UP, PREFILL_UP)
    assert [(i.role, i.elastic, i.role_epoch) for i in map(model_info, (a, b))] == [
        ("decode", True, 1),
        ("prefill", True, 1),
    ]
    st = admin(a).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    assert (st.role, st.elastic, st.role_epoch, st.switching_to, st.serving) == ("decode", True, 1, "", True)
    assert served_pd(b, a, prompts) == expected  # the new split: P = b, D = a
    # the old split is refused by role, with a status a router retries elsewhere
    results = in_parallel(lambda ids: pd_generate(a, b, token_prompt(ids), MAX_NEW), [(prompts[0],)])
    error = results[0][2]
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "is a decode node now" in error.details() or "is a prefill node now" in error.details()
    # and back again: a decode node that held pages of its prefix cache as prefill still matches them
    assert set_role(a, "prefill").role_epoch == 2 and set_role(b, "decode").role_epoch == 2
    assert served_pd(a, b, prompts) == expected
    for addr in (a, b):
        st = wait_idle(addr)
        assert not any(st.queues.values()) and st.requests_in_flight == 0


def test_a_colocated_switch_serves_whole_requests(pair, reference):
    a, b = pair["a"].address, pair["b"].address
    prompts, expected = reference
    assert set_role(b, "colocated").role == "colocated"
    try:
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(b))
        for ids, want in zip(prompts, expected):
            req = generation_pb2.GenerateRequest(
                prompt=token_prompt(ids), sampling={"max_new_tokens": MAX_NEW, "ignore_eos": True}
            )
            assert [t for r in stub.Generate(req, timeout=60) for t in r.token_ids] == want
    finally:
        assert set_role(b, "decode").role == "decode"
    assert model_info(a).role == "prefill"


def test_odd_and_hostile_switches_get_clear_statuses(pair):
    a, b = pair["a"].address, pair["b"].address
    cases = [
        ({"role": "router"}, grpc.StatusCode.INVALID_ARGUMENT, "role must be one of prefill, decode, colocated"),
        ({"role": "decode", "wait_s": -1}, grpc.StatusCode.INVALID_ARGUMENT, "wait_s must be >= 0"),
        ({"role": "decode", "wait_s": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "wait_s must be >= 0"),
        ({"role": "decode", "node": "10.0.0.9:1"}, grpc.StatusCode.INVALID_ARGUMENT, "name a node only to a router"),
        # 10 KB: shown cut short, so the status is the one meant (not RESOURCE_EXHAUSTED for its size)
        ({"role": "r" * 10_000}, grpc.StatusCode.INVALID_ARGUMENT, f"got '{'r' * 79}...(10002 chars)"),
    ]
    for fields, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            admin(b).SetRole(admin_pb2.SetRoleRequest(**fields), timeout=30)
        assert e.value.code() == code and words in e.value.details() and len(e.value.details()) < 200, fields
    epoch = model_info(b).role_epoch
    assert (model_info(b).role, health(b)) == ("decode", GENERATION_UP)  # nothing changed
    # the same role: nothing to do, at once
    assert model_info(b).role_epoch == epoch
    same = set_role(a, "prefill")
    assert (same.old_role, same.role, same.switch_s) == ("prefill", "prefill", 0.0)


def test_a_switch_asked_during_a_switch_is_aborted_and_the_first_finishes(pair, reference):
    a, b = pair["a"].address, pair["b"].address
    prompts, expected = reference
    held = HeldRequest(a, b, prompts[0])  # live on b (decode) until its prefill half is sent: b's switch waits for it
    try:
        first: list = []
        switching = threading.Thread(target=lambda: first.append(set_role(b, "prefill", wait_s=60)))
        switching.start()
        deadline = time.monotonic() + 60
        while admin(b).GetStatus(admin_pb2.GetStatusRequest(), timeout=10).switching_to != "prefill":
            assert time.monotonic() < deadline, "b's switch never started"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:
            set_role(b, "colocated")
        assert e.value.code() == grpc.StatusCode.ABORTED
        assert "a switch from decode to prefill is in progress" in e.value.details()
        assert health(b)[""] == "NOT_SERVING"
        assert held.finish() == expected[0]  # it finished, whole
        switching.join(60)
    finally:
        held.close()
    assert first[0].role == "prefill" and first[0].drain_s > 0
    assert set_role(b, "decode").role == "decode"


def test_a_fixed_node_refuses_to_switch(colocated_node):
    with pytest.raises(grpc.RpcError) as e:
        set_role(colocated_node.address, "prefill")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "was not started with --elastic: its role is fixed" in e.value.details()


def router_generate(address: str, ids: list[int]) -> list[int]:
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(address))
    req = generation_pb2.GenerateRequest(
        prompt=token_prompt(ids), sampling={"max_new_tokens": MAX_NEW, "ignore_eos": True}
    )
    return [t for r in stub.Generate(req, timeout=60) for t in r.token_ids]


def wait_learned(router_address: str, want: dict) -> None:
    """Until the router lists its nodes as `want`: address -> (role, healthy, elastic, role_epoch)."""

    def learned():
        listed = admin(router_address).ListNodes(admin_pb2.ListNodesRequest(), timeout=10).nodes
        return {n.address: (n.role, n.healthy, n.elastic, n.role_epoch) for n in listed}

    deadline = time.monotonic() + 30
    while learned() != want:
        assert time.monotonic() < deadline, learned()
        time.sleep(0.05)


def served(address: str) -> int:
    return admin(address).GetStatus(admin_pb2.GetStatusRequest(), timeout=10).requests_served


def test_a_router_learns_roles_switched_at_the_nodes(pair, reference):
    """Switched at the nodes themselves (not through the router): the router sees each go NOT_SERVING
    and come back, reads its role from GetModelInfo, and routes by the new split."""
    a, b = pair["a"].address, pair["b"].address
    prompts, expected = reference
    router = start_router(RouterConfig(port=0, prefill=(a,), decode=(b,), health_retry_s=0.1, startup_wait_s=30))
    address = f"127.0.0.1:{router.port}"
    try:
        ea, eb = model_info(a).role_epoch, model_info(b).role_epoch  # (earlier tests switched them)
        wait_learned(address, {a: ("prefill", True, True, ea), b: ("decode", True, True, eb)})
        assert [router_generate(address, p) for p in prompts] == expected
        set_role(b, "prefill")
        set_role(a, "decode")
        wait_learned(address, {a: ("decode", True, True, ea + 1), b: ("prefill", True, True, eb + 1)})
        assert [router_generate(address, p) for p in prompts] == expected
        before = served(a)
        assert router_generate(address, prompts[0]) == expected[0]
        assert served(a) == before + 1
    finally:
        router.stop(grace_s=0)
        set_role(a, "prefill")
        set_role(b, "decode")


def test_a_router_started_with_the_old_roles_learns_the_new_ones(pair, reference):
    """A router (re)started with its nodes listed as they were before a switch (a planner moved
    them, then the router restarted): each one's listed role service says NOT_SERVING, the router
    reads its ModelInfo, finds it elastic in another role, and routes by the split it has."""
    a, b = pair["a"].address, pair["b"].address
    prompts, expected = reference
    set_role(a, "decode")
    set_role(b, "prefill")
    ea, eb = model_info(a).role_epoch, model_info(b).role_epoch
    router = start_router(RouterConfig(port=0, prefill=(a,), decode=(b,), health_retry_s=0.1, startup_wait_s=30))
    address = f"127.0.0.1:{router.port}"
    try:
        wait_learned(address, {a: ("decode", True, True, ea), b: ("prefill", True, True, eb)})
        before = served(a)
        assert [router_generate(address, p) for p in prompts] == expected
        assert served(a) == before + len(prompts)
    finally:
        router.stop(grace_s=0)
        set_role(a, "prefill")
        set_role(b, "decode")


def test_the_planner_loop_moves_a_node_counts_and_lists_the_move(pair):
    """PlannerLoop on real nodes, its decision made for it: the move goes through the same switch
    as Admin.SetRole; the pool, the counter and the router's Admin status show it."""
    a, b, c = (pair[n].address for n in "abc")
    config = RouterConfig(
        port=0, prefill=(a,), decode=(b, c), health_retry_s=0.1, startup_wait_s=30, planner="slo",
        planner_interval_s=0.1,
    )  # fmt: skip
    router = start_router(config)
    loop = router.dispatcher.planner
    signals = Signals(2.0, 0.01, prefill_queue=7, decode_queue=0)
    loop.planner = Told(Move(c, "decode", "prefill", "ttft", signals))
    try:
        deadline = time.monotonic() + 30
        while not loop.moves:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert model_info(c).role == "prefill"
        assert {n.address: n.role for n in router.pool.nodes} == {a: "prefill", b: "decode", c: "prefill"}
        [line] = loop.moves
        assert line.startswith(
            f"{c} decode -> prefill (ttft over its SLO; ttft_p90_ms=2000.0 itl_p90_ms=10.0 prefill_queue=7 "
            "decode_queue=0) in "
        )
        registry = router.dispatcher.metrics.registry
        labels = {"from": "decode", "to": "prefill", "reason": "ttft"}
        assert registry.get_sample_value("kvbridge_planner_switches_total", labels) == 1.0
        status = admin(f"127.0.0.1:{router.port}").GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
        assert list(status.planner_moves) == [line]
    finally:
        router.stop(grace_s=0)
        set_role(c, "decode")


class Told:
    """A planner that makes one move it was told to (the loop's mechanics under test, not its choice)."""

    def __init__(self, move):
        self.move = move

    def want(self, signals):
        return None

    def decide(self, signals, nodes, now):
        move, self.move = self.move, None
        return move


class HeldRequest:
    """A request whose decode half runs on `d_addr` and waits there, live, for its prefill half, which
    is sent to `p_addr` only when `finish()` is called: it keeps the decode node busy (a switch of it
    waits) for exactly as long as a test needs, whatever the machine's speed."""

    def __init__(self, p_addr: str, d_addr: str, ids: list[int]):
        self.p_addr, self.rid, self.room = p_addr, secrets.token_hex(8), secrets.randbits(63)
        self.prompt = token_prompt(ids)
        self.sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
        route = signed_route(self.room, p_addr)
        req = generation_pb2.GenerateRequest(rid=self.rid, prompt=self.prompt, sampling=self.sampling, prefill=route)
        self.stream = generation_pb2_grpc.GenerationStub(rpc.make_channel(d_addr)).Generate(req, timeout=120)
        self.responses: list = []
        self.thread = threading.Thread(target=self._read)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not any(r.rid == self.rid for r in admin(d_addr).ListRequests(admin_pb2.ListRequestsRequest()).requests):
            assert time.monotonic() < deadline, "the held request never reached the decode node"
            time.sleep(0.01)

    def _read(self) -> None:
        try:
            self.responses.extend(self.stream)
        except grpc.RpcError as e:
            self.responses.append(e)

    def finish(self) -> list[int]:
        """Send its prefill half; the tokens it got once it ended."""
        req = prefill_pb2.PrefillRequest(rid=self.rid, room=self.room, prompt=self.prompt, sampling=self.sampling)
        prefill_pb2_grpc.PrefillStub(rpc.make_channel(self.p_addr)).Prefill(req, timeout=60)
        self.thread.join(60)
        assert not [r for r in self.responses if isinstance(r, grpc.RpcError)], self.responses
        return [t for r in self.responses for t in r.token_ids]

    def close(self) -> None:
        self.stream.cancel()  # (nothing, once it ended)
        self.thread.join(60)


def test_a_router_withdraws_its_switch_when_a_direct_one_would_leave_no_decode_node(pair, reference):
    """The race of two hands: the router switches decode node b to prefill, and b waits for its request
    to end; meanwhile an operator switches the other decode node, c, straight at the node, where the
    router's last-node guard cannot refuse it. The router sees c go and withdraws b's switch: b never
    leaves decode, requests are served throughout (a -> b), and c's switch, the operator's, stands."""
    a, b, c = (pair[n].address for n in "abc")
    prompts, expected = reference
    router = start_router(RouterConfig(port=0, prefill=(a,), decode=(b, c), health_retry_s=0.1, startup_wait_s=30))
    address = f"127.0.0.1:{router.port}"
    ea, eb, ec = (model_info(n).role_epoch for n in (a, b, c))
    on_b, on_c = HeldRequest(a, b, prompts[0]), HeldRequest(a, c, prompts[1])  # each switch waits for one
    asked: dict[str, object] = {}

    def ask(name: str, call) -> threading.Thread:
        def run():
            try:
                asked[name] = call()
            except grpc.RpcError as e:
                asked[name] = e

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    try:
        wait_learned(
            address, {a: ("prefill", True, True, ea), b: ("decode", True, True, eb), c: ("decode", True, True, ec)}
        )
        by_router = admin_pb2.SetRoleRequest(role="prefill", node=b, wait_s=60)
        routed = ask("router", lambda: admin(address).SetRole(by_router, timeout=90))
        while admin(b).GetStatus(admin_pb2.GetStatusRequest(), timeout=10).switching_to != "prefill":
            time.sleep(0.01)
        direct = ask("direct", lambda: set_role(c, "prefill", wait_s=60))  # c waits for its request too
        routed.join(60)
        withdrawn = asked["router"]
        assert isinstance(withdrawn, grpc.RpcError) and withdrawn.code() == grpc.StatusCode.ABORTED, withdrawn
        assert withdrawn.details() == (
            f"the switch of {b} to prefill was withdrawn: {b} would be the last decode node serving: another "
            "decode node turned unhealthy, left the pool or changed role while it waited to switch"
        )
        assert (model_info(b).role, model_info(b).role_epoch) == ("decode", eb)  # b never switched
        wait_learned(
            address, {a: ("prefill", True, True, ea), b: ("decode", True, True, eb), c: ("decode", False, True, ec)}
        )
        assert [router_generate(address, p) for p in prompts] == expected  # served while c switches
        assert on_c.finish() == expected[1]  # c's request ends: c switches
        direct.join(60)
        assert (asked["direct"].old_role, asked["direct"].role) == ("decode", "prefill")
        assert on_b.finish() == expected[0]  # b's request, unharmed by the withdrawn switch
        wait_learned(
            address, {a: ("prefill", True, True, ea), b: ("decode", True, True, eb), c: ("prefill", True, True, ec + 1)}
        )
        assert [router_generate(address, p) for p in prompts] == expected
    finally:
        on_b.close()
        on_c.close()
        router.stop(grace_s=0)
        if model_info(c).role != "decode":
            set_role(c, "decode")
