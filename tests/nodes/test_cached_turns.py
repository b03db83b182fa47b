"""The prefix cache on real nodes: colocated and disaggregated outputs equal cache-off outputs for
P pp {1, 2} x D pp {1, 2}, on turns sharing prefixes of every alignment; each node finds exactly
the pages it computed (or received) before; a decode node's held pages are not moved (counted by
the prefill ranks' pushes); the KV event stream follows the cache."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest

from kvbridge.common import blocks, rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.engine.batch import ForwardBatch
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.pipeline.log import ADMIT, REUSE, Admitted, LogEntry, Pages
from kvbridge.pipeline.stage import StageLoop
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc, kv_events_pb2, kv_events_pb2_grpc
from tests.conftest import make_llm
from tests.pd import TINY, clear_cache, metric_total, pd_generate, status, token_prompt, wait_idle

PS = TINY.page_size
MAX_NEW = 5
SAMPLINGS = {
    "greedy": SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
    "seeded": SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_k=20, seed=5),
}


def _proto(p: SamplingParams) -> common_pb2.SamplingParams:
    out = common_pb2.SamplingParams(max_new_tokens=p.max_new_tokens, ignore_eos=True, temperature=p.temperature)
    if p.seed is not None:
        out.seed, out.top_k = p.seed, p.top_k
    return out


def turns(vocab: int, seed: int = 9) -> list[list[int]]:
    """Prompts sharing prefixes with the ones before at every alignment: mid-page, a whole prompt
    again, ending on a page boundary (twice), longer, diverging inside a page."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(41)]
    return [base[:14], base[:14], base[:20], base[:20], base[:33], base[:10] + [rng.randrange(3, vocab)] * 9, base]


def expected_hits(prompts: list[list[int]], outputs: list[list[int]], full_hit: bool, keeps_output: bool) -> list[int]:
    """Pages each prompt finds in a cache that indexed every full block computed before it: the
    prompt (a prefill or colocated node), or prompt and output but the last token (a decode node,
    or a colocated one), from an empty cache; a prefill node leaves the last token to compute."""
    known: set[int] = set()
    hits = []
    for prompt, out in zip(prompts, outputs):
        hashes = blocks.block_hashes(prompt, PS)
        limit = len(prompt) // PS if full_hit else (len(prompt) - 1) // PS
        n = 0
        while n < limit and hashes[n] in known:
            n += 1
        hits.append(n)
        computed = prompt + out[:-1] if keeps_output else prompt
        known.update(blocks.block_hashes(computed, PS))
    return hits


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    specs = {"c": ("colocated", 1), **{f"p{pp}": ("prefill", pp) for pp in (1, 2)}}
    specs |= {f"d{pp}": ("decode", pp) for pp in (1, 2)}

    def start(spec):
        role, pp = spec
        backend = {"transfer_backend": "shm"} if role == "decode" else {}
        return start_node(role, NodeConfig(TINY, PPConfig(pp_size=pp), metrics_port=0, **backend))

    with ThreadPoolExecutor(len(specs)) as pool:
        nodes = dict(zip(specs, pool.map(start, specs.values())))
    yield nodes
    for node in nodes.values():
        node.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Cache-off outputs of the one-process engine, per sampling."""
    prompts = turns(tiny_model.config.vocab_size)
    llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size, disable_prefix_cache=True)
    return prompts, {name: [llm.generate([p], sp)[0].output_ids for p in prompts] for name, sp in SAMPLINGS.items()}


def pushed_bytes(node) -> float:
    """KV bytes the node's prefill ranks pushed so far (their own count: kvbridge_kv_transfer_bytes_total)."""
    return metric_total(node, "kvbridge_kv_transfer_bytes_total")


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize(("p_pp", "d_pp"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_disaggregated_turns_with_the_cache_equal_cache_off_outputs(fleet, reference, p_pp, d_pp, sampling):
    prefill, decode = fleet[f"p{p_pp}"], fleet[f"d{d_pp}"]
    prompts, outputs = reference[0], reference[1][sampling]
    clear_cache(prefill.address, decode.address)
    page_bytes = None
    p_hits, d_held = [], []
    for prompt, want in zip(prompts, outputs):
        before = pushed_bytes(prefill)
        tokens, responses, prefilled = pd_generate(
            prefill.address, decode.address, token_prompt(prompt), MAX_NEW, sampling=_proto(SAMPLINGS[sampling])
        )
        assert not isinstance(prefilled, grpc.RpcError), prefilled
        assert tokens == want
        stats = responses[0].transfer
        p_hits.append(prefilled.cached_tokens // PS)
        d_held.append(stats.pages_skipped)
        moved = -(-len(prompt) // PS) - stats.pages_skipped
        page_bytes = page_bytes or stats.kv_bytes // moved
        assert stats.kv_bytes == moved * page_bytes
        # the prefill ranks' own count of what they pushed: only the pages the decode node lacked
        wait_idle(prefill.address)
        assert pushed_bytes(prefill) - before == moved * page_bytes
    assert p_hits == expected_hits(prompts, outputs, full_hit=False, keeps_output=False) == [0, 3, 3, 4, 5, 2, 8]
    assert d_held == expected_hits(prompts, outputs, full_hit=True, keeps_output=True)
    assert d_held[1] == 3 and d_held[3] == 5  # a second turn: only its missing pages move
    for node in (prefill, decode):
        st = wait_idle(node.address)
        assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks)
        assert st.prefix_cache.enabled and st.prefix_cache.cached_pages > 0


def test_prefill_pushes_its_cached_pages_to_a_decode_node_that_lacks_them(fleet, reference):
    """P finds the prefix in its cache but D does not hold it: P pushes the cached pages too."""
    prefill, decode = fleet["p2"], fleet["d1"]
    prompts, outputs = reference[0], reference[1]["greedy"]
    clear_cache(prefill.address, decode.address)
    pd_generate(prefill.address, decode.address, token_prompt(prompts[0]), MAX_NEW)
    clear_cache(decode.address)
    tokens, responses, prefilled = pd_generate(prefill.address, decode.address, token_prompt(prompts[1]), MAX_NEW)
    assert tokens == outputs[1]
    assert prefilled.cached_tokens == 12 and responses[0].transfer.pages_skipped == 0


def test_colocated_turns_with_the_cache_equal_cache_off_outputs(fleet, reference):
    node = fleet["c"]
    prompts, outputs = reference[0], reference[1]["greedy"]
    clear_cache(node.address)
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address))
    cached = []
    for prompt, want in zip(prompts, outputs):
        req = generation_pb2.GenerateRequest(prompt=token_prompt(prompt), sampling=_proto(SAMPLINGS["greedy"]))
        responses = list(stub.Generate(req, timeout=60))
        assert [t for r in responses for t in r.token_ids] == want
        cached.append(responses[-1].usage.cached_tokens // PS)
    assert cached == expected_hits(prompts, outputs, full_hit=False, keeps_output=True)
    salted = generation_pb2.GenerateRequest(
        prompt=token_prompt(prompts[0]), sampling=_proto(SAMPLINGS["greedy"]), cache_salt="tenant-x"
    )
    assert list(stub.Generate(salted, timeout=60))[-1].usage.cached_tokens == 0
    too_long = generation_pb2.GenerateRequest(prompt=token_prompt(prompts[0]), cache_salt="s" * 257)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(too_long, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "cache_salt is 257 UTF-8 bytes; at most 256"


def test_the_event_stream_follows_the_cache_from_a_snapshot(fleet, reference):
    node = fleet["c"]
    prompts = reference[0]
    clear_cache(node.address)
    events = kv_events_pb2_grpc.KVEventsStub(rpc.make_channel(node.address)).Watch(
        kv_events_pb2.WatchKVEventsRequest(), timeout=60
    )
    snap = next(events)
    assert snap.snapshot and snap.page_size == PS and snap.role == "colocated"
    assert list(snap.events[0].block_hashes) == []
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address))
    req = generation_pb2.GenerateRequest(prompt=token_prompt(prompts[0]), sampling=_proto(SAMPLINGS["greedy"]))
    out = [t for r in stub.Generate(req, timeout=60) for t in r.token_ids]
    stored, seq = set(), snap.seq
    want = set(blocks.block_hashes(prompts[0] + out[:-1], PS))
    while stored != want:
        batch = next(events)
        assert batch.seq == seq + 1 and not batch.snapshot
        seq = batch.seq
        for ev in batch.events:
            assert ev.kind == kv_events_pb2.KVEvent.STORED
            stored.update(ev.block_hashes)
    clear_cache(node.address)
    batch = next(events)
    assert batch.seq == seq + 1 and [e.kind for e in batch.events] == [kv_events_pb2.KVEvent.CLEARED]
    events.cancel()
    again = kv_events_pb2_grpc.KVEventsStub(rpc.make_channel(node.address)).Watch(
        kv_events_pb2.WatchKVEventsRequest(), timeout=60
    )
    snap = next(again)
    assert snap.snapshot and snap.seq == seq + 1 and list(snap.events[0].block_hashes) == []
    again.cancel()
    assert status(node.address).prefix_cache.cached_pages == 0


def test_a_node_without_the_cache_finds_nothing(tiny_model):
    node = start_node("colocated", NodeConfig(replace(TINY, disable_prefix_cache=True), PPConfig()))
    try:
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address))
        prompt = turns(tiny_model.config.vocab_size)[0]
        req = generation_pb2.GenerateRequest(prompt=token_prompt(prompt), sampling=_proto(SAMPLINGS["greedy"]))
        for _ in range(2):
            assert list(stub.Generate(req, timeout=60))[-1].usage.cached_tokens == 0
        assert not status(node.address).prefix_cache.enabled
    finally:
        node.stop()


@pytest.mark.long
def test_an_eviction_storm_through_a_pair_leaks_nothing_and_changes_no_output(tiny_model, hard_timeout):
    """300 requests over 20 shared prefixes, 24 at a time, through P (pp 2) and D (pp 2) whose
    pools hold a fraction of the prefixes: both evict all the time (D retracts too); outputs
    equal the cache-off engine's and every invariant holds (refcounts, index, queues, logs)."""
    rng = random.Random(13)
    vocab = tiny_model.config.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 40))] for _ in range(20)]
    prompts = [rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))] for _ in range(300)]
    small = replace(TINY, kv_cache_tokens=192)  # 48 pages; the prefixes alone need ~125
    nodes = [
        start_node("prefill", NodeConfig(small, PPConfig(pp_size=2))),
        start_node("decode", NodeConfig(small, PPConfig(pp_size=2), transfer_backend="shm")),
    ]
    try:
        prefill, decode = nodes
        llm = make_llm(tiny_model, chunked_prefill_size=TINY.chunked_prefill_size, disable_prefix_cache=True)
        want = [c.output_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))]
        with ThreadPoolExecutor(24) as pool:
            got = list(pool.map(lambda p: pd_generate(prefill.address, decode.address, token_prompt(p), 4), prompts))
        assert [tokens for tokens, _, _ in got] == want
        for node in nodes:
            st = wait_idle(node.address)
            assert [r.kv_pages_used for r in st.ranks] == [0] * len(st.ranks)
            assert st.prefix_cache.evicted_pages > 50 and st.prefix_cache.hit_tokens > 0, st.prefix_cache
            assert node.check_invariants() == []
    finally:
        for node in nodes:
            node.stop()


def test_a_rank_stops_on_a_chunk_that_does_not_start_on_the_reused_pages():
    """Rank 0's REUSE entry names the cached pages a request starts from; a later rank checks the
    next chunk against it (it would read another prefix's KV)."""
    loop = StageLoop(1, 2, None, SimpleNamespace(page_size=PS), None)
    loop._apply((LogEntry(0, ADMIT, "r", SamplingParams(), Admitted()), LogEntry(1, REUSE, "r", info=Pages((5, 6)))))
    loop._check_reuse(ForwardBatch(("r",), (8,), (3,), ((5, 6, 9),), (), (True,)))
    assert loop.reused == {}  # checked once: the chunks after it start anywhere
    loop._apply((LogEntry(2, REUSE, "r", info=Pages((5, 6))),))
    with pytest.raises(AssertionError, match=r"rank 1: r starts at 4 on pages \(5, 7, 9\), not on \[5, 6\]"):
        loop._check_reuse(ForwardBatch(("r",), (4,), (3,), ((5, 7, 9),), (), (True,)))
