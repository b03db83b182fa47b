"""Node timeouts and admission control on real processes: each ends the request with a clear
status within its bound, counts itself in kvbridge_timeouts_total, and frees every page."""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import replace
from urllib.request import urlopen

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.engine.config import PPConfig
from kvbridge.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.pd import TINY, pd_generate, signed_route, stop_nodes, token_prompt, wait_idle

pytestmark = pytest.mark.usefixtures("hard_timeout")  # 600 s for the module (tests/conftest.py)


def metric(port: int, name: str, labels: str) -> float:
    body = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", body, re.M)
    return float(found.group(1)) if found else 0.0


def prefill_call(addr: str, ids: list[int], room: int, max_new_tokens: int = 4):
    sampling = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    req = prefill_pb2.PrefillRequest(rid=secrets.token_hex(4), room=room, prompt=token_prompt(ids), sampling=sampling)
    return prefill_pb2_grpc.PrefillStub(rpc.make_channel(addr)).Prefill(req, timeout=30)


def test_a_prefill_request_without_registration_times_out_and_frees_its_pages():
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig

    p = start_node("prefill", NodeConfig(replace(TINY, bootstrap_timeout_s=1.0), PPConfig(pp_size=2), metrics_port=0))
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            prefill_call(p.address, [1, 2, 3, 4, 5], room=12345)  # no decode node will ever register room 12345
        waited = time.monotonic() - t0
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert e.value.details() == "the decode node did not register room 12345 within 1 s"
        assert 1.0 <= waited < 3.0
        assert metric(p.metrics_port, "kvbridge_timeouts_total", 'timeout="bootstrap"') == 1
        st = wait_idle(p.address)
        assert [r.kv_pages_used for r in st.ranks] == [0, 0] and st.requests_in_flight == 0
    finally:
        p.stop()


@pytest.mark.long
def test_decode_prealloc_and_transfer_timeouts_fail_the_request_and_free_both_sides():
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig

    # P never says that its pages are all sent (so D's transfer timeout ends the hand-off, however fast P
    # is); D holds one request's pages at a time and gives up quickly: a request waiting for pages fails
    # (1 s) well before the one holding them (3 s after its pages were reserved)
    p = start_node("prefill", NodeConfig(replace(TINY, fault_inject="drop_notice=1"), PPConfig(), metrics_port=0))
    d_config = replace(TINY, kv_cache_tokens=48, prealloc_timeout_s=1.0, transfer_timeout_s=3.0)
    d = start_node("decode", NodeConfig(d_config, PPConfig(pp_size=2), transfer_backend="shm", metrics_port=0))
    nodes = {"p": p, "d": d}
    try:
        tokens, _, error = pd_generate(p.address, d.address, token_prompt(list(range(1, 41))), 4)
        assert tokens == [] and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.details() == "the KV cache did not arrive within 3 s"
        assert metric(d.metrics_port, "kvbridge_timeouts_total", 'timeout="transfer"') == 1
        for node in (p, d):
            st = wait_idle(node.address)
            assert not any(r.kv_pages_used for r in st.ranks) and st.requests_in_flight == 0, st

        # prealloc: a request that needs the whole pool waits behind one holding part of it
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(d.address))
        holder = generation_pb2.GenerateRequest(
            rid="holder",
            prompt=token_prompt([1, 2, 3, 4]),
            sampling=common_pb2.SamplingParams(max_new_tokens=40, ignore_eos=True),
            prefill=signed_route(777, p.address),
        )
        held = stub.Generate(holder, timeout=60)  # D reserves its pages; P never hears of room 777
        d_admin = admin_pb2_grpc.AdminStub(rpc.make_channel(d.address))
        deadline = time.monotonic() + 10
        while [r.phase for r in d_admin.ListRequests(admin_pb2.ListRequestsRequest()).requests] != ["transferring"]:
            assert time.monotonic() < deadline, "the holder never got its pages"
            time.sleep(0.01)
        tokens, _, error = pd_generate(p.address, d.address, token_prompt(list(range(1, 9))), 40)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == "no KV pages for the request within 1 s"
        assert metric(d.metrics_port, "kvbridge_timeouts_total", 'timeout="prealloc"') == 1
        with pytest.raises(grpc.RpcError) as e:
            list(held)  # and the holder's KV never comes: its transfer times out too
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for node in (p, d):
            st = wait_idle(node.address)
            assert not any(r.kv_pages_used for r in st.ranks) and st.requests_in_flight == 0, st
    finally:
        stop_nodes(nodes)


def test_a_node_at_its_request_limit_answers_resource_exhausted_at_once():
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig

    node = start_node(
        "colocated", NodeConfig(replace(TINY, max_pending_requests=2, fault_inject="step_delay_ms=100"), PPConfig())
    )
    try:
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address))
        sampling = common_pb2.SamplingParams(max_new_tokens=30, ignore_eos=True)
        streams = [
            stub.Generate(generation_pb2.GenerateRequest(prompt=token_prompt([i + 1]), sampling=sampling), timeout=60)
            for i in range(2)
        ]
        for s in streams:
            next(s)  # both admitted and running
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generation_pb2.GenerateRequest(prompt=token_prompt([9]), sampling=sampling), timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details() == "the node holds 2 requests, its limit (--max-pending-requests)"
        assert time.monotonic() - t0 < 1.0  # refused, not queued
        assert [sum(len(r.token_ids) for r in s) for s in streams] == [29, 29]  # the first came earlier
    finally:
        node.stop()


@pytest.mark.long
def test_a_lost_transfer_notice_ends_in_the_prefill_transfer_timeout_and_the_decode_side_follows():
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig

    p = start_node(
        "prefill",
        NodeConfig(replace(TINY, fault_inject="drop_notice=1", transfer_timeout_s=2.0), PPConfig(), metrics_port=0),
    )
    d = start_node(
        "decode", NodeConfig(replace(TINY, transfer_timeout_s=30.0), PPConfig(), transfer_backend="shm", metrics_port=0)
    )
    try:
        t0 = time.monotonic()
        tokens, _, error = pd_generate(p.address, d.address, token_prompt([1, 2, 3, 4, 5, 6]), 4)
        # P gives up 2 s after its first token and aborts the room; D hears it at once
        assert tokens == [] and error.code() == grpc.StatusCode.UNAVAILABLE
        assert error.details() == "the KV transfer failed on a decode rank"
        assert 2.0 <= time.monotonic() - t0 < 5.0
        assert metric(p.metrics_port, "kvbridge_timeouts_total", 'timeout="transfer"') == 1
        assert metric(d.metrics_port, "kvbridge_timeouts_total", 'timeout="transfer"') == 0
        for node in (p, d):
            st = wait_idle(node.address)
            assert not any(r.kv_pages_used for r in st.ranks) and st.requests_in_flight == 0, st
    finally:
        stop_nodes({"p": p, "d": d})
