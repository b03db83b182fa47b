"""n > 1 on real nodes: one prefill, n decodes. With a seed, the n choices differ from each other and
each equals a run of that choice alone (seed + i); the prompt is computed once (the nodes' own
count of prefill chunk tokens: the prompt, plus each other choice's last partial page); every page
is free once the last choice ended. Colocated (pp 1 with the prefix cache, pp 2 without) and
P pp {1, 2} -> D pp {1, 2}, where the decode node forks the choices after the hand-off."""

from __future__ import annotations

import random
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from urllib.request import urlopen

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.pd import TINY, clear_cache, metric_total, pd_generate, signed_route, token_prompt, wait_idle

PS = TINY.page_size
PROMPT = [random.Random(3).randrange(3, 200) for _ in range(30)]  # 7 full pages before its last token
TAIL = len(PROMPT) - (len(PROMPT) - 1) // PS * PS  # what each choice i > 0 computes of the prompt: 2 tokens


def sampling(n: int = 1, seed: int = 11, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_new_tokens=8, ignore_eos=True, temperature=1.0, top_k=50, seed=seed, n=n if n > 1 else 0, **kw
    )


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    specs = {
        "c1": ("colocated", 1, TINY),
        "c2": ("colocated", 2, replace(TINY, disable_prefix_cache=True, max_pending_requests=8)),
        "p": ("prefill", 2, TINY),
        "d": ("decode", 2, TINY),
        "p1": ("prefill", 1, TINY),
        "d1": ("decode", 1, TINY),
    }

    def start(spec):
        role, pp, config = spec
        backend = {"transfer_backend": "shm"} if role == "decode" else {}
        return start_node(role, NodeConfig(config, PPConfig(pp_size=pp), metrics_port=0, **backend))

    with ThreadPoolExecutor(len(specs)) as pool:
        nodes = dict(zip(specs, pool.map(start, specs.values())))
    yield nodes
    with ThreadPoolExecutor(len(nodes)) as pool:
        list(pool.map(lambda n: n.stop(), nodes.values()))


def prefill_tokens(node) -> float:
    """Prompt tokens the node computed so far (rank 0's count of its prefill chunks)."""
    return metric_total(node, "kvbridge_prefill_chunk_tokens_sum")


def by_choice(responses, n: int) -> tuple[list[list[int]], list[generation_pb2.GenerateResponse]]:
    """Each choice's tokens, and each choice's last response."""
    tokens, last = [[] for _ in range(n)], [None] * n
    for r in responses:
        assert last[r.index] is None, f"choice {r.index} answered after its last response"
        tokens[r.index] += r.token_ids
        if r.finish_reason:
            last[r.index] = r
    assert all(last), "a choice never ended"
    return tokens, last


def generate(node, s: common_pb2.SamplingParams, prompt=PROMPT) -> list[generation_pb2.GenerateResponse]:
    req = generation_pb2.GenerateRequest(rid=secrets.token_hex(6), prompt=token_prompt(prompt), sampling=s)
    return list(generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address)).Generate(req, timeout=120))


@pytest.mark.parametrize("name", ["c1", "c2"])
def test_colocated_n4_seeded_choices_differ_and_each_equals_its_run_alone(fleet, name):
    node = fleet[name]
    clear_cache(node.address)
    before = prefill_tokens(node)
    tokens, last = by_choice(generate(node, sampling(4)), 4)
    assert prefill_tokens(node) - before == len(PROMPT) + 3 * TAIL  # the prompt once, then 2 tokens a choice
    assert len({tuple(t) for t in tokens}) == 4, tokens
    assert [(r.finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens) for r in last] == [
        ("length", len(PROMPT), 8)
    ] * 4
    st = wait_idle(node.address)
    assert sum(r.kv_pages_used for r in st.ranks) == 0 and not any(st.queues.values())
    alone = [by_choice(generate(node, sampling(1, seed=11 + i)), 1)[0][0] for i in range(4)]
    assert tokens == alone


@pytest.mark.parametrize(("p_name", "d_name"), [("p", "d"), ("p1", "d1"), ("p1", "d"), ("p", "d1")])
def test_disaggregated_n4_forks_on_the_decode_node_after_the_hand_off(fleet, p_name, d_name):
    p, d, c = fleet[p_name], fleet[d_name], fleet["c2"]
    clear_cache(p.address, d.address)
    before_p, before_d = prefill_tokens(p), prefill_tokens(d)
    _, responses, prefilled = pd_generate(p.address, d.address, token_prompt(PROMPT), 8, sampling=sampling(4))
    assert isinstance(prefilled, prefill_pb2.PrefillResponse), prefilled
    tokens, last = by_choice(responses, 4)
    # P computed the prompt once; D only each other choice's last partial page
    assert (prefill_tokens(p) - before_p, prefill_tokens(d) - before_d) == (len(PROMPT), 3 * TAIL)
    assert responses[0].index == 0 and responses[0].HasField("transfer")  # choice 0's hand-off
    assert [r.usage.completion_tokens for r in last] == [8] * 4
    colocated, _ = by_choice(generate(c, sampling(4)), 4)
    assert tokens == colocated
    for addr in (p.address, d.address):
        st = wait_idle(addr)
        assert sum(r.kv_pages_used for r in st.ranks) == 0 and not any(st.queues.values()), addr


def test_prompt_logprobs_come_once_and_logprobs_with_every_choice(fleet):
    responses = generate(fleet["c1"], sampling(3, logprobs=2, prompt_logprobs=1))
    tokens, _ = by_choice(responses, 3)
    assert sum(len(r.prompt_logprobs) for r in responses) == len(PROMPT)
    for i in range(3):
        lps = [lp for r in responses if r.index == i for lp in r.logprobs]
        assert [lp.token_id for lp in lps] == tokens[i] and all(len(lp.top_logprobs) == 2 for lp in lps)


def test_a_prefill_node_refuses_n_and_a_continuation_refuses_n(fleet):
    stub = prefill_pb2_grpc.PrefillStub(rpc.make_channel(fleet["p"].address))
    req = prefill_pb2.PrefillRequest(rid="x", room=5, prompt=token_prompt(PROMPT), sampling=sampling(2))
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "sampling.n is 2: a prefill node computes choice 0 (the decode node forks the others)"
    resumed = generation_pb2.GenerateRequest(prompt=token_prompt(PROMPT), sampling=sampling(2), resume_ids=[5])
    with pytest.raises(grpc.RpcError) as e:
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(fleet["c1"].address)).Generate(resumed, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "resume_ids continue one choice; sampling.n must be 1 with them, got 2"
    bad = generation_pb2.GenerateRequest(prompt=token_prompt(PROMPT), sampling=sampling(17))
    with pytest.raises(grpc.RpcError) as e:
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(fleet["c1"].address)).Generate(bad, timeout=30))
    assert e.value.details() == "sampling.n must be in [1, 16], got 17"
    beyond = generation_pb2.GenerateRequest(prompt=token_prompt(PROMPT), sampling=sampling(9))
    with pytest.raises(grpc.RpcError) as e:  # (it could never fit: not RESOURCE_EXHAUSTED, which is retried)
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(fleet["c2"].address)).Generate(beyond, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "sampling.n is 9; this node holds at most 8 requests (--max-pending-requests)"


@pytest.mark.parametrize("name", ["c2", "d"])
def test_a_cancelled_n_request_ends_every_choice_and_frees_every_page(fleet, name):
    node, s = fleet[name], replace_max(sampling(4), 400)
    if name == "d":
        rid, room = secrets.token_hex(6), secrets.randbits(63)
        p = fleet["p"]
        half = prefill_pb2.PrefillRequest(
            rid=rid, room=room, prompt=token_prompt(PROMPT), sampling=replace_max(sampling(), 400)
        )
        prefill = prefill_pb2_grpc.PrefillStub(rpc.make_channel(p.address)).Prefill.future(half, timeout=120)
        route = signed_route(room, p.address)
        req = generation_pb2.GenerateRequest(rid=rid, prompt=token_prompt(PROMPT), sampling=s, prefill=route)
    else:
        prefill, req = None, generation_pb2.GenerateRequest(prompt=token_prompt(PROMPT), sampling=s)
    stream = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address)).Generate(req, timeout=120)
    seen = set()
    for r in stream:
        seen.add(r.index)
        if len(seen) == 4:
            break
    stream.cancel()
    if prefill is not None:
        prefill.result()
    st = wait_idle(node.address)
    assert sum(r.kv_pages_used for r in st.ranks) == 0 and not any(st.queues.values())


def replace_max(s: common_pb2.SamplingParams, max_new: int) -> common_pb2.SamplingParams:
    out = common_pb2.SamplingParams()
    out.CopyFrom(s)
    out.max_new_tokens = max_new
    return out


def test_choices_retracted_on_a_small_decode_node_still_equal_colocated(fleet):
    """A decode pool of 24 pages; four choices growing to 18 pages each: the newest are retracted
    (their KV to host memory, shared pages and all) and resumed, and every choice is unchanged."""
    d = start_node(
        "decode",
        NodeConfig(replace(TINY, kv_cache_tokens=96), PPConfig(pp_size=2), transfer_backend="shm", metrics_port=0),
    )
    try:
        s = replace_max(sampling(4), 40)
        _, responses, prefilled = pd_generate(fleet["p"].address, d.address, token_prompt(PROMPT), 40, sampling=s)
        assert isinstance(prefilled, prefill_pb2.PrefillResponse), prefilled
        tokens, _ = by_choice(responses, 4)
        assert tokens == by_choice(generate(fleet["c2"], s), 4)[0]
        body = urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).read().decode()
        assert float(re.search(r"^kvbridge_retractions_total (\S+)$", body, re.M).group(1)) >= 1
        st = wait_idle(d.address)
        assert sum(r.kv_pages_used for r in st.ranks) == 0 and not any(st.queues.values())
    finally:
        d.stop()
