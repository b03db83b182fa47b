"""Generation.Generate fuzzed on the router, the colocated node and the decode node (with a
PrefillRoute to the prefill node, to garbage, to a node without Bootstrap, or none), on the shared
fleet of tests/nodes/fuzz_fleet.py. Each input succeeds, or fails with the status and message its checks
expect (`router_checks`, `node_expect`); one input in five reuses the rid of a request in flight.
After each test the fleet is healthy and idle (`report`).
"""

from __future__ import annotations

import secrets

import grpc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvbridge.common import rpc
from kvbridge.common.limits import normalized_address
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.nodes.fuzz_fleet import (
    CALL_S,
    DUPLICATE,
    RIDS,
    SCALES,
    SETTINGS,
    TEXT,
    C,
    Expect,
    Fleet,
    Holder,
    fleet_fixture,
    fresh_rooms,
    generate,
    holder_request,
    mostly,
    node_expect,
    node_rid_checks,
    pd_call,
    prompts,
    report,
    router_checks,
    sampling_params,
    tried,
    unique,
)
from tests.pd import signed_route, token_prompt

fleet = fleet_fixture()

ROUTER, COLOCATED, DECODE = 240, 240, 240  # default examples per test (x SLOW_SCALE under -m slow)
TINY_TEMPERATURE = common_pb2.SamplingParams(temperature=1e-40)


@SCALES
def test_generate_on_the_router(fleet, scale):
    @settings(max_examples=ROUTER * scale, **SETTINGS)
    @given(rid=RIDS, prompt=prompts(), sampling=sampling_params(), duplicate=DUPLICATE)
    @example(rid="", prompt=token_prompt([1]), sampling=TINY_TEMPERATURE, duplicate=False)
    def one(rid, prompt, sampling, duplicate):
        tried("generate@router")
        rid = unique(rid)
        req = generation_pb2.GenerateRequest(rid=rid, prompt=prompt, sampling=sampling)
        own = router_checks(rid, prompt, sampling)
        e = Expect(own.problems + node_expect(fleet, prompt, sampling).problems)
        holder = None
        if duplicate and rid and not any(h == "rid" for _, h in own.problems):
            holder = Holder(fleet.router_addr, holder_request(rid))
            # the router's own checks come first, then its table of requests in flight
            e = own if not own.ok else Expect([(C.ALREADY_EXISTS, repr(rid))])
        try:
            code, details, _ = generate(fleet.router_addr, req)
            e.check(f"router Generate {req}", code, details)
        finally:
            if holder is not None:
                holder.release()

    one()
    report("generate@router", fleet)


@pytest.mark.parametrize("where", ["router", "colocated"])
def test_a_prompt_over_the_grpc_message_limit_is_resource_exhausted(fleet, where):
    tried("generate@" + where)
    addr = fleet.router_addr if where == "router" else fleet.c.address
    channel = grpc.insecure_channel(addr)  # no client-side limit: the server's own limit (64 MiB) answers
    try:
        req = generation_pb2.GenerateRequest(prompt=common_pb2.Prompt(text="a" * (rpc.MAX_MESSAGE_BYTES + 1024)))
        with pytest.raises(grpc.RpcError) as err:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=CALL_S))
        assert err.value.code() == C.RESOURCE_EXHAUSTED, err.value
        assert "larger than max" in err.value.details(), err.value.details()
    finally:
        channel.close()


@SCALES
def test_generate_on_the_colocated_node(fleet, scale):
    @settings(max_examples=COLOCATED * scale, **SETTINGS)
    @given(rid=RIDS, prompt=prompts(), sampling=sampling_params(), duplicate=DUPLICATE)
    @example(rid="", prompt=token_prompt([1]), sampling=TINY_TEMPERATURE, duplicate=False)
    @example(rid="", prompt=token_prompt([1]), sampling=common_pb2.SamplingParams(stop=[""]), duplicate=False)
    def one(rid, prompt, sampling, duplicate):
        tried("generate@colocated")
        rid = unique(rid)
        req = generation_pb2.GenerateRequest(rid=rid, prompt=prompt, sampling=sampling)
        e = node_rid_checks(rid, node_expect(fleet, prompt, sampling))
        holder = None
        if duplicate and rid and node_rid_checks(rid, Expect()).ok:
            holder = Holder(fleet.c.address, holder_request(rid))
            e.add(C.INVALID_ARGUMENT, "duplicate request id")
        try:
            code, details, _ = generate(fleet.c.address, req)
            e.check(f"colocated Generate {req}", code, details)
        finally:
            if holder is not None:
                holder.release()

    one()
    report("generate@colocated", fleet)


GARBAGE_ADDRS = ["127.0.0.1:1", "[::1", "unix:/nonexistent/kvbridge", "127.0.0.1:99999", ":", "ipv4:", "x:y:z:"]
GARBAGE_ADDRS += ["LocalHost:0001", "[::1]:1", "::1:1", "127.0.0.1:0", "h" * 300 + ":1"]


@st.composite
def routes(draw, f: Fleet):
    kind = draw(mostly(st.just("prefill"), st.sampled_from(["unset", "garbage", "garbage", "colocated", "self"])))
    room = draw(fresh_rooms())
    if kind == "unset":
        return kind, None
    addr = {"prefill": f.p.address, "colocated": f.c.address, "self": f.d.address}.get(kind)
    if kind == "garbage":
        addr = draw(
            st.one_of(st.sampled_from(GARBAGE_ADDRS), st.just(""), TEXT.map(lambda t: "unix:/nonexistent/" + t))
        )
    return kind, signed_route(room, addr)


def decode_input(f: Fleet, kind: str, route, rid: str, prompt, sampling, duplicate: bool) -> None:
    req = generation_pb2.GenerateRequest(rid=rid, prompt=prompt, sampling=sampling)
    if route is not None:
        req.prefill.CopyFrom(route)
    e = Expect()
    if route is None or not route.room or not route.prefill_addr:
        e.add(C.INVALID_ARGUMENT, "prefill.room and prefill.prefill_addr are required")
    elif kind != "prefill":  # not HOST:PORT, unreachable, or no Bootstrap service there
        try:
            addr = normalized_address(route.prefill_addr)
        except ValueError:
            e.add(C.INVALID_ARGUMENT, "prefill.prefill_addr")
        else:
            e.add(C.UNAVAILABLE, f"prefill node {addr}")
            e.add(C.FAILED_PRECONDITION, f"prefill node {addr}")
    else:
        e = node_rid_checks(rid, node_expect(f, prompt, sampling))
    holder = None
    if duplicate and rid and kind == "prefill" and route.room and node_rid_checks(rid, Expect()).ok:
        hreq = holder_request(rid)
        hreq.prefill.CopyFrom(signed_route(secrets.randbits(62) + 1, f.p.address))
        holder = Holder(f.d.address, hreq, list_at=f.d.address)
        e.add(C.INVALID_ARGUMENT, "duplicate request id")
    try:
        if e.ok:  # the prefill half too, as the router would send it
            code, details, tokens, presult = pd_call(f, rid or secrets.token_hex(8), route.room, prompt, sampling)
            e.check(f"decode Generate {req}", code, details)
            assert tokens, f"decode Generate {req}: no token"
            assert not isinstance(presult, grpc.RpcError) or presult.code() == C.CANCELLED, presult
        else:
            code, details, _ = generate(f.d.address, req)
            e.check(f"decode Generate {req}", code, details)
    finally:
        if holder is not None:
            holder.release()


@SCALES
def test_generate_on_the_decode_node(fleet, scale):
    @settings(max_examples=DECODE * scale, **SETTINGS)
    @given(data=st.data(), rid=RIDS, prompt=prompts(), sampling=sampling_params(), duplicate=DUPLICATE)
    def one(data, rid, prompt, sampling, duplicate):
        kind, route = data.draw(routes(fleet))
        tried("generate@decode")
        decode_input(fleet, kind, route, unique(rid), prompt, sampling, duplicate)

    one()
    report("generate@decode", fleet)
