"""A decode node watches the prefill nodes it has requests with: when one dies (kill -9), the
requests still waiting for its KV fail with UNAVAILABLE within a second or two (no router
involved), their pages are freed, and a prefill node restarted later is used afresh."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

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
from tests.pd import TINY, pd_generate, signed_route, token_prompt, wait_idle

HARD_TIMEOUT_S = 300  # the whole module (the hard_timeout fixture, tests/conftest.py)
pytestmark = pytest.mark.usefixtures("hard_timeout")


def start_prefill_process(*flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "prefill", "--model", "tiny-random", "--page-size", "4",
         "--chunked-prefill-size", "16", "--quiet", "--log-level", "warning", *flags],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    while not (line := proc.stderr.readline()).startswith("kvbridge prefill: listening on "):
        assert line, "the prefill node exited before it was ready"
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    return proc, line.split("listening on ")[1].strip()


@pytest.mark.long
def test_decode_fails_requests_waiting_for_a_dead_prefill_node_and_frees_their_pages():
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig

    decode = start_node("decode", NodeConfig(TINY, PPConfig(pp_size=2), transfer_backend="shm"))
    victim, p_addr = start_prefill_process("--fault-inject", "step_delay_ms=1000")  # prefills for seconds
    try:
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(decode.address))
        sampling = common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True)
        calls = [
            stub.Generate(
                generation_pb2.GenerateRequest(
                    rid=f"r{i}",
                    prompt=token_prompt(list(range(1, 41))),
                    sampling=sampling,
                    prefill=signed_route(1000 + i, p_addr),
                ),
                timeout=60,
            )
            for i in range(3)
        ]
        p_stub = prefill_pb2_grpc.PrefillStub(rpc.make_channel(p_addr))
        prefills = []  # (kept: a dropped future cancels its call)
        for i in range(3):  # what the router does beside: the prefill half of each request
            prefills.append(p_stub.Prefill.future(
                prefill_pb2.PrefillRequest(rid=f"r{i}", room=1000 + i, prompt=token_prompt(list(range(1, 41))),
                                           sampling=sampling),
                timeout=60,
            ))  # fmt: skip
        admin = admin_pb2_grpc.AdminStub(rpc.make_channel(decode.address))
        deadline = time.monotonic() + 30
        while sum(r.phase == "transferring" for r in admin.ListRequests(admin_pb2.ListRequestsRequest()).requests) < 3:
            assert time.monotonic() < deadline, "the requests never reached the transfer phase"
            time.sleep(0.02)
        assert admin.GetStatus(admin_pb2.GetStatusRequest()).ranks[0].kv_pages_used > 0
        p_admin = admin_pb2_grpc.AdminStub(rpc.make_channel(p_addr))
        while sum(r.peer != "" for r in p_admin.ListRequests(admin_pb2.ListRequestsRequest()).requests) < 3:
            assert time.monotonic() < deadline, "the decode node never registered the requests"
            time.sleep(0.02)  # all three registered (no registration call in flight when it dies)
        victim.kill()
        t0 = time.monotonic()
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details() == f"the prefill node {p_addr} is unreachable"
        assert time.monotonic() - t0 < 3.0
        assert all(f.exception().code() == grpc.StatusCode.UNAVAILABLE for f in prefills)  # P is gone
        st = wait_idle(decode.address)
        assert [r.kv_pages_used for r in st.ranks] == [0, 0] and st.requests_in_flight == 0

        # a new prefill node (another address) serves; the decode node keeps working
        fresh, fresh_addr = start_prefill_process()
        try:
            tokens, _, result = pd_generate(fresh_addr, decode.address, token_prompt([1, 2, 3, 4]), 5)
            assert len(tokens) == 5 and not isinstance(result, grpc.RpcError)
        finally:
            fresh.terminate()
            fresh.wait(timeout=30)
    finally:
        victim.kill()
        decode.stop()
