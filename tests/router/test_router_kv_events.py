"""Cache-aware routing against in-test nodes that serve KVEvents: the router's indexes follow the
nodes' events (gaps, lagged snapshots and broken streams resync them), requests go to the node
holding their prefix (token ids, or text through the node's own tokenizer; salted apart), and
cache_salt, cached_tokens and ClearPrefixCache cross the router."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.blocks import block_hashes
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2
from tests.router.fakes import TOKENIZER, make_request, router_stub, wait_until


def pool_node(router, fake):
    [node] = [n for n in router.pool.nodes if n.address == fake.address]
    return node


def synced(router, fake):
    """The router's index of `fake` once it has the fake's blocks and seq."""
    index = pool_node(router, fake).blocks
    assert wait_until(lambda: index.synced and index.seq == fake.kv.seq and index.hashes() == fake.kv.blocks)
    return index


def sample(router, name: str, **labels) -> float:
    return router.dispatcher.metrics.registry.get_sample_value(name, labels) or 0.0


def resyncs(router, reason: str) -> float:
    return sample(router, "kvbridge_router_kv_event_resyncs_total", reason=reason)


def decisions(router, role: str, reason: str, policy: str = "cache_aware") -> float:
    return sample(router, "kvbridge_router_routing_decisions_total", role=role, policy=policy, reason=reason)


def served_by(nodes) -> list[int]:
    return [len(n.requests) for n in nodes]


def test_the_index_follows_stored_removed_and_cleared_events(fleet):
    router, nodes = fleet(colocated=1, kv_events=True)
    kv = nodes["colocated"][0].kv
    index = synced(router, nodes["colocated"][0])
    assert (index.hashes(), index.page_size) == (frozenset(), 4)
    kv.store([1, 2, 3])
    kv.remove([2])
    synced(router, nodes["colocated"][0])
    assert index.hashes() == {1, 3}
    kv.clear()
    synced(router, nodes["colocated"][0])
    assert (index.hashes(), kv.opened) == (frozenset(), 1)
    assert [resyncs(router, r) for r in ("gap", "error", "lagged", "overflow")] == [0, 0, 0, 0]


def test_a_gap_resyncs_from_a_new_snapshot(fleet):
    router, nodes = fleet(colocated=1, kv_events=True)
    fake = nodes["colocated"][0]
    index = synced(router, fake)
    fake.kv.store([1, 2])
    fake.kv.lose([7])  # seq + 1 never reaches the router
    fake.kv.store([8])  # seq + 2: a gap
    assert wait_until(lambda: resyncs(router, "gap") == 1)
    index = synced(router, fake)
    assert (index.hashes(), fake.kv.opened) == ({1, 2, 7, 8}, 2)  # 7 came with the new stream's snapshot
    assert (resyncs(router, "error"), resyncs(router, "lagged")) == (0, 0)


def test_a_lagged_snapshot_replaces_the_set_on_the_open_stream(fleet):
    router, nodes = fleet(colocated=1, kv_events=True)
    fake = nodes["colocated"][0]
    synced(router, fake)
    fake.kv.store([1])
    fake.kv.lose([9])
    fake.kv.lag()
    assert wait_until(lambda: resyncs(router, "lagged") == 1)
    assert (synced(router, fake).hashes(), fake.kv.opened, resyncs(router, "gap")) == ({1, 9}, 1, 0)


@pytest.mark.parametrize("code", [None, grpc.StatusCode.INTERNAL])
def test_a_broken_stream_clears_the_index_until_a_new_stream_resyncs_it(fleet, code):
    router, nodes = fleet(colocated=1, kv_events=True)
    fake = nodes["colocated"][0]
    index = synced(router, fake)
    fake.kv.store([1, 2])
    synced(router, fake)
    fake.kv.refuse = grpc.StatusCode.UNAVAILABLE  # new streams fail at once: the index stays cleared
    fake.kv.end(code)
    assert wait_until(lambda: not index.synced)
    assert wait_until(lambda: fake.kv.refused >= 2)  # re-opened every health_retry_s (0.1 s)
    assert (len(index), resyncs(router, "error")) == (0, 1)  # failed re-opens lose nothing more: not counted
    fake.kv.store([5])
    fake.kv.refuse = None
    assert synced(router, fake).hashes() == {1, 2, 5}
    assert resyncs(router, "error") == 1


def test_a_node_without_kv_events_is_not_watched_and_routes_as_no_index(fleet):
    router, nodes = fleet(colocated=1)
    node = pool_node(router, nodes["colocated"][0])
    assert wait_until(lambda: not node.kv_events)
    assert len(list(router_stub(router).Generate(make_request(ids=range(8)), timeout=30))) == 5
    assert decisions(router, "colocated", "no_index") == 1


def test_token_id_prompts_go_to_the_node_holding_their_prefix(fleet):
    router, nodes = fleet(colocated=2, kv_events=True)
    a, b = nodes["colocated"]
    ids = list(range(10, 22))  # 3 blocks of 4
    b.kv.store(block_hashes(ids, 4)[:2])
    synced(router, a), synced(router, b)
    stub = router_stub(router)
    for _ in range(3):  # sequential: equal load each time
        list(stub.Generate(make_request(ids=ids), timeout=30))
    assert (served_by([a, b]), decisions(router, "colocated", "prefix_hit")) == ([0, 3], 3)
    salted = make_request(ids=ids)
    salted.cache_salt = "tenant-a"  # other hashes: b's blocks are not its prefix
    list(stub.Generate(salted, timeout=30))
    assert decisions(router, "colocated", "no_hit") == 1
    assert [r.cache_salt for r in a.requests + b.requests] == ["", "", "", "tenant-a"]
    assert pool_node(router, a).pending_tokens == pool_node(router, b).pending_tokens == 0


def text_request(text: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=text))


def test_text_prompts_are_hashed_with_the_tokenizer_fetched_once(fleet):
    router, nodes = fleet(colocated=2, kv_events=True)
    a, b = nodes["colocated"]
    text = "the same long system prompt"
    a.kv.store(block_hashes(TOKENIZER.encode(text), 4))
    synced(router, a), synced(router, b)
    stub = router_stub(router)
    for _ in range(2):
        list(stub.Generate(text_request(text), timeout=30))
    assert (served_by([a, b]), decisions(router, "colocated", "prefix_hit")) == ([2, 0], 2)
    assert a.tokenizer_calls + b.tokenizer_calls == 1


def test_without_a_tokenizer_text_routes_as_no_index_until_a_fetch_succeeds(fleet):
    router, nodes = fleet(colocated=1, kv_events=True)
    fake = nodes["colocated"][0]
    fake.tokenizer_fail = grpc.StatusCode.UNAVAILABLE
    synced(router, fake)
    stub = router_stub(router)
    list(stub.Generate(text_request("hello"), timeout=30))
    assert (decisions(router, "colocated", "no_index"), fake.tokenizer_calls) == (1, 1)
    fake.tokenizer_fail = None
    assert wait_until(lambda: (list(stub.Generate(text_request("hello"), timeout=30)), fake.tokenizer_calls)[1] == 2)
    assert decisions(router, "colocated", "no_hit") == 1  # the request that fetched it was routed with it


def test_disaggregated_prefill_goes_by_cache_and_the_client_sees_its_cached_tokens(fleet):
    router, nodes = fleet(prefill=2, decode=1, kv_events=True)
    (p0, p1), [d] = nodes["prefill"], nodes["decode"]
    ids = list(range(30, 46))
    p1.kv.store(block_hashes(ids, 4, "s")[:3])
    p1.cached_tokens, d.cached_tokens = 12, 5  # the client is told P's
    for fake in (p0, p1, d):
        synced(router, fake)
    req = make_request(ids=ids)
    req.cache_salt = "s"
    responses = list(router_stub(router).Generate(req, timeout=30))
    assert responses[-1].usage.cached_tokens == 12
    assert (served_by([p0, p1]), p1.requests[0].cache_salt) == ([0, 1], "s")
    assert (decisions(router, "prefill", "prefix_hit"), decisions(router, "decode", "no_hit")) == (1, 1)


def test_http_usage_reports_the_cached_prompt_tokens(fleet):
    router, nodes = fleet(colocated=1, kv_events=True)
    nodes["colocated"][0].cached_tokens = 8
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "cache_salt": "t"}).encode()
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        usage = json.loads(resp.read())["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                     "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    assert nodes["colocated"][0].requests[0].cache_salt == "t"


def test_a_salt_over_256_bytes_is_invalid_argument(fleet):
    router, _ = fleet(colocated=1)
    req = make_request()
    req.cache_salt = "é" * 129
    with pytest.raises(grpc.RpcError) as err:
        list(router_stub(router).Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "cache_salt is 258 UTF-8 bytes; at most 256"


def test_other_policies_are_counted_under_their_names(fleet):
    router, nodes = fleet(colocated=2, kv_events=True, router={"routing": "round_robin"})
    stub = router_stub(router)
    for _ in range(4):
        list(stub.Generate(make_request(), timeout=30))
    assert served_by(nodes["colocated"]) == [2, 2]
    assert decisions(router, "colocated", "round_robin", policy="round_robin") == 4


def admin(router) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(rpc.make_channel(f"127.0.0.1:{router.port}"))


def test_clear_prefix_cache_fans_out_and_sums_the_pages(fleet):
    router, nodes = fleet(colocated=2, kv_events=True)
    a, b = nodes["colocated"]
    a.kv.store([1, 2, 3])
    b.kv.store([4, 5])
    synced(router, a), synced(router, b)
    assert admin(router).ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=30).pages_dropped == 5
    assert (synced(router, a).hashes(), synced(router, b).hashes()) == (frozenset(), frozenset())
    b.fail_clear = grpc.StatusCode.INTERNAL
    with pytest.raises(grpc.RpcError) as err:
        admin(router).ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == (
        f"ClearPrefixCache failed on colocated/{b.address} (INTERNAL: '{b.address} cannot clear, as told')"
    )
