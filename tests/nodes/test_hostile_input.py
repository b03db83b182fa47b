"""Requests that used to take a node down, sent straight to the node (not through the router):
each gets its own status, and the node goes on serving."""

from __future__ import annotations

import http.client
import json
import secrets
import time
from dataclasses import replace

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.kv_transfer import adapters as kv_wire
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.conftest import make_llm
from tests.pd import (
    TINY,
    clear_cache,
    fleet_signed,
    pd_generate,
    signed_route,
    start_nodes,
    stop_nodes,
    token_prompt,
    wait_idle,
    wait_phase,
)

PROMPT = list(range(5, 69))  # 64 tokens: 4 chunks of 16
MAX_NEW = 8


@pytest.fixture(scope="module")
def fleet():
    """P pp 2 (each step 300 ms late: PROMPT stays in prefill for 1.2 s, long after its registration
    lands, so that it is caught there) and D pp 1."""
    slow = replace(TINY, fault_inject="step_delay_ms=300")
    nodes = start_nodes({"p": ("prefill", 2, slow), "d": ("decode", 1, "shm")})
    yield nodes["p"], nodes["d"]
    stop_nodes(nodes)


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)
    [c] = llm.generate([PROMPT], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    return c.output_ids


def serving(addr: str) -> bool:
    return admin_pb2_grpc.AdminStub(rpc.make_channel(addr)).GetStatus(admin_pb2.GetStatusRequest(), timeout=10).serving


def listed(addr: str, rid: str) -> admin_pb2.RequestInfo | None:
    admin = admin_pb2_grpc.AdminStub(rpc.make_channel(addr))
    requests = admin.ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests
    return next((r for r in requests if r.rid == rid), None)


def sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("rid", ["r" * 70_000, "a b", "rid\n", "é"])
def test_a_bad_rid_straight_to_a_prefill_node_is_invalid_argument_and_the_node_serves_on(fleet, reference, rid):
    p, d = fleet
    req = prefill_pb2.PrefillRequest(rid=rid, room=secrets.randbits(62) + 1, prompt=token_prompt([1, 2, 3]))
    with pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillStub(rpc.make_channel(p.address)).Prefill(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("rid must be 1..160 characters of [A-Za-z0-9._:-], got ")
    assert len(e.value.details()) < 200  # the rid is shown cut short, not echoed whole
    tokens, _, result = pd_generate(p.address, d.address, token_prompt(PROMPT), MAX_NEW)
    assert tokens == reference and not isinstance(result, grpc.RpcError)
    assert serving(p.address) and serving(d.address)


@pytest.mark.parametrize("node", ["d", "colocated"])
def test_a_bad_rid_straight_to_a_generation_node_is_invalid_argument(fleet, colocated, node):
    p, d = fleet
    addr = d.address if node == "d" else colocated.address
    req = generation_pb2.GenerateRequest(rid="x" * 70_000, prompt=token_prompt([1, 2, 3]), sampling=sampling())
    if node == "d":
        req.prefill.CopyFrom(signed_route(secrets.randbits(62) + 1, p.address))
    with pytest.raises(grpc.RpcError) as e:
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(addr)).Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("rid must be")
    assert serving(addr)


@pytest.fixture(scope="module")
def colocated():
    from kvbridge.engine.config import PPConfig
    from kvbridge.nodes import start_node
    from kvbridge.serving.config import NodeConfig

    node = start_node("colocated", NodeConfig(TINY, PPConfig(pp_size=2)))
    yield node
    node.stop()


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(colocated):
    text = "word " * 200_000  # 1 MB: the tiny model's context is far smaller
    req = generation_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=text), sampling=sampling())
    with pytest.raises(grpc.RpcError) as e:
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(colocated.address)).Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompt.text has 1000000 bytes; a prompt that fits the context of ")


@pytest.mark.parametrize("node", ["colocated", "p", "d"])
def test_32000_empty_chat_messages_straight_to_a_node_are_refused_by_their_count(fleet, colocated, node):
    p, d = fleet
    prompt = common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user")] * 32_000))
    rid, room = secrets.token_hex(8), secrets.randbits(62) + 1
    with pytest.raises(grpc.RpcError) as e:
        if node == "p":
            req = prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=prompt, sampling=sampling())
            prefill_pb2_grpc.PrefillStub(rpc.make_channel(p.address)).Prefill(req, timeout=30)
        else:
            addr = d.address if node == "d" else colocated.address
            req = generation_pb2.GenerateRequest(rid=rid, prompt=prompt, sampling=sampling())
            if node == "d":
                req.prefill.CopyFrom(signed_route(room, p.address))
            list(generation_pb2_grpc.GenerationStub(rpc.make_channel(addr)).Generate(req, timeout=30))
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "prompt.chat has 32000 messages; at most 4096"
    )  # fmt: skip


def test_a_chat_that_its_template_renders_past_the_context_bytes_is_refused_before_it_is_tokenized(colocated):
    messages = [common_pb2.ChatMessage(role="user", content="0123456789")] * 4096  # 57,344 bytes of content and roles
    req = generation_pb2.GenerateRequest(prompt=common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=messages)))
    with pytest.raises(grpc.RpcError) as e:
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(colocated.address)).Generate(req, timeout=30))
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt.chat renders to 155670 bytes through the chat template; a prompt that fits the context of 4096 "
        "tokens has at most 131072",
    )  # (ChatML: 38 bytes a message, and the reply's 22)


def test_a_non_streamed_answer_past_max_answer_bytes_leaves_the_node_idle_and_the_router_empty(colocated):
    router = start_router(
        RouterConfig(port=0, http_port=0, colocated=(colocated.address,), health_retry_s=0.1, max_answer_bytes=20_000)
    )
    try:
        body = {"prompt": [list(range(5, 37))] * 2, "n": 2, "max_tokens": 400, "ignore_eos": True, "logprobs": 5}
        conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        conn.close()
        message = (
            "the answer exceeds --max-answer-bytes (20000 bytes) of a non-streamed answer; "
            'ask for it with "stream": true'
        )
        assert (resp.status, answer["error"]["message"]) == (400, message)
        st = wait_idle(colocated.address)
        assert [r.kv_pages_used for r in st.ranks] == [0, 0] and st.requests_in_flight == 0, st
        assert router.dispatcher.num_in_flight() == 0
    finally:
        router.stop(grace_s=0)


def start_pair(p, d):
    """PROMPT's two halves, as the router sends them: (rid, room, the Prefill future, the Generate stream).
    Neither node has it cached (earlier tests sent it): its 4 chunks prefill, its pages all move."""
    clear_cache(p.address, d.address)
    rid, room = secrets.token_hex(8), secrets.randbits(62) + 1
    prefill = prefill_pb2_grpc.PrefillStub(rpc.make_channel(p.address)).Prefill.future(
        prefill_pb2.PrefillRequest(rid=rid, room=room, prompt=token_prompt(PROMPT), sampling=sampling()), timeout=60
    )
    route = signed_route(room, p.address)
    gen = generation_pb2.GenerateRequest(rid=rid, prompt=token_prompt(PROMPT), sampling=sampling(), prefill=route)
    stream = generation_pb2_grpc.GenerationStub(rpc.make_channel(d.address)).Generate(gen, timeout=60)
    return rid, room, prefill, stream


def test_a_second_register_for_a_routed_room_is_already_exists_and_the_first_request_completes(fleet, reference):
    p, d = fleet
    rid, room, prefill, stream = start_pair(p, d)
    deadline = time.monotonic() + 30
    while not ((info := listed(p.address, rid)) and info.peer and info.phase == "prefilling"):
        assert time.monotonic() < deadline, f"never caught registered and prefilling: {info}"
        time.sleep(0.01)
    second = fleet_signed(prefill_pb2.RegisterRequest(
        rid="second", room=room, backend="shm", decode_layout=kv_wire.layout_to_proto(d.node.layout),
        page_ids=[0, 1, 2, 3], decode_addr="127.0.0.1:1", secret=bytes(16),
    ))  # fmt: skip
    bootstrap = prefill_pb2_grpc.BootstrapStub(rpc.make_channel(p.address))
    with pytest.raises(grpc.RpcError) as e:
        bootstrap.Register(second, timeout=30)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.ALREADY_EXISTS, f"room {room} is registered already")
    assert [t for r in stream for t in r.token_ids] == reference
    assert prefill.result().first_token == reference[0]
    for node in (p, d):
        assert {r.kv_pages_used for r in wait_idle(node.address).ranks} == {0}


def test_a_register_twice_before_its_request_is_already_exists(fleet):
    p, d = fleet
    room = secrets.randbits(62) + 1
    reg = fleet_signed(prefill_pb2.RegisterRequest(
        rid="early", room=room, backend="shm", decode_layout=kv_wire.layout_to_proto(d.node.layout),
        page_ids=[0, 1], decode_addr=d.address, secret=bytes(16),
    ))  # fmt: skip
    bootstrap = prefill_pb2_grpc.BootstrapStub(rpc.make_channel(p.address))
    bootstrap.Register(reg, timeout=30)  # waits for its Prefill call (expires after --bootstrap-timeout-s)
    with pytest.raises(grpc.RpcError) as e:
        bootstrap.Register(reg, timeout=30)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_repeated_page_ids_in_a_registration_are_invalid_argument(fleet):
    p, d = fleet
    reg = fleet_signed(prefill_pb2.RegisterRequest(
        rid="r", room=secrets.randbits(62) + 1, backend="shm", decode_layout=kv_wire.layout_to_proto(d.node.layout),
        page_ids=[3, 3], decode_addr=d.address, secret=bytes(16),
    ))  # fmt: skip
    with pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.BootstrapStub(rpc.make_channel(p.address)).Register(reg, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page ids repeat" in e.value.details()


def test_forged_kv_writes_for_a_registered_room_are_permission_denied_and_its_request_completes(fleet, reference):
    """Whoever knows a room's number but is not its prefill node (no write key) can neither write
    its pages, nor end its transfer (a failing notice), nor give it a first token."""
    p, d = fleet
    rid, room, prefill, stream = start_pair(p, d)
    wait_phase(d.address, rid, "transferring")  # every decode rank expects the room: its pages are reserved
    receiver = kv_transfer_pb2_grpc.KVReceiverStub(rpc.make_channel(d.node.layout.ranks[0].receiver_addr))
    for key in (b"", secrets.token_bytes(16)):  # none, and a guess
        chunk = kv_transfer_pb2.PageChunk(room=room, layer_end=1, page_ids=[0], data=b"\0" * 4096, secret=key)
        notice = kv_transfer_pb2.TransferNotice(room=room, layer_end=1, num_tokens=4, error="forged", secret=key)
        token = kv_transfer_pb2.FirstTokenNotice(room=room, token=reference[0] + 1, prompt_tokens=64, secret=key)
        forged = {"WritePages": iter([chunk]), "TransferDone": notice, "FirstToken": token}
        for method, request in forged.items():
            with pytest.raises(grpc.RpcError) as e:
                getattr(receiver, method)(request, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
            assert e.value.details() == f"room {room}: the write key is not the room's (only its prefill node has it)"
    assert not prefill.done()  # (the forgeries came while the room still waited for its KV)
    assert [t for r in stream for t in r.token_ids] == reference
    assert prefill.result().first_token == reference[0]
    for node in (p, d):
        assert {r.kv_pages_used for r in wait_idle(node.address).ranks} == {0}
