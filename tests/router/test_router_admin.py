"""The router's Admin service in front of real tiny-random nodes: the fleet changed at run time
with routing following it, drain and resume, the requests in flight listed, paged and aborted
(the node's pages freed), status and config."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge import __version__
from kvbridge.common import rpc
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import Router, start_router
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc
from tests.pd import TINY, status, wait_idle
from tests.router.fakes import wait_until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
OPERATOR_ABORTED = "an operator aborted the request (Admin.AbortRequest on the router)"


@pytest.fixture(scope="module")
def nodes() -> dict:
    """Two colocated nodes, a prefill and a decode node (one rank each), started in parallel."""
    starts = {
        "c1": lambda: start_node("colocated", NodeConfig(TINY, PPConfig())),
        "c2": lambda: start_node("colocated", NodeConfig(TINY, PPConfig())),
        "p": lambda: start_node("prefill", NodeConfig(TINY, PPConfig())),
        "d": lambda: start_node("decode", NodeConfig(TINY, PPConfig())),
    }
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
        made = {name: f.result() for name, f in futures.items()}
    yield made
    with ThreadPoolExecutor(len(made)) as pool:
        list(pool.map(lambda n: n.stop(), made.values()))


@pytest.fixture(autouse=True)
def nodes_end_idle(nodes):
    """After every test: no page in use and no request queued on any node."""
    yield
    for name, node in nodes.items():
        st = wait_idle(node.address)
        assert all(r.kv_pages_used == 0 for r in st.ranks) and not any(st.queues.values()), (name, st)


@pytest.fixture
def make_router():
    """make(colocated=(..), prefill=(..), decode=(..), **config) -> a started Router, stopped after the test."""
    made: list[Router] = []

    def make(**config) -> Router:
        made.append(start_router(RouterConfig(port=0, http_port=0, health_retry_s=0.1, **config)))
        return made[-1]

    yield make
    for r in made:
        r.stop(grace_s=0)


def admin(router: Router) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(rpc.make_channel(f"127.0.0.1:{router.port}"))


def generation(router: Router) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}"))


def health(router: Router, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(rpc.make_channel(f"127.0.0.1:{router.port}"))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def request(n: int, ids: list[int] | None = None, rid: str = "") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        rid=rid,
        prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids or [5, 6, 7, 8])),
        sampling=common_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True),
    )


def tokens(router: Router, n: int = 2) -> int:
    """Tokens of one whole request through the router."""
    return sum(len(r.token_ids) for r in generation(router).Generate(request(n), timeout=60))


def served(*nodes) -> list[int]:
    return [status(n.address).requests_served for n in nodes]


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def post(router: Router, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{router.http_port}{path}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def healthy(router: Router, *addresses: str) -> bool:
    nodes = admin(router).ListNodes(admin_pb2.ListNodesRequest(), timeout=10).nodes
    return sum(n.healthy for n in nodes if n.address in addresses) == len(addresses)


# ---------------------------------------------------------------- the fleet at run time


def test_router_without_nodes_serves_once_nodes_are_added_and_routing_follows_removals(nodes, make_router):
    c1, c2 = nodes["c1"], nodes["c2"]
    r = make_router(routing="least_loaded")  # (cache_aware would send the same prompt to the node that cached it)
    stub = admin(r)
    assert (health(r, ""), health(r, "kvbridge.v1.Generation")) == (NOT_SERVING, NOT_SERVING)
    err = rpc_error(lambda: tokens(r))
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, "no healthy node can serve the request")

    added = stub.AddNode(admin_pb2.AddNodeRequest(role="colocated", address=c1.address), timeout=10)
    assert (added.role, added.address, added.outstanding, added.routed) == ("colocated", c1.address, 0, 0)
    assert wait_until(lambda: health(r, "") == SERVING)
    assert health(r, "kvbridge.v1.Generation") == SERVING
    before = served(c1, c2)
    assert [tokens(r) for _ in range(2)] == [2, 2]
    assert [a - b for a, b in zip(served(c1, c2), before)] == [2, 0]

    stub.AddNode(admin_pb2.AddNodeRequest(role="colocated", address=c2.address), timeout=10)
    assert wait_until(lambda: healthy(r, c2.address))
    before = served(c1, c2)
    assert [tokens(r) for _ in range(4)] == [2] * 4
    assert [a - b for a, b in zip(served(c1, c2), before)] == [2, 2]

    removed = stub.RemoveNode(admin_pb2.RemoveNodeRequest(address=c1.address), timeout=10)
    assert removed == admin_pb2.NodeInfo(
        role="colocated", address=c1.address, healthy=True, reported=True, outstanding=0, routed=4, model="tiny-random"
    )
    before = served(c1, c2)
    assert [tokens(r) for _ in range(3)] == [2] * 3
    assert [a - b for a, b in zip(served(c1, c2), before)] == [0, 3]

    stub.RemoveNode(admin_pb2.RemoveNodeRequest(address=c2.address, role="colocated"), timeout=10)
    assert stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=10).nodes == []
    assert (health(r, ""), health(r, "kvbridge.v1.Generation")) == (NOT_SERVING, NOT_SERVING)
    assert r.pool.outstanding() == {}


def test_half_a_prefill_decode_pair_serves_nothing_and_the_pair_shares_with_colocated(nodes, make_router):
    c1, p, d = nodes["c1"], nodes["p"], nodes["d"]
    r = make_router(prefill=(p.address,), routing="least_loaded")  # half a pair: a valid start, not serving
    assert wait_until(lambda: healthy(r, p.address))
    assert health(r, "kvbridge.v1.Generation") == NOT_SERVING
    stub = admin(r)
    stub.AddNode(admin_pb2.AddNodeRequest(role="decode", address=d.address), timeout=10)
    assert wait_until(lambda: health(r, "kvbridge.v1.Generation") == SERVING)
    stub.AddNode(admin_pb2.AddNodeRequest(role="colocated", address=c1.address), timeout=10)
    assert wait_until(lambda: healthy(r, c1.address))

    before = served(c1, p, d)
    assert [tokens(r) for _ in range(4)] == [2] * 4  # the decode node competes with the colocated one
    assert [a - b for a, b in zip(served(c1, p, d), before)] == [2, 2, 2]

    stub.RemoveNode(admin_pb2.RemoveNodeRequest(address=p.address), timeout=10)
    before = served(c1, p, d)
    assert [tokens(r) for _ in range(2)] == [2, 2]  # no prefill node: the decode node is not eligible
    assert [a - b for a, b in zip(served(c1, p, d), before)] == [2, 0, 0]
    listed = stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=10).nodes
    assert [(n.role, n.address, n.healthy, n.outstanding, n.routed, n.model) for n in listed] == [
        ("decode", d.address, True, 0, 2, "tiny-random"),
        ("colocated", c1.address, True, 0, 4, "tiny-random"),
    ]


def test_bad_node_changes_are_refused_naming_the_value(make_router):
    r = make_router(colocated=("127.0.0.1:1",), startup_wait_s=0)
    stub = admin(r)
    cases = [
        (admin_pb2.AddNodeRequest(role="router", address="127.0.0.1:2"), "role must be one of colocated, prefill, "
         "decode, got 'router'"),
        (admin_pb2.AddNodeRequest(role="decode", address="nohost"), "decode: expected HOST:PORT with a port in "
         "[1, 65535], got 'nohost'"),
        (admin_pb2.AddNodeRequest(role="colocated", address="127.0.0.1:1"), "a colocated node '127.0.0.1:1' is "
         "already in the pool"),
    ]  # fmt: skip
    for req, message in cases:
        err = rpc_error(lambda req=req: stub.AddNode(req, timeout=10))
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)

    stub.AddNode(admin_pb2.AddNodeRequest(role="decode", address="127.0.0.1:1"), timeout=10)  # another role: fine
    err = rpc_error(lambda: stub.RemoveNode(admin_pb2.RemoveNodeRequest(address="127.0.0.1:1"), timeout=10))
    assert (err.code(), err.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "'127.0.0.1:1' is in the pool as colocated and decode: say which role to remove",
    )
    err = rpc_error(lambda: stub.RemoveNode(admin_pb2.RemoveNodeRequest(address="127.0.0.1:3"), timeout=10))
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "no node '127.0.0.1:3' in the pool")
    err = rpc_error(
        lambda: stub.RemoveNode(admin_pb2.RemoveNodeRequest(address="127.0.0.1:1", role="prefill"), timeout=10)
    )
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "no prefill node '127.0.0.1:1' in the pool")
    removed = stub.RemoveNode(admin_pb2.RemoveNodeRequest(address="127.0.0.1:1", role="decode"), timeout=10)
    assert (removed.role, removed.address) == ("decode", "127.0.0.1:1")
    assert [(n.role, n.address) for n in stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=10).nodes] == [
        ("colocated", "127.0.0.1:1")
    ]


def test_a_10_kb_value_comes_back_cut_short_with_its_status(nodes, make_router):
    """A client's value in an error is shown cut short (common/shown.py), and every status and HTTP
    error message is clipped where it leaves (1 KiB): the client gets the status meant for it."""
    r = make_router(colocated=(nodes["c1"].address,))
    assert wait_until(lambda: healthy(r, nodes["c1"].address))
    big = "r" * 10_000
    chat = common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=big, content="hi")]))
    calls = {
        "AddNode": lambda: admin(r).AddNode(admin_pb2.AddNodeRequest(role=big, address="127.0.0.1:2"), timeout=10),
        "SetRole": lambda: admin(r).SetRole(admin_pb2.SetRoleRequest(role=big, node=nodes["c1"].address), timeout=10),
        "Generate": lambda: list(generation(r).Generate(generation_pb2.GenerateRequest(prompt=chat), timeout=10)),
    }
    for name, call in calls.items():
        err = rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.code())
        assert err.details().endswith(f"got '{'r' * 79}...(10002 chars)") and len(err.details()) < 200, name
    for path, body, want in [
        ("/v1/completions", {"model": "tiny-random", "prompt": "hi", "temperature": big}, 400),
        ("/v1/completions", {"model": big, "prompt": "hi"}, 404),  # (router/http.py: clipped by error_body)
        ("/tokenize", {"model": big, "prompt": "hi"}, 404),
    ]:
        got, answer = post(r, path, body)
        message = answer["error"]["message"]
        assert got == want and message.startswith(("temperature must", "model")) and len(message) <= 1100, (
            path, got, message[:200],
        )  # fmt: skip


# ---------------------------------------------------------------- drain and resume


def test_drain_refuses_new_requests_lets_the_one_in_flight_finish_and_resume_serves_again(nodes, make_router):
    r = make_router(colocated=(nodes["c1"].address,))
    stub = admin(r)
    call = generation(r).Generate(request(300), timeout=120)
    first = next(call)

    drained = stub.Drain(admin_pb2.DrainRequest(), timeout=10)
    assert drained == admin_pb2.DrainResponse(draining=True, requests_in_flight=1, empty=False)
    assert (health(r, ""), health(r, "kvbridge.v1.Generation")) == (NOT_SERVING, NOT_SERVING)
    st = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    assert (st.draining, st.serving, st.requests_in_flight) == (True, False, 1)
    err = rpc_error(lambda: tokens(r))
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, "the router is draining")
    error = {"message": "the router is draining", "type": "server_error", "param": None, "code": "unavailable"}
    assert post(r, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}) == (503, {"error": error})

    rest: list = []
    reader = threading.Thread(target=lambda: rest.extend(call))
    reader.start()
    drained = stub.Drain(admin_pb2.DrainRequest(wait_s=60), timeout=70)  # returns once the request ended
    assert drained == admin_pb2.DrainResponse(draining=True, requests_in_flight=0, empty=True)
    reader.join(timeout=10)
    assert sum(len(x.token_ids) for x in [first, *rest]) == 300 and rest[-1].finish_reason == "length"

    resumed = stub.Resume(admin_pb2.ResumeRequest(), timeout=10)
    assert resumed == admin_pb2.DrainResponse(draining=False, requests_in_flight=0, empty=False)
    assert (health(r, ""), health(r, "kvbridge.v1.Generation")) == (SERVING, SERVING)
    assert tokens(r) == 2
    status_, body = post(r, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
    assert (status_, body["usage"]["completion_tokens"]) == (200, 2)
    st = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    assert (st.draining, st.serving, st.requests_served) == (False, True, 5)  # 3 served, 2 refused


def test_drain_rejects_a_negative_wait(make_router):
    err = rpc_error(lambda: admin(make_router()).Drain(admin_pb2.DrainRequest(wait_s=-1), timeout=10))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "wait_s must be >= 0, got -1.0")


# ---------------------------------------------------------------- requests in flight


def test_a_request_in_flight_is_listed_and_an_operator_abort_ends_it_freeing_its_pages(nodes, make_router):
    c1 = nodes["c1"]
    r = make_router(colocated=(c1.address,))
    stub = admin(r)
    baseline = status(c1.address).ranks[0].kv_pages_used
    call = generation(r).Generate(request(3000, ids=list(range(5, 60)), rid="held-1"), timeout=120)
    next(call)
    next(call)
    assert status(c1.address).ranks[0].kv_pages_used > baseline

    listed = stub.ListRequests(admin_pb2.ListRequestsRequest(), timeout=10)
    assert (listed.total, listed.next_page_token, len(listed.requests)) == (1, "", 1)
    [info] = listed.requests
    assert (info.rid, info.room, info.phase, info.peer, info.prompt_tokens, info.kv_pages) == (
        "held-1", 0, "colocated", c1.address, 55, 0
    )  # fmt: skip
    assert 2 <= info.output_tokens < 3000 and 0 < info.age_s < 60

    aborted = stub.AbortRequest(admin_pb2.AbortRequestRequest(rid="held-1"), timeout=10)
    assert aborted == admin_pb2.AbortRequestResponse(rid="held-1", phase="colocated")
    err = rpc_error(lambda: list(call))
    assert (err.code(), err.details()) == (grpc.StatusCode.CANCELLED, OPERATOR_ABORTED)
    assert wait_until(lambda: status(c1.address).ranks[0].kv_pages_used == baseline)
    assert stub.ListRequests(admin_pb2.ListRequestsRequest(), timeout=10) == admin_pb2.ListRequestsResponse()

    err = rpc_error(lambda: stub.AbortRequest(admin_pb2.AbortRequestRequest(rid="held-1"), timeout=10))
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "no request 'held-1' in flight at the router")
    err = rpc_error(lambda: stub.AbortRequest(admin_pb2.AbortRequestRequest(), timeout=10))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "rid is required")


def test_disaggregated_requests_are_listed_oldest_first_a_page_at_a_time(nodes, make_router):
    p, d = nodes["p"], nodes["d"]
    r = make_router(prefill=(p.address,), decode=(d.address,))
    stub = admin(r)
    calls = []
    for i in range(3):
        calls.append(generation(r).Generate(request(1000, ids=[5 + i] * (10 + i), rid=f"pd-{i}"), timeout=120))
        next(calls[-1])  # in flight, in this order

    page = stub.ListRequests(admin_pb2.ListRequestsRequest(page_size=2), timeout=10)
    assert ([q.rid for q in page.requests], page.next_page_token, page.total) == (["pd-0", "pd-1"], "2", 3)
    last = stub.ListRequests(admin_pb2.ListRequestsRequest(page_size=2, page_token="2"), timeout=10)
    assert ([q.rid for q in last.requests], last.next_page_token, last.total) == (["pd-2"], "", 3)
    everything = page.requests[:] + last.requests[:]
    assert [(q.phase, q.peer, q.prompt_tokens) for q in everything] == [
        ("prefill+decode", f"{p.address} -> {d.address}", 10 + i) for i in range(3)
    ]
    assert all(0 < q.room < 2**63 for q in everything) and len({q.room for q in everything}) == 3
    by_phase = stub.ListRequests(admin_pb2.ListRequestsRequest(phase="prefill+decode"), timeout=10)
    assert [q.rid for q in by_phase.requests] == ["pd-0", "pd-1", "pd-2"]
    ages = [q.age_s for q in by_phase.requests]  # (one listing: ages from two calls differ by the gap)
    assert ages == sorted(ages, reverse=True)
    assert stub.ListRequests(admin_pb2.ListRequestsRequest(phase="colocated"), timeout=10).total == 0

    bad = [
        (admin_pb2.ListRequestsRequest(page_size=1001), "page_size must be at most 1000, got 1001"),
        (admin_pb2.ListRequestsRequest(page_token="x2"), "page_token 'x2' is not one we issued"),
        (admin_pb2.ListRequestsRequest(phase="decoding"), "phase must be one of routing, colocated, "
         "prefill+decode, local_prefill (or empty), got 'decoding'"),
    ]  # fmt: skip
    for req, message in bad:
        err = rpc_error(lambda req=req: stub.ListRequests(req, timeout=10))
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)

    for i, call in enumerate(calls):
        assert stub.AbortRequest(admin_pb2.AbortRequestRequest(rid=f"pd-{i}"), timeout=10).phase == "prefill+decode"
        err = rpc_error(lambda call=call: list(call))
        assert (err.code(), err.details()) == (grpc.StatusCode.CANCELLED, OPERATOR_ABORTED)
    # nodes_end_idle: both halves freed their pages


def test_a_rid_already_in_flight_is_refused(nodes, make_router):
    r = make_router(colocated=(nodes["c1"].address,))
    call = generation(r).Generate(request(3000, rid="twice"), timeout=120)
    next(call)
    err = rpc_error(lambda: list(generation(r).Generate(request(2, rid="twice"), timeout=30)))
    assert (err.code(), err.details()) == (grpc.StatusCode.ALREADY_EXISTS, "a request with rid 'twice' is in flight")
    call.cancel()


# ---------------------------------------------------------------- status and config


def test_status_and_config_describe_the_router_and_its_fleet(nodes, make_router):
    c1 = nodes["c1"]
    r = make_router(colocated=(c1.address,), request_timeout_s=30.0)
    assert tokens(r) == 2
    st = admin(r).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    fingerprint = (
        generation_pb2_grpc.GenerationStub(rpc.make_channel(c1.address))
        .GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        .fingerprint
    )
    node = admin_pb2.NodeInfo(
        role="colocated", address=c1.address, healthy=True, reported=True, outstanding=0, routed=1, model="tiny-random"
    )
    assert 0 < st.uptime_s < 60
    st.uptime_s = 0
    assert st == admin_pb2.Status(
        role="router",
        model="tiny-random",
        model_fingerprint=fingerprint,
        queues={"routed": 0, f"colocated/{c1.address}": 0},
        requests_served=1,
        version=__version__,
        serving=True,
        nodes=[node],
    )

    config = admin(r).GetConfig(admin_pb2.GetConfigRequest(), timeout=10)
    assert (config.role, config.version) == ("router", __version__)
    assert json.loads(config.json) == {
        "host": "127.0.0.1",
        "port": 0,
        "http_port": 0,
        "colocated": [c1.address],
        "prefill": [],
        "decode": [],
        "discover": [],
        "discover_interval_s": 10.0,
        "request_timeout_s": 30.0,
        "max_attempts": 3,
        "max_migrations": 3,
        "retry_backoff_s": 0.05,
        "first_token_timeout_s": 300.0,
        "idle_stream_timeout_s": 30.0,
        "health_retry_s": 0.1,
        "startup_wait_s": 5.0,
        "metrics_port": -1,
        "max_concurrent_requests": 4096,
        "max_body_bytes": 4 << 20,
        "max_answer_bytes": 16 << 20,
        "http_header_timeout_s": 10.0,
        "http_body_timeout_s": 30.0,
        "http_keep_alive_s": 5.0,
        "routing": "cache_aware",
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "local_prefill_max_tokens": 512,
        "local_prefill_ratio": 4.0,
        "client_cert_reqs": "required",
        "admin_port": -1,
        "planner": "off",
        "slo_ttft_ms": 500.0,
        "slo_itl_ms": 50.0,
        "planner_interval_s": 5.0,
        "planner_patience": 2,
        "planner_min_dwell_s": 30.0,
        "planner_migrate": False,
        "nodes": [{"role": "colocated", "address": c1.address}],
    }
