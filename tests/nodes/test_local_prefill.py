"""Local prefill end to end (router/local_prefill.py): a real prefill node held busy (each of its
steps takes a second: a long prompt holds it for over ten), a real decode node, and two routers
over them, one with local prefill and one without. A short prompt is served by the decode node
alone (no transfer, counted), token for token what the P->D path gives it (and the engine alone); a
prompt past the limit still goes to the prefill node; the router with it off sends every prompt
there. (The decode node's side alone, in the default run: tests/nodes/test_local_route.py.)"""

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
from tests.pd import TINY, clear_cache, start_nodes, stop_nodes, token_prompt, wait_idle, wait_phase
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
