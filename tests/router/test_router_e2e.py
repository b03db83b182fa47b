"""The router in front of real colocated nodes (tiny-random): same tokens as the nodes, both
nodes used, a repeated prompt sent to the node that cached it, the official openai client, bad
input never reaching or killing anything, a stopped node routed around, and a vanished client
aborting the request on its node."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.common import rpc
from kvbridge.common.blocks import block_hashes
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.nodes import start_node
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.conftest import make_prompts
from tests.pd import status
from tests.router.fakes import make_request, wait_until

TINY = EngineConfig(model="tiny-random", page_size=4, kv_cache_tokens=8192)
VOCAB = 320  # tiny-random's vocabulary
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def make_router(*addresses: str):
    return start_router(RouterConfig(port=0, http_port=0, colocated=addresses, health_retry_s=0.1))


@pytest.fixture(scope="module")
def nodes():
    made = [start_node("colocated", NodeConfig(TINY, PPConfig())) for _ in range(2)]
    yield made
    for n in made:
        n.stop()


@pytest.fixture(scope="module")
def router(nodes):
    r = make_router(*(n.address for n in nodes))
    yield r
    r.stop(grace_s=0)


@pytest.fixture(autouse=True)
def nodes_end_idle(request, nodes):
    """After every test: no request left on any node and every page free (read through Admin)."""
    yield
    for n in nodes:
        deadline = time.monotonic() + 20
        while (st := status(n.address)).ranks[0].kv_pages_used or any(st.queues.values()):
            assert time.monotonic() < deadline, f"{n.address} not idle: {st}"
            time.sleep(0.05)


def gen_stub(address: str) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(rpc.make_channel(address))


def chat_request(messages: list[dict], **sampling) -> generation_pb2.GenerateRequest:
    chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**m) for m in messages])
    return generation_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(chat=chat), sampling=common_pb2.SamplingParams(**sampling)
    )


def run(stub, request) -> tuple[list[int], str, str]:
    """(token ids, text, finish_reason) of a whole stream."""
    responses = list(stub.Generate(request, timeout=120))
    ids = [t for r in responses for t in r.token_ids]
    return ids, "".join(r.text for r in responses), responses[-1].finish_reason


def test_grpc_through_the_router_equals_the_node(router, nodes):
    direct, routed = gen_stub(nodes[0].address), gen_stub(f"127.0.0.1:{router.port}")
    requests = [make_request(p, max_new_tokens=12, ignore_eos=True) for p in make_prompts(3, VOCAB, seed=7)]
    requests.append(chat_request(CHAT, max_new_tokens=12, ignore_eos=True))
    for req in requests:
        want = run(direct, req)
        assert len(want[0]) == 12
        assert run(routed, req) == want


def test_both_nodes_serve_requests(router, nodes):
    before = [status(n.address).requests_served for n in nodes]
    stub = gen_stub(f"127.0.0.1:{router.port}")
    for p in make_prompts(6, VOCAB, seed=8):
        run(stub, make_request(p, max_new_tokens=3))
    after = [status(n.address).requests_served for n in nodes]
    assert [a - b for a, b in zip(after, before)] == [3, 3]  # idle and equal: strict alternation
    st = status(f"127.0.0.1:{router.port}")
    assert st.role == "router" and set(st.queues.values()) == {0} and st.requests_served >= 6


def test_a_repeated_prompt_goes_to_the_node_that_cached_it(router, nodes):
    prompt = make_prompts(1, VOCAB, seed=11, min_len=17, max_len=17)[0]  # 4 full pages of 4
    stub = gen_stub(f"127.0.0.1:{router.port}")
    labels = {"role": "colocated", "policy": "cache_aware", "reason": "prefix_hit"}

    def hits() -> float:
        return router.dispatcher.metrics.registry.get_sample_value("kvbridge_router_routing_decisions_total", labels)

    before, hits_before = [status(n.address).requests_served for n in nodes], hits() or 0.0
    run(stub, make_request(prompt, max_new_tokens=2))
    [first] = [i for i, n in enumerate(nodes) if status(n.address).requests_served > before[i]]
    index = next(n for n in router.pool.nodes if n.address == nodes[first].address).blocks
    assert wait_until(lambda: block_hashes(prompt, 4)[0] in index)  # its KV events reached the router
    for _ in range(3):
        run(stub, make_request(prompt, max_new_tokens=2))
    served = [status(n.address).requests_served - b for n, b in zip(nodes, before)]
    assert (served[first], served[1 - first], hits() - hits_before) == (4, 0, 3)


def test_openai_client_chat_and_streamed_completion(router, nodes):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0)
    [model] = [m.id for m in client.models.list().data]
    assert model == "tiny-random"
    direct = gen_stub(nodes[0].address)

    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)
    _, want_text, want_finish = run(direct, chat_request(CHAT, max_new_tokens=10))
    assert chat.choices[0].message.content == want_text and chat.choices[0].finish_reason == want_finish
    assert chat.usage.completion_tokens == len(run(direct, chat_request(CHAT, max_new_tokens=10))[0])

    stream = client.completions.create(  # (OpenAI's default temperature is 1: greedy, to compare)
        model=model,
        prompt="The sky is",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want_ids, want_text, _ = run(
        direct,
        generation_pb2.GenerateRequest(prompt=common_pb2.Prompt(text="The sky is"), sampling={"max_new_tokens": 10}),
    )
    assert text == want_text
    assert chunks[-1].usage.completion_tokens == len(want_ids)

    chat_chunks = list(
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0, stream=True)
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_concurrent_http_requests_all_complete(router, nodes):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0)
    prompts = make_prompts(8, VOCAB, seed=10)

    def one(i: int) -> int:
        extra = {"ignore_eos": True}
        if i % 2:
            stream = client.completions.create(model="tiny-random", prompt=prompts[i], max_tokens=5 + i, stream=True,
                                               stream_options={"include_usage": True}, extra_body=extra)  # fmt: skip
            return list(stream)[-1].usage.completion_tokens
        c = client.completions.create(model="tiny-random", prompt=prompts[i], max_tokens=5 + i, extra_body=extra)
        return c.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [5 + i for i in range(8)]
    assert set(router.pool.outstanding().values()) == {0}


# ---------------------------------------------------------------- bad input, generated


def post(port: int, path: str, raw: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def field(name: str, values) -> st.SearchStrategy:
    return st.tuples(st.just(name), values)


def other_than(*allowed: str) -> st.SearchStrategy:
    return st.text(min_size=1, max_size=8).filter(lambda r: r not in allowed)


JUNK = st.text(max_size=3) | st.booleans() | st.lists(st.integers(), max_size=2)  # wrong types
BAD_FIELDS = st.one_of(
    field("max_tokens", st.integers(max_value=0) | st.integers(min_value=2**32) | st.floats() | JUNK),
    field("temperature", st.floats().filter(lambda t: not 0 <= t <= 2) | JUNK),
    field("top_p", st.floats().filter(lambda t: not 0 < t <= 1) | JUNK),
    field("top_k", st.integers(max_value=-2) | st.integers(min_value=2**32) | JUNK),
    field("seed", st.integers(max_value=-1) | st.integers(min_value=2**64) | st.floats() | JUNK),
    field("n", st.integers().filter(lambda n: not 1 <= n <= 16) | st.text(max_size=3) | st.booleans()),
    field("stop", st.just("") | st.lists(st.just(""), min_size=1, max_size=2) | st.integers()),
    field("stream", st.integers() | st.text(max_size=3)),
    field("prompt", st.just("") | st.just([]) | st.lists(st.integers(VOCAB, 2**40), min_size=1, max_size=3)),
    field("prompt", st.lists(st.integers(0, VOCAB - 1), max_size=3).map(lambda v: [*v, -1])),
    field("model", st.integers() | st.text(min_size=1, max_size=5).map(lambda s: "no-such-" + s)),
)
CHAT_BAD_FIELDS = st.one_of(
    field("messages", st.just([]) | st.lists(st.text(max_size=3), min_size=1, max_size=2)),
    field("messages", other_than("system", "developer", "user", "assistant").map(lambda r: [{"role": r}])),
    BAD_FIELDS.filter(lambda kv: kv[0] != "prompt"),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))  # 300 bodies with a bad field
@given(chat=st.booleans(), data=st.data())
def test_http_bad_fields_get_400_naming_the_field(router, chat, data):
    body = {"model": "tiny-random", "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [1, 2, 3]}
    name, value = data.draw(CHAT_BAD_FIELDS if chat else BAD_FIELDS)
    body[name] = value
    status, reply = post(
        router.http_port, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode()
    )
    if name == "model" and isinstance(value, str):
        assert status == 404 and reply["error"]["param"] == "model"
        return
    assert status == 400, (body, reply)
    assert reply["error"]["type"] == "invalid_request_error"
    assert name in reply["error"]["message"] or "token id" in reply["error"]["message"], reply


VALID = json.dumps({"model": "tiny-random", "prompt": [1, 2, 3], "max_tokens": 2}).encode()


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))  # 200 malformed bodies
@given(raw=st.integers(0, len(VALID) - 1).map(lambda k: VALID[:k]) | st.binary(max_size=40))
def test_http_malformed_bodies_get_400(router, raw):
    status, reply = post(router.http_port, "/v1/completions", raw)
    assert status == 400 and reply["error"]["message"]


def sampled(**sampling) -> generation_pb2.GenerateRequest:
    return make_request([1, 2], max_new_tokens=2, **sampling)


def prompted(prompt: common_pb2.Prompt, **fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, sampling={"max_new_tokens": 2}, **fields)


def chat_with_role(role: str) -> common_pb2.Prompt:
    return common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=role, content="x")]))


def ids_prompt(ids: list[int]) -> common_pb2.Prompt:
    return common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids))


NAN, INF = float("nan"), float("inf")
BAD_RID = st.text(min_size=129, max_size=200) | st.text(min_size=1, max_size=8).filter(
    lambda r: not all(c.isascii() and (c.isalnum() or c in "._:-") for c in r)
)
GRPC_BAD_REQUESTS = st.one_of(
    st.floats(max_value=-1e-3).map(lambda t: sampled(temperature=t)),
    st.sampled_from([NAN, INF]).map(lambda t: sampled(temperature=t)),
    (st.floats(min_value=1.001, max_value=1e30) | st.floats(max_value=-1e-3)).map(lambda p: sampled(top_p=p)),
    st.just(NAN).map(lambda p: sampled(top_p=p)),
    st.integers(1, 3).map(lambda k: sampled(stop=[""] * k)),
    st.integers(17, 30).map(lambda k: sampled(stop=["s"] * k)),
    st.sampled_from([common_pb2.Prompt(), common_pb2.Prompt(text=""), ids_prompt([])]).map(prompted),
    st.lists(st.integers(VOCAB, 2**32 - 1), min_size=1, max_size=4).map(lambda ids: prompted(ids_prompt([1, *ids]))),
    other_than("system", "user", "assistant").map(lambda r: prompted(chat_with_role(r))),
    BAD_RID.map(lambda rid: prompted(common_pb2.Prompt(text="x"), rid=rid)),
    st.integers(0, 2**63 - 1).map(lambda room: prompted(common_pb2.Prompt(text="x"), prefill={"room": room})),
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))  # 200 requests
@given(case=GRPC_BAD_REQUESTS)
def test_grpc_bad_requests_get_invalid_argument(router, case):
    with pytest.raises(grpc.RpcError) as err:
        list(gen_stub(f"127.0.0.1:{router.port}").Generate(case, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_router_still_serves_after_the_bad_input(router):
    status, reply = post(router.http_port, "/v1/completions", VALID)
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------- failures


def test_stopped_node_is_routed_around(nodes):
    spare = start_node("colocated", NodeConfig(TINY, PPConfig()))
    r = make_router(nodes[0].address, spare.address)
    try:
        stub = gen_stub(f"127.0.0.1:{r.port}")
        before = status(nodes[0].address).requests_served
        spare.stop()
        for p in make_prompts(4, VOCAB, seed=9):
            assert len(run(stub, make_request(p, max_new_tokens=2, ignore_eos=True))[0]) == 2
        assert status(nodes[0].address).requests_served - before == 4
        assert not r.pool.nodes[1].healthy
    finally:
        r.stop(grace_s=0)


def served(nodes) -> int:
    return sum(status(n.address).requests_served for n in nodes)


def test_grpc_cancel_through_the_router_aborts_on_the_node(router, nodes):
    before = served(nodes)
    call = gen_stub(f"127.0.0.1:{router.port}").Generate(
        make_request(list(range(5, 60)), max_new_tokens=3000, ignore_eos=True), timeout=120
    )
    next(call)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 20
    while served(nodes) == before:
        assert time.monotonic() < deadline, "the node never ended the request"
        time.sleep(0.05)
    # nodes_end_idle checks that its pages were freed


def test_http_client_leaving_mid_stream_aborts_on_the_node(router, nodes):
    before = served(nodes)
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=60)
    body = {"prompt": list(range(5, 60)), "max_tokens": 3000, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline().strip()  # the first chunk's size line: tokens are flowing
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client is gone (close() alone waits for resp's file too)
    conn.sock.close()
    deadline = time.monotonic() + 20
    while served(nodes) == before:
        assert time.monotonic() < deadline, "the node never ended the request"
        time.sleep(0.05)


def test_a_prompt_list_fails_as_one_and_cancels_its_other_prompts(router, nodes):
    """One prompt of the list cannot be served (longer than the context): the answer is its 400,
    and the other prompts' requests, still decoding, are cancelled on the nodes (nodes_end_idle)."""
    body = {"prompt": [list(range(5, 60)), [7] * 5000], "n": 2, "max_tokens": 3000, "ignore_eos": True}
    status, reply = post(router.http_port, "/v1/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["code"] == "invalid_argument", reply
    assert "prompt has 5000 tokens; the context holds" in reply["error"]["message"]


def test_http_client_leaving_a_prompt_list_with_n_aborts_every_choice(router, nodes):
    before = served(nodes)
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=60)
    body = {"prompt": [list(range(5, 60)), list(range(9, 40))], "n": 3, "max_tokens": 3000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline().strip()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.sock.close()
    deadline = time.monotonic() + 20
    while served(nodes) < before + 6:  # two prompts of three choices: six requests at the nodes
        assert time.monotonic() < deadline, f"the nodes ended {served(nodes) - before} of 6"
        time.sleep(0.05)
    # nodes_end_idle checks that every page was freed
