"""Regression tests for bugs the bad-input fuzzers (tests/nodes/test_fuzz_*.py) found, since fixed:
room and rid collisions on the decode and prefill nodes, a reserve larger than the pool, huge values
echoed in status messages, page tokens that broke int(), non-JSON HTTP errors, and a first token
outside the vocabulary, and the sampling sizes of issue 25 (huge bad_words and stop strings, a
million stop_token_ids, a lone surrogate in bad_words). They run on the shared fleet of
tests/nodes/fuzz_fleet.py, plus a small decode node of their own (`scratch`) that the prefill side
of each test is played into by FakePrefill.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import replace

import grpc
import pytest

from kvbridge.common.sampling import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.nodes.fuzz_fleet import (
    CALL_S,
    C,
    FakePrefill,
    Fleet,
    client,
    drain_stream,
    fleet_fixture,
    generate,
    greedy_request,
    http_request,
    overlap_of,
    parse_raw,
    raw_http,
    stop_node,
    tried,
)
from tests.pd import TINY, signed_route, token_prompt, wait_phase
from tests.sampling_bounds import sampling_of

fleet = fleet_fixture()


@pytest.fixture(scope="module")
def scratch(fleet):
    """A decode node (pp 1) of its own, with a pool of 8 pages and a context of 32 tokens, fed by the
    fake prefill node: the known-bug tests may break it (the last one kills its rank)."""
    config = replace(TINY, kv_cache_tokens=32, max_context=32, prealloc_timeout_s=20.0, transfer_timeout_s=20.0)
    node = start_node("decode", NodeConfig(config, PPConfig(pp_size=1), transfer_backend="grpc"))
    yield node
    stop_node(node)


def scratch_call(node, fake: FakePrefill, rid: str, room: int, prompt: list[int], n: int, timeout: float = CALL_S):
    req = greedy_request(rid, prompt, n)
    req.prefill.CopyFrom(signed_route(room, fake.address))
    return client(generation_pb2_grpc.GenerationStub, node.address).Generate(req, timeout=timeout)


def wait_listed(addr: str, rid: str, timeout: float = 60) -> None:
    """Until the node lists `rid`, in any phase (a hang fails)."""
    stub = client(admin_pb2_grpc.AdminStub, addr)
    deadline = time.monotonic() + timeout
    while rid not in [r.rid for r in stub.ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests]:
        assert time.monotonic() < deadline, f"{rid} never showed up on {addr}"
        time.sleep(0.01)


def play_prefill(f: Fleet, reg: prefill_pb2.RegisterRequest, prompt_len: int, first_token: int, via="call") -> None:
    """Everything a prefill node sends for a room: the bytes of every page it registered (those after
    its held_pages), the notices, the first token (via "call": a FirstToken call; "notice": in the
    last overlapping source's notice to decode rank 0)."""
    block = f.d.node.layout.geometry.layer_block_bytes
    for j, dr in enumerate(reg.decode_layout.ranks):
        stub = client(kv_transfer_pb2_grpc.KVReceiverStub, dr.receiver_addr)
        sources = [pr for pr in f.p.node.layout.ranks if overlap_of(pr, dr) is not None]
        for pr in sources:
            ov = overlap_of(pr, dr)
            lo, hi = ov
            data = bytes(len(reg.page_ids) * (hi - lo) * block)
            if reg.page_ids:  # (none when the decode node's prefix cache holds the whole prompt: held_pages)
                chunk = kv_transfer_pb2.PageChunk(
                    room=reg.room, src_rank=pr.rank, layer_start=lo, layer_end=hi, page_ids=reg.page_ids, data=data
                )
                chunk.secret = reg.secret
                stub.WritePages(iter([chunk]), timeout=10)
            notice = kv_transfer_pb2.TransferNotice(
                room=reg.room, src_rank=pr.rank, layer_start=lo, layer_end=hi, num_tokens=prompt_len, bytes=len(data)
            )
            notice.secret = reg.secret
            if via == "notice" and j == 0 and pr is sources[-1]:
                notice.first_token = first_token
            stub.TransferDone(notice, timeout=10)
    if via == "notice":
        return
    first = kv_transfer_pb2.FirstTokenNotice(
        room=reg.room, token=first_token, prompt_tokens=prompt_len, secret=reg.secret
    )
    client(kv_transfer_pb2_grpc.KVReceiverStub, reg.decode_layout.ranks[0].receiver_addr).FirstToken(first, timeout=10)


def test_a_room_in_use_on_the_decode_node_is_refused_without_harming_its_request(fleet, scratch):
    tried("scenarios")
    room = secrets.randbits(62) + 1
    first = scratch_call(scratch, fleet.fake, "room-owner", room, [1, 2, 3, 4], 3)
    reg = fleet.fake.registration(room)
    assert reg is not None
    second = scratch_call(scratch, fleet.fake, "room-thief", room, [5, 6, 7, 8], 3, timeout=10)
    _, error = drain_stream(second)
    assert error is not None and error.code() in (C.ALREADY_EXISTS, C.INVALID_ARGUMENT), error
    assert str(room) in error.details(), error.details()
    play_prefill(fleet, reg, 4, first_token=7)
    tokens, error = drain_stream(first)
    assert error is None and tokens[:1] == [7] and len(tokens) == 3, (tokens, error)


def forged_messages(rank: prefill_pb2.RankEndpoint, room: int, page_ids, key: bytes) -> list[tuple]:
    """A page write, a notice that its source failed and (to decode rank 0) a first token, under
    `key`, to one decode rank: (status code, details) of each."""
    stub = client(kv_transfer_pb2_grpc.KVReceiverStub, rank.receiver_addr)
    layers = dict(layer_start=rank.layer_start, layer_end=rank.layer_end)
    chunk = kv_transfer_pb2.PageChunk(room=room, src_rank=0, page_ids=page_ids[:1], secret=key, **layers)
    failure = kv_transfer_pb2.TransferNotice(room=room, src_rank=0, num_tokens=4, error="forged", secret=key, **layers)
    first = kv_transfer_pb2.FirstTokenNotice(room=room, token=9, prompt_tokens=4, secret=key)
    calls = [lambda: stub.WritePages(iter([chunk]), timeout=10), lambda: stub.TransferDone(failure, timeout=10)]
    if rank.rank == 0:
        calls.append(lambda: stub.FirstToken(first, timeout=10))
    outcomes = []
    for call in calls:
        try:
            call()
            outcomes.append((None, ""))
        except grpc.RpcError as e:
            outcomes.append((e.code(), e.details()))
    return outcomes


def test_a_forged_write_key_neither_writes_nor_fails_a_room(fleet, scratch):
    """Whoever knows a room's number but not its write key: each page write, notice (one saying its
    source failed, too) and first token to each decode rank is PERMISSION_DENIED, and changes nothing:
    the room then completes with the real key."""
    tried("scenarios")
    room = secrets.randbits(62) + 1
    call = scratch_call(scratch, fleet.fake, "forged-key", room, [1, 2, 3, 4], 3)
    reg = fleet.fake.registration(room)
    assert reg is not None and len(reg.secret) == 16
    for rank in reg.decode_layout.ranks:
        for code, details in forged_messages(rank, room, reg.page_ids, bytes(16)):
            assert code == C.PERMISSION_DENIED and "write key" in details, (rank.rank, code, details)
    play_prefill(fleet, reg, 4, first_token=7)
    tokens, error = drain_stream(call)
    assert error is None and tokens[:1] == [7] and len(tokens) == 3, (tokens, error)


def test_a_duplicate_rid_on_the_decode_node_keeps_the_first_requests_registration(fleet, scratch):
    tried("scenarios")
    # a first request holds 2 of the 8 pages; the second (8 tokens + a reserve of 6 pages) waits for pages
    holder_room, room = secrets.randbits(62) + 1, secrets.randbits(62) + 1
    holder = scratch_call(scratch, fleet.fake, "dup-holder", holder_room, [1] * 8, 16)
    assert fleet.fake.registration(holder_room) is not None
    waiting = scratch_call(scratch, fleet.fake, "dup", room, [2] * 8, 24)
    wait_phase(scratch.address, "dup", "prealloc")  # the first "dup" holds the rid before the second comes
    again = scratch_call(scratch, fleet.fake, "dup", secrets.randbits(62) + 1, [3] * 8, 24, timeout=10)
    _, error = drain_stream(again)
    assert error is not None and error.code() == C.INVALID_ARGUMENT and "duplicate request id" in error.details()
    holder.cancel()  # pages free: the first "dup" is preallocated now, and must register
    try:
        assert fleet.fake.registration(room, timeout=CALL_S) is not None, "the first request never registered"
    finally:
        waiting.cancel()


def test_a_prompt_whose_reserve_exceeds_the_pool_is_still_preallocated(fleet, scratch):
    """30 prompt tokens, max_new_tokens 16, pool and context of 32 tokens: the decoding reserve is cut
    to what the pool holds, so the request gets its pages (and registers) instead of waiting for ever."""
    tried("scenarios")
    room = secrets.randbits(62) + 1
    call = scratch_call(scratch, fleet.fake, "too-big", room, [4] * 30, 16, timeout=10)
    try:
        assert fleet.fake.registration(room, timeout=CALL_S) is not None, "never preallocated"
    finally:
        call.cancel()


def test_a_room_in_use_on_the_prefill_node_is_refused(fleet):
    tried("scenarios")
    stub = client(prefill_pb2_grpc.PrefillStub, fleet.p.address)
    room = secrets.randbits(61) + 1
    first = stub.Prefill.future(prefill_pb2.PrefillRequest(rid="room-first", room=room, prompt=token_prompt([1, 2])))
    try:
        wait_listed(fleet.p.address, "room-first")  # it holds the room before the second comes
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(prefill_pb2.PrefillRequest(rid="room-second", room=room, prompt=token_prompt([3])), timeout=10)
        assert err.value.code() in (C.ALREADY_EXISTS, C.INVALID_ARGUMENT), err.value
    finally:
        first.cancel()


ECHO_SITES = {
    "node AbortRequest rid": ("serving/server.py NodeAdminService.AbortRequest", C.NOT_FOUND),
    "node ListRequests page_token": ("serving/server.py NodeAdminService.ListRequests", C.INVALID_ARGUMENT),
    "router AbortRequest rid": ("router/service.py AdminService.AbortRequest", C.NOT_FOUND),
    "router ListRequests page_token": ("router/service.py AdminService.ListRequests", C.INVALID_ARGUMENT),
    "router AddNode address": ("router/service.py AdminService.AddNode (router/config.py parse_address)", None),
    "router RemoveNode address": ("router/service.py AdminService.RemoveNode (router/config.py parse_address)", None),
    "decode Generate prefill_addr": ("decode_node/service.py DecodeGenerationService.Generate", None),  # not HOST:PORT
}


@pytest.mark.parametrize("site", list(ECHO_SITES))
def test_errors_about_huge_values_keep_their_status(fleet, site):
    tried("scenarios")
    huge = "x" * 20_000
    admin = client(admin_pb2_grpc.AdminStub, fleet.c.address)
    radmin = client(admin_pb2_grpc.AdminStub, fleet.router_addr)
    calls = {
        "node AbortRequest rid": lambda: admin.AbortRequest(admin_pb2.AbortRequestRequest(rid=huge), timeout=10),
        "node ListRequests page_token": lambda: admin.ListRequests(
            admin_pb2.ListRequestsRequest(page_token=huge), timeout=10
        ),
        "router AbortRequest rid": lambda: radmin.AbortRequest(admin_pb2.AbortRequestRequest(rid=huge), timeout=10),
        "router ListRequests page_token": lambda: radmin.ListRequests(
            admin_pb2.ListRequestsRequest(page_token=huge), timeout=10
        ),
        "router AddNode address": lambda: radmin.AddNode(
            admin_pb2.AddNodeRequest(role="decode", address=huge), timeout=10
        ),
        "router RemoveNode address": lambda: radmin.RemoveNode(admin_pb2.RemoveNodeRequest(address=huge), timeout=10),
        "decode Generate prefill_addr": lambda: list(
            client(generation_pb2_grpc.GenerationStub, fleet.d.address).Generate(
                generation_pb2.GenerateRequest(prompt=token_prompt([1]), prefill=signed_route(1, huge)),
                timeout=10,
            )
        ),
    }
    with pytest.raises(grpc.RpcError) as err:
        calls[site]()
    assert err.value.code() == (ECHO_SITES[site][1] or C.INVALID_ARGUMENT), err.value


@pytest.mark.parametrize(("where", "token"), [("node", "\u00b2"), ("node", "9" * 5000), ("router", "9" * 5000)])
def test_page_tokens_that_are_not_ours_are_invalid(fleet, where, token):
    tried("scenarios")
    addr = fleet.c.address if where == "node" else fleet.router_addr
    with pytest.raises(grpc.RpcError) as err:
        client(admin_pb2_grpc.AdminStub, addr).ListRequests(admin_pb2.ListRequestsRequest(page_token=token), timeout=10)
    assert err.value.code() == C.INVALID_ARGUMENT, err.value


@pytest.mark.parametrize("request_line", ["PUT /v1/completions HTTP/1.1", "DELETE /v1/models HTTP/1.1", "GARBAGE"])
def test_unsupported_methods_and_malformed_requests_get_openai_errors(fleet, request_line):
    tried("scenarios")
    out = raw_http(fleet.router.http_port, f"{request_line}\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
    status_, headers, body = parse_raw(out)
    assert status_ in (400, 405) and headers.get("Content-Type") == "application/json", (status_, headers, body)
    assert json.loads(body)["error"]["message"]


@pytest.mark.parametrize("via", ["call", "notice"])
def test_a_first_token_outside_the_vocabulary_is_refused(fleet, scratch, via):
    """Kills the scratch node's rank today: keep it the last test that uses `scratch`."""
    tried("scenarios")
    room = secrets.randbits(62) + 1
    call = scratch_call(scratch, fleet.fake, f"poisoned-{via}", room, [1, 2, 3, 4], 3)
    reg = fleet.fake.registration(room)
    assert reg is not None
    try:
        play_prefill(fleet, reg, 4, first_token=1_000_000, via=via)
        refused = None
    except grpc.RpcError as e:
        refused = e
    _, error = drain_stream(call)
    time.sleep(0.5)
    assert not scratch.node.ranks.dead_ranks(), "a decode rank died"
    # the receiver stores the token (it does not know the vocabulary); decode rank 0 refuses it
    assert refused is None or refused.code() == C.INVALID_ARGUMENT, refused
    assert error is not None and error.code() == C.DATA_LOSS, error
    assert "outside the vocabulary" in error.details(), error.details()


ISSUE_25 = {  # what cost a node ~190 ms a token, 240 s, and 10x: each refused before anything is built from it
    "bad_words-3.7MB": (
        {"bad_words": ["ab" * 14_500] * 128},
        "bad_words",
        f"bad_words[0] is 29000 characters; at most {MAX_BAD_WORD_CHARS}",
    ),
    "bad_words-many": (
        {"bad_words": [f"w{i}" for i in range(300_000)]},
        "bad_words",
        f"bad_words has 300000 words; at most {MAX_BAD_WORDS}",
    ),
    "stop-32000": (
        {"stop": ["x" * 32_000] * 4},
        "stop",
        f"stop[0] is 32000 characters; at most {MAX_STOP_STRING_CHARS}",
    ),
    "stop_token_ids-1.3M": (
        {"stop_token_ids": [7] * 1_300_000},
        "stop_token_ids",
        f"stop_token_ids has 1300000 ids; at most {MAX_STOP_TOKEN_IDS}",
    ),
}


@pytest.mark.parametrize("where", ["http", "router", "colocated", "prefill"])
@pytest.mark.parametrize("case", list(ISSUE_25))
def test_the_sampling_sizes_of_issue_25_are_refused_at_every_boundary(fleet, case, where):
    tried("scenarios")
    fields, param, problem = ISSUE_25[case]
    if where == "http":
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, **fields}).encode()
        status_, _, data = http_request(fleet.router.http_port, "POST", "/v1/completions", body)
        error = json.loads(data)["error"]
        assert (status_, error["message"], error["param"]) == (400, problem, param)
        return
    sampling = sampling_of(fields)
    if where == "prefill":
        req = prefill_pb2.PrefillRequest(rid="issue-25", room=secrets.randbits(62) + 1, sampling=sampling)
        req.prompt.CopyFrom(token_prompt([1, 2, 3]))
        with pytest.raises(grpc.RpcError) as err:
            client(prefill_pb2_grpc.PrefillStub, fleet.p.address).Prefill(req, timeout=CALL_S)
        code, details = err.value.code(), err.value.details()
    else:
        req = generation_pb2.GenerateRequest(prompt=token_prompt([1, 2, 3]), sampling=sampling)
        code, details, _ = generate(fleet.router_addr if where == "router" else fleet.c.address, req)
    assert (code, details) == (C.INVALID_ARGUMENT, "sampling." + problem)


def test_a_lone_surrogate_in_bad_words_is_a_400_not_a_500(fleet):
    tried("scenarios")
    body = b'{"prompt": "hi", "max_tokens": 2, "bad_words": ["ok", "\\ud800"]}'
    status_, _, data = http_request(fleet.router.http_port, "POST", "/v1/completions", body)
    error = json.loads(data)["error"]
    assert (status_, error["param"]) == (400, "bad_words")
    assert error["message"] == "bad_words[1] is not valid Unicode: unpaired surrogate '\\ud800' at index 0"
