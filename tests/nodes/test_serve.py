"""A colocated node over gRPC: same tokens as the engine, clear errors, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc
from tests.conftest import make_llm, make_prompts

TINY = EngineConfig(model="tiny-random", page_size=4, kv_cache_tokens=8192, chunked_prefill_size=16)


@pytest.fixture(scope="module")
def node():
    serving = start_node("colocated", NodeConfig(TINY, PPConfig(pp_size=2)))
    yield serving
    serving.stop()


@pytest.fixture(scope="module")
def stubs(node):
    channel = rpc.make_channel(node.address)
    return generation_pb2_grpc.GenerationStub(channel), admin_pb2_grpc.AdminStub(channel), channel


def generate(stub, ids, **sampling) -> tuple[list[int], list[generation_pb2.GenerateResponse]]:
    req = generation_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids)),
        sampling=common_pb2.SamplingParams(**sampling),
    )
    responses = list(stub.Generate(req, timeout=60))
    return [t for r in responses for t in r.token_ids], responses


def status(admin) -> admin_pb2.Status:
    return admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)


def test_generate_streams_the_engine_tokens(tiny_model, stubs):
    gen, admin, _ = stubs
    prompts = make_prompts(3, tiny_model.config.vocab_size, seed=31)
    expected = make_llm(tiny_model, chunked_prefill_size=16).generate(
        prompts, SamplingParams(max_new_tokens=9, ignore_eos=True)
    )
    for prompt, want in zip(prompts, expected):
        ids, responses = generate(gen, prompt, max_new_tokens=9, ignore_eos=True)
        assert ids == want.output_ids
        # streamed: tokens as they come (one a message while the client keeps up; tokens queued
        # meanwhile go as one), then the end
        counts = [len(r.token_ids) for r in responses]
        assert sum(counts) == 9 and counts[-1] == 0 and all(counts[:-1]) and len(counts) >= 3
        last = responses[-1]
        assert last.finish_reason == "length" and last.usage.prompt_tokens == len(prompt)
        assert last.usage.completion_tokens == 9
    st = status(admin)
    assert st.role == "colocated" and st.pp_size == 2 and [r.alive for r in st.ranks] == [True, True]
    assert [r.kv_pages_used for r in st.ranks] == [0, 0] and st.ranks[0].kv_pages_total == 2048


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        (common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[5, 999])), {}, "token id 999 is out of range"),
        (common_pb2.Prompt(), {}, "prompt is empty"),
        (common_pb2.Prompt(text="hi"), {"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        (common_pb2.Prompt(text="hi"), {"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        (common_pb2.Prompt(text="x" * 5000), {}, "5000 tokens; the context holds 4096"),
        (
            common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="robot")])),
            {},
            "role must be system, user or assistant, got 'robot'",
        ),
    ],
)
def test_bad_requests_get_invalid_argument_and_the_node_keeps_serving(stubs, prompt, sampling, message):
    gen, admin, _ = stubs
    req = generation_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(**sampling))
    with pytest.raises(grpc.RpcError) as err:
        list(gen.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert generate(gen, [5, 6, 7], max_new_tokens=2)[0]  # still serving
    assert status(admin).ranks[0].kv_pages_used == 0


def test_client_cancel_aborts_the_request_and_frees_its_pages(stubs):
    gen, admin, _ = stubs
    served = status(admin).requests_served
    req = generation_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=list(range(5, 200)))),
        sampling=common_pb2.SamplingParams(max_new_tokens=4000, ignore_eos=True),
    )
    call = gen.Generate(req, timeout=60)
    next(call)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 20
    while (st := status(admin)).requests_served == served and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st.requests_served == served + 1
    assert st.ranks[0].kv_pages_used == 0 and st.queues["running"] == 0 and st.queues["waiting"] == 0


def test_health_and_reflection_are_served(stubs):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, _, channel = stubs
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvbridge.v1.Generation", "kvbridge.v1.Admin"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    [resp] = list(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    )
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvbridge.v1.Generation", "kvbridge.v1.Admin", "grpc.health.v1.Health"} <= names


def test_serve_command_is_not_serving_while_loading_then_serves_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "serve", "--model", "tiny-random", "--port", "0", "--quiet"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert line.startswith("kvbridge serve: bound 127.0.0.1:") and line.endswith("; loading\n"), line
        port = int(line.split("bound 127.0.0.1:")[1].split(";")[0])
        channel = rpc.make_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="kvbridge.v1.Generation")
        # the ranks take seconds to spawn and import torch: the server answers before they are up
        assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
        while not (line := proc.stderr.readline()).startswith("kvbridge serve: listening on "):
            assert line, "the node exited before it was ready"  # (log lines come in between)
        assert line == f"kvbridge serve: listening on 127.0.0.1:{port}\n"
        assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        gen = generation_pb2_grpc.GenerationStub(channel)
        assert len(generate(gen, [1, 2, 3], max_new_tokens=3, ignore_eos=True)[0]) == 3
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_sigterm_drains_finishes_requests_in_flight_frees_shared_memory_and_exits_0(tmp_path):
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig
    from tests.pd import TINY as PD_TINY
    from tests.pd import pd_generate, token_prompt

    prefill = start_node("prefill", NodeConfig(PD_TINY, PPConfig()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "decode", "--model", "tiny-random", "--page-size", "4", "--pp-size", "2",
         "--transfer-backend", "shm", "--fault-inject", "step_delay_ms=60", "--quiet", "--log-level", "info"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while not (line := proc.stderr.readline()).startswith("kvbridge decode: listening on "):
            assert line, "the decode node exited before it was ready"
        addr = line.split("listening on ")[1].strip()
        stub = admin_pb2_grpc.AdminStub(rpc.make_channel(addr))
        ranks = json.loads(stub.GetConfig(admin_pb2.GetConfigRequest(), timeout=10).json)["rank_pids"]
        assert len(segments_of(ranks)) == 2  # its ranks' pools
        result = {}
        call = threading.Thread(
            target=lambda: result.update(r=pd_generate(prefill.address, addr, token_prompt([1, 2, 3, 4, 5]), 30))
        )
        call.start()
        deadline = time.monotonic() + 30
        while not [
            r for r in stub.ListRequests(admin_pb2.ListRequestsRequest(), timeout=5).requests if r.phase == "decoding"
        ]:
            assert time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # 30 tokens at 60 ms a step: still decoding
        deadline = time.monotonic() + 30
        while not stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=5).draining:
            assert time.monotonic() < deadline, "the node never started draining"
            time.sleep(0.02)
        tokens, _, error = pd_generate(prefill.address, addr, token_prompt([6, 7]), 4)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == "the decode node is draining"
        call.join(60)
        tokens, _, prefill_result = result["r"]
        assert len(tokens) == 30 and not isinstance(prefill_result, grpc.RpcError)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        assert segments_of(ranks) == [], proc.stderr.read()  # every segment unlinked
    finally:
        proc.kill()
        prefill.stop()


def test_ranks_of_a_killed_front_exit_and_free_their_shared_memory():
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "decode", "--model", "tiny-random", "--pp-size", "2",
         "--transfer-backend", "shm", "--quiet", "--log-level", "warning"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while not (line := proc.stderr.readline()).startswith("kvbridge decode: listening on "):
            assert line, "the decode node exited before it was ready"
        addr = line.split("listening on ")[1].strip()
        ranks = json.loads(
            admin_pb2_grpc.AdminStub(rpc.make_channel(addr)).GetConfig(admin_pb2.GetConfigRequest(), timeout=10).json
        )["rank_pids"]
        assert len(ranks) == 2 and len(segments_of(ranks)) == 2
        proc.kill()  # -9: the front cannot stop its ranks
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in ranks):
            assert time.monotonic() < deadline, "orphaned rank processes"
            time.sleep(0.1)
        assert segments_of(ranks) == []
    finally:
        proc.kill()


def segments_of(pids: list[int]) -> list[str]:
    """The /dev/shm segments of these rank processes (KV pools are named kvbridge-PID-...)."""
    return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(f"kvbridge-{pid}-") for pid in pids))


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
