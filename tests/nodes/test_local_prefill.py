"""Local prefill end to end (router/local_prefill.py): a real prefill node held busy (each of its
steps takes a second: a long prompt holds it for over ten), a real decode node, and two routers
over them, one with local prefill and one without. A short prompt is served by the decode node
alone (no transfer, counted), token for token what the P->D path gives it (and the engine alone); a
prompt past the limit still goes to the prefill node; the router with it off sends every prompt
there."""

from __future__ import annotations

import threading
from dataclasses import replace

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.conftest import make_llm, make_prompts
from tests.pd import TINY, clear_cache, fleet_signed, start_nodes, stop_nodes, token_prompt, wait_idle, wait_phase
from tests.router.fakes import wait_until

pytestmark = pytest.mark.long
HARD_TIMEOUT_S = 300
P_SLOW = replace(TINY, fault_inject="step_delay_ms=1000")  # 16-token chunks: a 200-token prompt holds P ~13 s
MAX_NEW = 12


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    nodes = start_nodes({"p": ("prefill", 1, P_SLOW), "d": ("decode", 1, "auto")})
    p, d = nodes["p"].address, nodes["d"].address
    base = {"port": 0, "http_port": 0, "prefill": (p,), "decode": (d,)}
    on = start_router(RouterConfig(**base, local_prefill_max_tokens=32))
    off = start_router(RouterConfig(**base, local_prefill_max_tokens=0))
    for router in (on, off):  # (the queues are counted in prompt tokens once the nodes are indexed)
        assert wait_until(lambda r=router: all(n.blocks.synced for n in r.pool.nodes), timeout=30)
    yield nodes, on, off
    on.stop()
    off.stop()
    stop_nodes(nodes)


def start(router, rid: str, ids: list[int]) -> tuple[grpc.Future, threading.Thread, list]:
    """A request through `router`, read in a thread: (its call, the thread, its responses once read)."""
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
    sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    request = generation_pb2.GenerateRequest(rid=rid, prompt=token_prompt(ids), sampling=sampling)
    call = stub.Generate(request, timeout=120)
    out: list = []

    def read():
        try:
            out.extend(call)
        except grpc.RpcError as e:
            out.append(e)

    thread = threading.Thread(target=read)
    thread.start()
    return call, thread, out


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def decisions(router) -> dict[tuple[str, str], float]:
    samples = router.dispatcher.metrics.local_prefill.collect()[0].samples
    return {(s.labels["decision"], s.labels["reason"]): s.value for s in samples if s.name.endswith("_total")}


def test_a_short_prompt_is_the_decode_nodes_while_the_prefill_node_is_busy(tiny_model, fleet):
    nodes, on, off = fleet
    p, d = nodes["p"].address, nodes["d"].address
    long, medium, short = make_prompts(3, tiny_model.config.vocab_size, seed=41, min_len=8, max_len=8)
    long, medium = long * 25, medium * 5  # 200 and 40 tokens
    greedy = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    expected = make_llm(tiny_model, chunked_prefill_size=16).generate([short], greedy)

    held, held_thread, _ = start(on, "long", long)
    wait_phase(p, "long", "prefilling")  # 200 tokens queued at P for ~12 s more, however fast this host
    assert decisions(on) == {("prefill", "long_prompt"): 1}

    # 8 tokens, 200 queued at P > 4 x 8: the decode node computes it alone
    _, thread, local = start(on, "short", short)
    thread.join(timeout=60)
    assert local and all(isinstance(r, generation_pb2.GenerateResponse) for r in local), local
    assert not any(r.HasField("transfer") for r in local)  # no KV moved: D computed the prompt
    assert tokens(local) == expected[0].output_ids
    assert local[-1].usage.prompt_tokens == 8 and local[-1].finish_reason == "length"
    assert decisions(on) == {("prefill", "long_prompt"): 1, ("local", "prefill_queue"): 1}
    samples = on.dispatcher.metrics.pd_decisions.collect()[0].samples
    assert {s.labels["outcome"]: s.value for s in samples if s.name.endswith("_total") and s.value} == {
        "disaggregated": 1, "local": 1
    }  # fmt: skip

    # 40 tokens, past the limit of 32: the prefill node's, behind the long one
    queued, queued_thread, _ = start(on, "medium", medium)
    wait_phase(p, "medium", "waiting")
    assert decisions(on)[("prefill", "long_prompt")] == 2

    # without local prefill the short prompt waits at P too: its P->D tokens, from a decode node that
    # holds nothing of what it computed itself
    clear_cache(d)
    _, pd_thread, pd = start(off, "short-pd", short)
    wait_phase(p, "short-pd", "waiting")
    assert decisions(off) == {}
    held.cancel()  # P is free for it
    queued.cancel()
    pd_thread.join(timeout=60)
    assert pd and all(isinstance(r, generation_pb2.GenerateResponse) for r in pd), pd
    assert pd[0].HasField("transfer")  # prefilled by P, moved to D
    assert tokens(pd) == tokens(local)
    for t in (held_thread, queued_thread):
        t.join(timeout=60)
    assert wait_until(lambda: all(n.pending_tokens == 0 and n.outstanding == 0 for n in on.pool.nodes), timeout=30)
    for addr in (p, d):
        st = wait_idle(addr)
        assert all(r.kv_pages_used == 0 for r in st.ranks) and not any(st.queues.values())


def test_a_decode_node_computes_a_prompt_only_on_a_signed_local_route(tiny_model, fleet):
    nodes, _, _ = fleet
    d = nodes["d"].address
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(d))
    [ids] = make_prompts(1, tiny_model.config.vocab_size, seed=43, min_len=11, max_len=11)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    [expected] = make_llm(tiny_model, chunked_prefill_size=16).generate([ids], greedy)

    def generate(rid: str, route, **fields):
        sampling = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, n=fields.pop("n", 1))
        request = generation_pb2.GenerateRequest(
            rid=rid, prompt=token_prompt(ids), sampling=sampling, prefill=route, **fields
        )
        return list(stub.Generate(request, timeout=60))

    def local(rid: str) -> generation_pb2.PrefillRoute:  # as the router makes it: over the rid
        return fleet_signed(generation_pb2.PrefillRoute(local=True), rid.encode())

    for route in (generation_pb2.PrefillRoute(local=True), local("another")):  # unsigned; another request's
        with pytest.raises(grpc.RpcError) as refused:
            generate("one", route)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as roomed:
        generate("roomed", fleet_signed(generation_pb2.PrefillRoute(local=True, room=7), b"roomed"))
    assert roomed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "names no room" in roomed.value.details()

    assert tokens(generate("one", local("one"))) == expected.output_ids
    # a migration's continuation (prompt + the tokens sent) goes on where the run was
    assert tokens(generate("two", local("two"), resume_ids=expected.output_ids[:5])) == expected.output_ids[5:]
    # n > 1: the choices fork from choice 0's prompt pages here too (greedy: each the same tokens)
    both = generate("three", local("three"), n=2)
    assert [tokens(r for r in both if r.index == i) for i in (0, 1)] == [expected.output_ids] * 2
    st = wait_idle(d)
    assert all(r.kv_pages_used == 0 for r in st.ranks) and not any(st.queues.values())
