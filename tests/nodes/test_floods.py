"""Floods of fleet-internal calls from one local client, sent straight to the nodes: silent KV
streams to a decode rank, Prefill calls whose decode node never registers, KV event watchers.
Each is bounded per caller (its peer host), and a hand-off or router beside it is served."""

from __future__ import annotations

import secrets
from dataclasses import replace

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.serving.kv_events import MAX_WATCHERS_PER_CALLER
from kvbridge.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    kv_events_pb2,
    kv_events_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from kvbridge.v1.admin_pb2 import ListRequestsRequest
from tests.conftest import make_llm
from tests.kv_transfer.test_kv_transfer_receiver import Held, wait_until
from tests.pd import TINY, admin, clear_cache, metric_total, pd_generate, signed_route, status, token_prompt, wait_idle
from tests.relay import Relay

PROMPT = list(range(5, 69))  # 64 tokens: 16 pages of 4
MAX_NEW = 8
SHARE = 48 / 1024  # of the prefill node's 1024 pages: one caller's unregistered requests hold at most 48 (3 prompts)
HOLD_S = 8.0  # the prefill node's --unregistered-timeout-s
BOOT_S = 12.0  # its --bootstrap-timeout-s (from the Prefill call)
IDLE_S = 8.0  # the decode node's --kv-stream-idle-s (a hand-off on a loaded machine takes far less)


@pytest.fixture(scope="module")
def fleet():
    p_config = replace(TINY, unregistered_page_share=SHARE, unregistered_timeout_s=HOLD_S, bootstrap_timeout_s=BOOT_S)
    p = start_node("prefill", NodeConfig(p_config, PPConfig(), metrics_port=0))
    d = start_node("decode", NodeConfig(replace(TINY, kv_stream_idle_s=IDLE_S), PPConfig(), transfer_backend="grpc"))
    yield p, d
    d.stop()
    p.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size)
    [c] = llm.generate([PROMPT], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    return c.output_ids


def test_silent_kv_streams_from_a_local_client_do_not_fail_a_grpc_hand_off(fleet, reference):
    """40 KV streams that never send a chunk (they held every worker of the old threaded receiver:
    no notice landed, every hand-off failed) and 4 whose one chunk names no room of the rank: a
    hand-off from the prefill node, on the same host, completes while 15 or fewer of them still wait."""
    p, d = fleet
    clear_cache(p.address, d.address)  # (its pages all move)
    channel = rpc.make_channel(d.node.layout.ranks[0].receiver_addr, rpc.KV_MESSAGE_BYTES)
    stub = kv_transfer_pb2_grpc.KVReceiverStub(channel)
    strays = [Held(stub) for _ in range(4)]
    for s in strays:
        s.send(kv_transfer_pb2.PageChunk(room=secrets.randbits(62) + 1, page_ids=[0], data=b"\0" * 64))
    rooms = {s.error()[1].split()[1] for s in strays}
    assert {s.error()[0] for s in strays} == {grpc.StatusCode.NOT_FOUND} and len(rooms) == 4
    silent = [Held(stub, timeout=120) for _ in range(40)]
    wait_until(lambda: sum(s.call.done() for s in silent) == 24, "the flood never pushed itself out")
    tokens, responses, result = pd_generate(p.address, d.address, token_prompt(PROMPT), MAX_NEW)
    assert tokens == reference and not isinstance(result, grpc.RpcError)
    assert responses[0].transfer.backend == "grpc" and responses[0].transfer.kv_bytes > 0
    pushed_out = [s for s in silent if s.call.done()]
    assert 24 < len(pushed_out) < 40  # the hand-off's streams pushed out the oldest; the others still wait
    assert {s.error() for s in pushed_out} == {
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "127.0.0.1 opened a newer KV stream: a peer host may have at most 16 waiting for their first chunk "
            "(MAX_UNKEYED_STREAMS_PER_PEER); its oldest is ended",
        )
    }
    timed_out = {s.error() for s in silent if s not in pushed_out}  # (after IDLE_S)
    assert timed_out == {
        (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no PageChunk within {IDLE_S:g} s of the stream's start (the KV stream idle limit, --kv-stream-idle-s)",
        )
    }
    channel.close()


class Unregistered:
    """A Prefill call whose decode node never registers: a prompt of 16 pages no other shares."""

    def __init__(self, addr: str, first: int):
        self.rid, self.room = f"held{first}", secrets.randbits(62) + 1
        sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
        req = prefill_pb2.PrefillRequest(
            rid=self.rid, room=self.room, prompt=token_prompt([first, *PROMPT[1:]]), sampling=sampling
        )
        self.call = prefill_pb2_grpc.PrefillStub(rpc.make_channel(addr)).Prefill.future(req, timeout=120)


def failure(u: Unregistered) -> tuple[grpc.StatusCode, str]:
    e = u.call.exception(timeout=120)
    return (e.code(), e.details()) if e is not None else (grpc.StatusCode.OK, "")


def test_unregistered_prefills_of_one_caller_hold_their_share_for_a_while_and_another_caller_is_served(
    fleet, reference
):
    """One caller's Prefill calls that no decode node registers: three prompts' pages fit its share
    (48 of 1024) and are prefilled; two more wait unprefilled, holding no page. Meanwhile another
    caller (a router on another host) is served, its registration coming only once it holds its
    pages. The three fail after --unregistered-timeout-s; then the two are prefilled in their turn
    and fail at their --bootstrap-timeout-s."""
    p, d = fleet
    clear_cache(p.address, d.address)
    calls = [Unregistered(p.address, 100 + i) for i in range(5)]

    def phases() -> dict[str, tuple[str, int]]:
        return {r.rid: (r.phase, r.kv_pages) for r in admin(p.address).ListRequests(ListRequestsRequest()).requests}

    wait_until(lambda: sorted(phases().values()).count(("bootstrap", 16)) == 3, "three prefilled", timeout_s=60)
    assert sorted(phases().values()) == [("bootstrap", 16)] * 3 + [("waiting", 0)] * 2  # (the share is full)
    router = Relay(p.address, "127.0.0.2")
    tokens, _, result = pd_generate(router.addr, d.address, token_prompt(PROMPT), MAX_NEW, late=True)
    assert tokens == reference and not isinstance(result, grpc.RpcError)
    held = {u.rid for u in calls if phases()[u.rid][0] == "bootstrap"}
    assert not any(u.call.done() for u in calls)  # (within HOLD_S of their prefill)
    why = {}
    for u in calls:
        if u.rid in held:
            why[u] = (
                f"the decode node did not register room {u.room} within {HOLD_S:g} s of its prefill "
                "(--unregistered-timeout-s)"
            )
        else:
            why[u] = f"the decode node did not register room {u.room} within {BOOT_S:g} s"
        assert failure(u) == (grpc.StatusCode.DEADLINE_EXCEEDED, why[u])
    assert metric_total(p, "kvbridge_timeouts_total") == 5
    assert {r.kv_pages_used for r in wait_idle(p.address).ranks} == {0}
    # a registration that comes now is told how its request ended: the decode node fails it at once
    late = calls[0]
    req = generation_pb2.GenerateRequest(
        rid=late.rid,
        prompt=token_prompt([100, *PROMPT[1:]]),
        sampling=common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
        prefill=signed_route(late.room, p.address),
    )
    with pytest.raises(grpc.RpcError) as e:
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(d.address)).Generate(req, timeout=30))
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"registration with the prefill node failed: room {late.room}: its request ended on the prefill node "
        f"before the registration ({why[late]})",
    )
    assert {r.kv_pages_used for r in wait_idle(d.address).ranks} == {0}
    router.close()


def watch(addr: str):
    """A KV event stream and its first message (the snapshot)."""
    stream = kv_events_pb2_grpc.KVEventsStub(rpc.make_channel(addr)).Watch(
        kv_events_pb2.WatchKVEventsRequest(), timeout=120
    )
    return stream, next(stream)


def test_a_client_holding_kv_event_streams_cannot_shut_out_a_router(fleet):
    """12 streams from one host: its 4 oldest end as the newer ones open, 8 stay. A router restarted
    on that host opens its stream (the client's oldest ends), and one on another host opens its own."""
    _, d = fleet
    streams = [watch(d.address)[0] for _ in range(12)]
    for s in streams[:4]:
        with pytest.raises(grpc.RpcError) as e:
            next(s)
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "127.0.0.1 opened a newer KV event stream: one caller may have 8 (MAX_WATCHERS_PER_CALLER); "
            "its oldest is ended",
        )
    assert MAX_WATCHERS_PER_CALLER == 8
    hub = d.node.front.kv_events
    assert d.loop.invoke(hub.callers) == {"127.0.0.1": 8}
    restarted, snapshot = watch(d.address)
    assert snapshot.snapshot and snapshot.role == "decode"
    with pytest.raises(grpc.RpcError) as e:
        next(streams[4])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    relay = Relay(d.address, "127.0.0.3")
    elsewhere, snapshot = watch(relay.addr)
    assert snapshot.snapshot
    assert d.loop.invoke(hub.callers) == {"127.0.0.1": 8, "127.0.0.3": 1}
    for s in [*streams, restarted, elsewhere]:
        s.cancel()
    wait_until(lambda: d.loop.invoke(hub.callers) == {}, "cancelled streams still counted")
    relay.close()
    assert status(d.address).serving
