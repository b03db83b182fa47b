"""Cache-aware routing on real nodes: a router over 2 prefill nodes and 1 decode node (tiny-random)
sends every later turn of a conversation to the prefill node holding its prefix, with no session
affinity (the index fed by the nodes' KV events is all it uses); a node whose event stream is
killed is resynced from a fresh snapshot and routed to as before."""

from __future__ import annotations

import random
import time

import pytest

from kvbridge.common import rpc
from kvbridge.common.blocks import block_hashes
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.pd import TINY, status, token_prompt

PS = TINY.page_size
VOCAB = 320


@pytest.fixture(scope="module")
def fleet(hard_timeout):
    prefill = [start_node("prefill", NodeConfig(TINY, PPConfig())) for _ in range(2)]
    decode = start_node("decode", NodeConfig(TINY, PPConfig(), transfer_backend="shm"))
    router = start_router(
        RouterConfig(
            port=0,
            http_port=0,
            prefill=tuple(p.address for p in prefill),
            decode=(decode.address,),
            health_retry_s=0.1,
        )
    )
    yield router, prefill, decode
    router.stop(grace_s=0)
    for node in (*prefill, decode):
        node.stop()


def generate(router, prompt: list[int]) -> tuple[list[int], int]:
    """(output tokens, usage.cached_tokens) of one request through the router."""
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
    req = generation_pb2.GenerateRequest(
        prompt=token_prompt(prompt), sampling=common_pb2.SamplingParams(max_new_tokens=3, ignore_eos=True)
    )
    responses = list(stub.Generate(req, timeout=60))
    return [t for r in responses for t in r.token_ids], responses[-1].usage.cached_tokens


def served(nodes) -> list[int]:
    return [status(n.address).requests_served for n in nodes]


def synced(router, node) -> bool:
    """The router's index of `node` holds exactly what the node's cache holds."""
    index = next(n for n in router.pool.nodes if n.address == node.address).blocks
    hub = node.node.front.kv_events
    return index.synced and set(index.hashes()) == node.loop.invoke(lambda: set(hub.blocks))


def wait_synced(router, nodes, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(synced(router, n) for n in nodes):
        assert time.monotonic() < deadline, "the router's index never caught up with the nodes' caches"
        time.sleep(0.02)


def test_later_turns_reach_the_prefill_node_holding_their_prefix(fleet):
    router, prefill, _ = fleet
    rng = random.Random(4)
    system = [rng.randrange(3, VOCAB) for _ in range(PS - 1)]  # shared, but no full page: first turns tie
    chats = [system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(6)]
    where: dict[int, int] = {}  # conversation -> the prefill node of its first turn
    last: dict[int, int] = {}  # conversation -> its previous prompt's length (the prefill node cached its full pages)
    for turn in range(4):
        for c, prompt in enumerate(chats):
            before = served(prefill)
            wait_synced(router, prefill)  # (a turn follows its previous one: their events are in)
            out, cached = generate(router, prompt)
            [node] = [i for i, (a, b) in enumerate(zip(before, served(prefill))) if b > a]
            if turn == 0:
                where[c] = node
            else:  # the node holding the conversation so far, and every full page it computed found
                assert (node, cached) == (where[c], last[c] // PS * PS), (c, turn)
            last[c] = len(prompt)
            chats[c] = prompt + out + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))]
    assert sorted(where.values()) == [0, 0, 0, 1, 1, 1]  # the first turns (ties) were spread round-robin


def test_a_killed_event_stream_is_resynced_from_a_snapshot(fleet):
    router, prefill, _ = fleet
    resyncs = router.dispatcher.metrics.registry.get_sample_value
    labels = {"reason": "error"}
    prompt = [7, 8, 9, 10] * 5
    generate(router, prompt)
    wait_synced(router, prefill)
    before = resyncs("kvbridge_router_kv_event_resyncs_total", labels)
    for node in prefill:
        hub = node.node.front.kv_events
        assert node.loop.invoke(hub.close_watchers) == 1  # the router's stream, ended by the node
    deadline = time.monotonic() + 10
    while resyncs("kvbridge_router_kv_event_resyncs_total", labels) < before + 2:
        assert time.monotonic() < deadline, "the router did not notice its streams ending"
        time.sleep(0.02)
    wait_synced(router, prefill)  # re-opened: the snapshot holds every block again
    assert block_hashes(prompt, PS)[0] in set().union(*(set(n.node.front.kv_events.blocks) for n in prefill))
    _, cached = generate(router, [*prompt, 11, 12])
    assert cached == 5 * PS  # its 5 full pages, found where they were cached
