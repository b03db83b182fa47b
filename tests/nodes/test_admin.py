"""The nodes' Admin API on real processes: status, request listings, aborts in every phase of
a disaggregated request (through a real router), drain and resume, config, health when a
rank process dies, /metrics. Faults (engine/faults.py) slow chosen stages down so that a
request stays long enough in the phase under test."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from urllib.request import urlopen

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge.common import rpc
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import admin_pb2, common_pb2, generation_pb2, generation_pb2_grpc
from tests.pd import TINY, admin, start_nodes, stop_nodes, token_prompt, wait_idle

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(addr: str, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(rpc.make_channel(addr))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_phase(addr: str, rid: str, phase: str, timeout: float = 30) -> admin_pb2.RequestInfo:
    """The request's listing once the node shows it in `phase`."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        for r in admin(addr).ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests:
            if r.rid == rid:
                seen.append(r.phase)
                if r.phase == phase:
                    return r
        time.sleep(0.02)
    raise AssertionError(f"{rid} never reached {phase} on {addr}; phases seen: {sorted(set(seen))}")


class Call:
    """A Generate call through the router, consumed in a thread; .result() is (tokens, error)."""

    def __init__(self, port: int, rid: str, prompt: list[int], max_new_tokens: int):
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{port}"))
        sampling = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        req = generation_pb2.GenerateRequest(rid=rid, prompt=token_prompt(prompt), sampling=sampling)
        self.stream = stub.Generate(req, timeout=120)
        self.tokens: list[int] = []
        self.transfer: generation_pb2.TransferStats | None = None  # the decode node's, on its first response
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for resp in self.stream:
                self.tokens += resp.token_ids
                if resp.HasField("transfer"):
                    self.transfer = resp.transfer
        except grpc.RpcError as e:
            self.error = e

    def result(self, timeout: float = 60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call did not end"
        return self.tokens, self.error


# ---------------------------------------------------------------------- disaggregated, every phase

D_POOL_TOKENS = 48  # 12 pages of 4: one request of 8 + 40 tokens (12 pages) at a time


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    """P: slow steps (a 40-token prompt prefills in 5 chunks of 0.4 s: after its registration lands,
    chunks are left for an abort to find it prefilling) and a held transfer report; D: a pool for
    one request at a time, slow decode steps, a held arrival report."""
    p_config = replace(TINY, chunked_prefill_size=8, fault_inject="step_delay_ms=400,transfer_delay_ms=1500")
    d_config = replace(TINY, kv_cache_tokens=D_POOL_TOKENS, fault_inject="step_delay_ms=150,transfer_delay_ms=1500")
    nodes = start_nodes({"p": ("prefill", 1, p_config), "d": ("decode", 1, "shm", d_config)})
    p, d = nodes["p"], nodes["d"]
    router = start_router(
        RouterConfig(port=0, http_port=0, prefill=(p.address,), decode=(d.address,), startup_wait_s=10)
    )
    yield p, d, router
    router.stop()
    stop_nodes(nodes)


def abort(addr: str, rid: str) -> admin_pb2.AbortRequestResponse:
    return admin(addr).AbortRequest(admin_pb2.AbortRequestRequest(rid=rid), timeout=10)


def assert_aborted_by_operator(call: Call, where: str) -> None:
    _, error = call.result()
    assert error is not None and error.code() == grpc.StatusCode.CANCELLED, error
    assert f"aborted by an operator (Admin.AbortRequest on the {where} node" in error.details()


def assert_idle(*addrs: str) -> None:
    for addr in addrs:
        st = wait_idle(addr)
        assert [r.kv_pages_used for r in st.ranks] == [0], (addr, st)
        assert st.requests_in_flight == 0 and st.transfers_in_flight == 0, (addr, st)


@pytest.mark.long
def test_abort_in_every_phase_ends_the_request_and_frees_both_nodes(fleet):
    p, d, router = fleet
    # decoding (D) while another waits for D's pages: prealloc on D and bootstrap on P at once
    long = Call(router.port, "long", list(range(1, 9)), 40)
    info = wait_phase(d.address, "long", "decoding")
    assert (info.phase, info.peer, info.prompt_tokens) == ("decoding", p.address, 8)
    assert info.kv_pages >= 3 and info.room > 0
    waiting = Call(router.port, "waiting", list(range(11, 19)), 40)
    assert wait_phase(d.address, "waiting", "prealloc").kv_pages == 0
    assert wait_phase(p.address, "waiting", "bootstrap").peer == ""  # D has not registered yet
    assert abort(d.address, "waiting").phase == "prealloc"
    assert_aborted_by_operator(waiting, "decode")
    also = Call(router.port, "also", list(range(21, 29)), 40)
    wait_phase(p.address, "also", "bootstrap")
    assert abort(p.address, "also").phase == "bootstrap"
    assert_aborted_by_operator(also, "prefill")
    assert abort(d.address, "long").phase == "decoding"
    assert_aborted_by_operator(long, "decode")
    assert_idle(p.address, d.address)

    # prefilling (P): a 40-token prompt in 5 chunks of 8 tokens
    slow = Call(router.port, "slow", list(range(1, 41)), 4)
    info = wait_phase(p.address, "slow", "prefilling")
    while not info.peer:  # registration overlaps prefill: D's lands a moment after the first chunk starts
        info = wait_phase(p.address, "slow", "prefilling")
    assert info.peer == d.address and info.kv_pages >= 4
    assert abort(p.address, "slow").phase == "prefilling"
    assert_aborted_by_operator(slow, "prefill")
    assert_idle(p.address, d.address)

    # transferring, on P (its pushes' report held back) and then on D (the arrival report held back)
    for side, node in (("prefill", p), ("decode", d)):
        call = Call(router.port, f"moving-{side}", list(range(1, 9)), 8)
        wait_phase(node.address, f"moving-{side}", "transferring")
        assert abort(node.address, f"moving-{side}").phase == "transferring"
        assert_aborted_by_operator(call, side)
        assert_idle(p.address, d.address)

    # and the fleet still serves, token for token the same as before the aborts
    first = Call(router.port, "after-1", list(range(1, 9)), 6).result()
    again = Call(router.port, "after-2", list(range(1, 9)), 6).result()
    assert first[1] is None and again[1] is None
    assert len(first[0]) == 6 and first[0] == again[0]
    assert_idle(p.address, d.address)


def test_both_listings_show_the_hand_off_of_a_request(fleet):
    """Admin.ListRequests names each request's hand-off once known: the backend, the pages moved (the
    prompt's: D's cache held none of this new prompt) and their bytes over every layer (checked against
    the decode node's TransferStats, computed from its layout), and on the prefill node, once every
    push landed, how long the hand-off took after the prompt was computed (P's transfer report is
    held 1.5 s here, so the request is caught in that phase; the time is that far only once done)."""
    p, d, router = fleet
    call = Call(router.port, "shown", list(range(101, 111)), 30)  # 10 tokens: 3 pages of 4
    on_p = wait_phase(p.address, "shown", "transferring")  # (D's arrival report is held too: it decodes after)
    on_d = wait_phase(d.address, "shown", "decoding")
    tokens, error = call.result()
    assert error is None and len(tokens) == 30 and call.transfer is not None
    assert (on_d.backend, on_d.kv_pages_moved, on_d.peer) == ("shm", 3, p.address)
    assert (on_p.backend, on_p.kv_pages_moved, on_p.peer) == ("shm", 3, d.address)
    assert on_d.kv_bytes_moved == on_p.kv_bytes_moved == call.transfer.kv_bytes > 0
    assert on_p.handoff_s == 0.0  # (not done yet: set when every push landed)
    assert_idle(p.address, d.address)


def test_abort_of_an_unknown_or_missing_rid_is_a_clear_error(fleet):
    p, d, _ = fleet
    for addr in (p.address, d.address):
        with pytest.raises(grpc.RpcError) as e:
            abort(addr, "no-such-request")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'no-such-request'" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            abort(addr, "")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_node_status_config_and_router_only_methods(fleet):
    p, d, _ = fleet
    for node, role, queues in (
        (p, "prefill", {"waiting", "running", "forked", "inflight_microbatches", "bootstrap", "inflight"}),
        (d, "decode", {"waiting", "running", "forked", "inflight_microbatches", "prealloc", "transfer", "retracted"}),
    ):
        st = admin(node.address).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
        assert (st.role, st.model, st.pp_size, st.serving, st.draining) == (role, "tiny-random", 1, True, False)
        assert set(st.queues) == queues
        assert st.ranks[0].kv_pages_total == (12 if role == "decode" else 1024)
        config = json.loads(admin(node.address).GetConfig(admin_pb2.GetConfigRequest(), timeout=10).json)
        assert (config["role"], config["address"], config["transfer_backend"]) == (
            role,
            node.address,
            node_backend(role),
        )
        assert config["engine"]["model"] == "tiny-random" and config["pp"]["pp_size"] == 1
        with pytest.raises(grpc.RpcError) as e:
            admin(node.address).ListNodes(admin_pb2.ListNodesRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "ask the router" in e.value.details()


def node_backend(role: str) -> str:
    return "shm" if role == "decode" else "auto"


def test_list_requests_pages_and_filters(fleet):
    p, d, router = fleet
    calls = [Call(router.port, f"list-{i}", [i + 1] * 8, 3) for i in range(3)]
    deadline = time.monotonic() + 30
    while True:  # all three on P at once: one in flight, the rest queued behind D's pool
        listing = admin(p.address).ListRequests(admin_pb2.ListRequestsRequest(page_size=2), timeout=10)
        if listing.total == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert listing.total == 3 and len(listing.requests) == 2 and listing.next_page_token == "2"
    rest = admin(p.address).ListRequests(admin_pb2.ListRequestsRequest(page_size=2, page_token="2"), timeout=10)
    assert len(rest.requests) == 1 and rest.next_page_token == ""
    whole = admin(p.address).ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests
    ages = [r.age_s for r in whole]
    assert len(ages) == 3 and ages == sorted(ages, reverse=True)  # oldest first
    assert {r.rid for r in [*listing.requests, *rest.requests]} == {"list-0", "list-1", "list-2"}
    for bad in (admin_pb2.ListRequestsRequest(page_size=1001), admin_pb2.ListRequestsRequest(page_token="x")):
        with pytest.raises(grpc.RpcError) as e:
            admin(p.address).ListRequests(bad, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for call in calls:
        assert call.result()[1] is None
    assert_idle(p.address, d.address)


# ---------------------------------------------------------------------- drain, rank death, metrics


def test_drain_refuses_new_requests_finishes_in_flight_ones_and_resume_serves_again(hard_timeout):
    config = replace(TINY, fault_inject="step_delay_ms=50")
    node = start_node("colocated", NodeConfig(config, PPConfig(), metrics_port=0))
    try:
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address))
        sampling = common_pb2.SamplingParams(max_new_tokens=20, ignore_eos=True)
        req = generation_pb2.GenerateRequest(rid="inflight", prompt=token_prompt([1, 2, 3]), sampling=sampling)
        stream = stub.Generate(req, timeout=60)
        first = next(stream)  # in flight now
        result: dict = {}
        waiter = threading.Thread(
            target=lambda: result.update(r=admin(node.address).Drain(admin_pb2.DrainRequest(wait_s=30), timeout=60))
        )
        waiter.start()
        deadline = time.monotonic() + 10
        while health_of(node.address, "kvbridge.v1.Generation") != NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert health_of(node.address, "") == NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generation_pb2.GenerateRequest(prompt=token_prompt([4]), sampling=sampling), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        tokens = list(first.token_ids) + [t for r in stream for t in r.token_ids]
        assert len(tokens) == 20  # the request in flight finished
        waiter.join(30)
        assert (result["r"].draining, result["r"].empty, result["r"].requests_in_flight) == (True, True, 0)
        st = admin(node.address).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
        assert (st.draining, st.serving) == (True, False)
        resumed = admin(node.address).Resume(admin_pb2.ResumeRequest(), timeout=10)
        assert (resumed.draining, resumed.requests_in_flight) == (False, 0)
        assert health_of(node.address, "kvbridge.v1.Generation") == SERVING
        again = list(stub.Generate(req, timeout=60))
        assert [t for r in again for t in r.token_ids] == tokens  # greedy: the same prompt, the same tokens
        body = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
        assert 'kvbridge_requests_total{outcome="length"} 2.0' in body
        assert "kvbridge_node_time_to_first_token_seconds_count 2.0" in body
        assert 'kvbridge_queue_requests{queue="waiting"} 0.0' in body
        assert 'kvbridge_kv_pages{rank="0"} 1024.0' in body
        assert "kvbridge_draining 0.0" in body
        assert 'kvbridge_scheduler_decisions_total{kind="admit"} 2.0' in body  # from the rank process
    finally:
        node.stop()


def test_a_killed_rank_turns_health_not_serving_and_fails_its_requests(hard_timeout):
    config = replace(TINY, fault_inject="step_delay_ms=50")
    node = start_node("colocated", NodeConfig(config, PPConfig(pp_size=2)))
    try:
        assert health_of(node.address, "kvbridge.v1.Generation") == SERVING
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address))
        sampling = common_pb2.SamplingParams(max_new_tokens=200, ignore_eos=True)
        stream = stub.Generate(
            generation_pb2.GenerateRequest(prompt=token_prompt([1, 2]), sampling=sampling), timeout=60
        )
        next(stream)
        node.node.ranks.procs[1].kill()  # SIGKILL rank 1
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details() == "pipeline rank 1 of the colocated node died"
        assert health_of(node.address, "kvbridge.v1.Generation") == NOT_SERVING
        st = admin(node.address).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
        assert [(r.rank, r.alive) for r in st.ranks] == [(0, True), (1, False)] and not st.serving
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generation_pb2.GenerateRequest(prompt=token_prompt([3]), sampling=sampling), timeout=10))
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "the colocated node lost pipeline rank 1",
        )
    finally:
        node.node.ranks.kill()
        node.server.stop(0)


def test_admin_cli_against_a_real_node(capsys, hard_timeout):
    from kvbridge.cli import main

    node = start_node("colocated", NodeConfig(replace(TINY, fault_inject="step_delay_ms=50"), PPConfig()))
    try:
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address))
        sampling = common_pb2.SamplingParams(max_new_tokens=200, ignore_eos=True)
        req = generation_pb2.GenerateRequest(rid="cli-1", prompt=token_prompt([1, 2, 3]), sampling=sampling)
        stream = stub.Generate(req, timeout=60)
        next(stream)
        assert main(["admin", "requests", "--target", node.address, "--json"]) == 0
        listing = json.loads(capsys.readouterr().out)
        [r] = listing["requests"]
        assert (listing["total"], r["rid"], r["phase"], r["prompt_tokens"]) == (1, "cli-1", "decoding", 3)
        assert main(["admin", "abort", "cli-1", "--target", node.address]) == 0
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        capsys.readouterr()
        assert main(["admin", "abort", "cli-1", "--target", node.address]) == 1
        err = capsys.readouterr().err
        assert err == f"kvbridge admin: error: NOT_FOUND: no request 'cli-1' on this node (target {node.address})\n"
        assert main(["admin", "drain", "--wait", "5", "--target", node.address, "--json"]) == 0
        drained = json.loads(capsys.readouterr().out)
        assert (drained["draining"], drained["empty"]) == (True, True)
        assert health_of(node.address, "kvbridge.v1.Generation") == NOT_SERVING
        assert main(["admin", "resume", "--target", node.address, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["draining"] is False
        assert health_of(node.address, "kvbridge.v1.Generation") == SERVING
        assert main(["admin", "status", "--target", node.address, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["ranks"] == [{"rank": 0, "alive": True, "kv_pages_used": 0, "kv_pages_total": 1024}]
        assert (status["role"], status["requests_served"]) == ("colocated", 1)
    finally:
        node.stop()
