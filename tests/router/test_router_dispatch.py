"""The router against in-test nodes that follow the contract: pairing of prefill and decode
halves, failure propagation both ways, retries, health, deadlines, cancellation, status, requests
listed and aborted through Admin."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.security import message_proof_ok
from kvbridge.v1 import admin_pb2, admin_pb2_grpc
from tests.router.fakes import generate, make_request, router_stub, wait_until


def test_disaggregated_request_pairs_prefill_and_decode_by_room(fleet):
    router, nodes = fleet(prefill=1, decode=1)
    [p], [d] = nodes["prefill"], nodes["decode"]
    responses = generate(router)
    assert [t for r in responses for t in r.token_ids] == [100, 101, 102, 103]
    [dreq], [preq] = d.requests, p.requests
    assert dreq.prefill.prefill_addr == p.address
    assert preq.room == dreq.prefill.room and 0 <= preq.room < 2**63
    assert message_proof_ok(rpc.security().fleet(), dreq.prefill)  # the route is the fleet's: D trusts it
    assert preq.rid == dreq.rid and len(preq.rid) == 32
    assert list(preq.prompt.token_ids.ids) == [1, 2, 3]


def test_rooms_and_rids_are_fresh_per_request(fleet):
    router, nodes = fleet(prefill=1, decode=1)
    for _ in range(5):
        generate(router)
    rooms = [r.room for r in nodes["prefill"][0].requests]
    rids = [r.rid for r in nodes["decode"][0].requests]
    assert len(set(rooms)) == 5 and len(set(rids)) == 5


def test_prefill_failure_cancels_decode_and_the_client_gets_its_status(fleet):
    router, nodes = fleet(prefill=1, decode=1)
    [p], [d] = nodes["prefill"], nodes["decode"]
    p.fail = grpc.StatusCode.FAILED_PRECONDITION
    p.hold = threading.Event()  # P fails once D is waiting for the room
    threading.Thread(target=lambda: wait_until(lambda: d.requests) and p.hold.set(), daemon=True).start()
    with pytest.raises(grpc.RpcError) as err:
        generate(router)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{p.address} fails as told" in err.value.details() and f"prefill/{p.address}" in err.value.details()
    rid = d.requests[0].rid
    assert wait_until(lambda: rid in d.cancelled)  # the decode half was cancelled, not left waiting


def test_decode_failure_cancels_prefill(fleet):
    router, nodes = fleet(prefill=1, decode=1, first_s=0.5)  # D fails 0.5 s in, while P is busy with it
    [p], [d] = nodes["prefill"], nodes["decode"]
    p.hold = threading.Event()
    d.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as err:
        generate(router)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    rid = d.requests[0].rid
    assert [r.rid for r in p.requests] == [rid]
    assert wait_until(lambda: rid in p.cancelled)


def test_equal_nodes_share_requests_round_robin(fleet):
    router, nodes = fleet(colocated=2)
    for _ in range(6):
        generate(router)
    assert [len(n.requests) for n in nodes["colocated"]] == [3, 3]


def test_least_outstanding_node_gets_the_next_request(fleet):
    router, nodes = fleet(colocated=2, tokens=5000, token_s=0.01)
    stub = router_stub(router)
    long_call = stub.Generate(make_request(), timeout=30)
    next(long_call)  # one node is busy with it now (50 s: until it is cancelled below)
    busy = next(n for n in nodes["colocated"] if n.requests)
    for _ in range(3):
        list(stub.Generate(make_request(max_new_tokens=1), timeout=30))
    idle = next(n for n in nodes["colocated"] if n is not busy)
    assert (len(busy.requests), len(idle.requests)) == (1, 3)
    status = admin_pb2_grpc.AdminStub(rpc.make_channel(f"127.0.0.1:{router.port}")).GetStatus(
        admin_pb2.GetStatusRequest(), timeout=5
    )
    assert status.role == "router"
    assert status.queues == {"routed": 1, f"colocated/{busy.address}": 1, f"colocated/{idle.address}": 0}
    long_call.cancel()


def test_not_serving_node_is_skipped_until_it_serves_again(fleet):
    router, nodes = fleet(colocated=2)
    a, b = nodes["colocated"]
    a.set_serving(False)
    assert wait_until(lambda: not router.pool.nodes[0].healthy)
    for _ in range(4):
        generate(router)
    assert (len(a.requests), len(b.requests)) == (0, 4)
    a.set_serving(True)
    assert wait_until(lambda: router.pool.nodes[0].healthy)
    for _ in range(4):
        generate(router)
    assert len(a.requests) == 2


def test_unavailable_node_is_retried_elsewhere_before_any_token(fleet):
    router, nodes = fleet(colocated=2)
    a, b = nodes["colocated"]
    a.fail = grpc.StatusCode.UNAVAILABLE
    for _ in range(4):
        assert len(generate(router)) == 5
    assert len(b.requests) == 4 and len(a.requests) >= 1


def test_unavailable_prefill_node_is_retried_with_a_fresh_room(fleet):
    router, nodes = fleet(prefill=2, decode=1)
    bad, good = nodes["prefill"]
    [d] = nodes["decode"]
    bad.fail = grpc.StatusCode.UNAVAILABLE
    for _ in range(3):
        assert len(generate(router)) == 5
    assert len(good.requests) == 3 and len(bad.requests) >= 1
    rooms = [r.room for r in bad.requests + good.requests]
    assert len(set(rooms)) == len(rooms)  # every attempt pairs anew
    assert {r.room for r in good.requests} <= {r.prefill.room for r in d.requests}
    assert wait_until(lambda: set(router.pool.outstanding().values()) == {0})


def test_decode_nodes_compete_with_colocated_nodes(fleet):
    router, nodes = fleet(colocated=1, prefill=1, decode=1)
    for _ in range(4):
        generate(router)
    assert [len(nodes[role][0].requests) for role in ("colocated", "prefill", "decode")] == [2, 2, 2]
    nodes["prefill"][0].set_serving(False)  # no prefill node: decode nodes cannot serve alone
    assert wait_until(lambda: not router.pool.has_eligible("prefill"))
    for _ in range(2):
        generate(router)
    assert len(nodes["colocated"][0].requests) == 4


def test_all_nodes_down_gives_unavailable(fleet):
    router, nodes = fleet(colocated=1)
    nodes["colocated"][0].stop()
    assert wait_until(lambda: not router.pool.nodes[0].healthy)
    with pytest.raises(grpc.RpcError) as err:
        generate(router)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_upstream_deadline_comes_from_the_flag(fleet):
    router, _ = fleet(colocated=1, tokens=100, token_s=0.05, timeout_s=0.5)
    with pytest.raises(grpc.RpcError) as err:
        generate(router)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("first_s", [0.0, 60.0])  # cancelled while streaming / while waiting for a first token
def test_grpc_client_cancel_cancels_upstream(fleet, first_s):
    router, nodes = fleet(colocated=1, tokens=5000, token_s=0.01, first_s=first_s)
    [node] = nodes["colocated"]
    call = router_stub(router).Generate(make_request(), timeout=120)
    if first_s:
        assert wait_until(lambda: node.requests)
    else:
        next(call)
    call.cancel()
    rid = node.requests[0].rid
    assert wait_until(lambda: rid in node.cancelled, timeout=5)
    assert wait_until(lambda: router.pool.outstanding() == {f"colocated/{node.address}": 0})


def test_http_client_disconnect_cancels_both_halves(fleet):
    router, nodes = fleet(prefill=1, decode=1, tokens=5000, token_s=0.01)
    [d] = nodes["decode"]
    body = json.dumps({"prompt": [1, 2, 3], "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{router.http_port}/v1/completions", data=body)
    resp = urllib.request.urlopen(req, timeout=30)
    assert resp.readline().startswith(b"data: ")
    resp.close()
    rid = d.requests[0].rid
    assert wait_until(lambda: rid in d.cancelled)
    assert wait_until(lambda: set(router.pool.outstanding().values()) == {0})


def test_http_client_gone_while_waiting_for_the_first_token_cancels_upstream(fleet):
    router, nodes = fleet(colocated=1, first_s=60.0)
    [node] = nodes["colocated"]
    body = json.dumps({"prompt": [1, 2, 3]}).encode()
    sock = socket.create_connection(("127.0.0.1", router.http_port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    assert wait_until(lambda: node.requests)
    sock.close()
    rid = node.requests[0].rid
    assert wait_until(lambda: rid in node.cancelled, timeout=5)


def http(router, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{router.http_port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_node_errors_map_to_http_statuses(fleet, code, status):
    router, nodes = fleet(colocated=1)
    nodes["colocated"][0].fail = code
    got, body = http(router, "POST", "/v1/completions", {"prompt": [1], "stream": True})
    assert got == status
    assert body["error"]["code"] == code.name.lower() and "fails as told" in body["error"]["message"]


def test_no_healthy_node_is_503_and_health_says_so(fleet):
    router, nodes = fleet(colocated=1)
    assert http(router, "GET", "/health") == (200, {"status": "ok"})
    nodes["colocated"][0].set_serving(False)
    assert wait_until(lambda: not router.pool.nodes[0].healthy)
    status, body = http(router, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 503 and body["error"]["code"] == "unavailable"
    assert http(router, "GET", "/health")[0] == 503


def test_models_and_unknown_routes(fleet):
    router, _ = fleet(colocated=1)
    status, body = http(router, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["fake"] and body["data"][0]["max_model_len"] == 64
    assert http(router, "GET", "/v1/models/fake")[1]["id"] == "fake"
    assert http(router, "GET", "/v1/models/other")[0] == 404
    assert http(router, "GET", "/v2/nothing")[0] == 404
    assert http(router, "POST", "/v1/embeddings", {"input": "x"})[0] == 404
    status, body = http(router, "POST", "/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["param"] == "model"


def test_failure_mid_stream_ends_the_sse_stream_with_an_error_event(fleet):
    router, nodes = fleet(colocated=2)
    for node in nodes["colocated"]:
        node.fail, node.fail_after = grpc.StatusCode.UNAVAILABLE, 2  # moved to the other node, which fails too
    body = json.dumps({"prompt": [1, 2, 3], "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{router.http_port}/v1/completions", data=body)
    with urllib.request.urlopen(req, timeout=30) as resp:
        events = [line[6:] for line in resp.read().decode().split("\n\n") if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0 ", "t1 "]
    error = json.loads(events[2])["error"]
    assert error["code"] == "unavailable" and "after 2 tokens, not migrated" in error["message"]
    assert events[3:] == ["[DONE]"]
    assert [len(n.requests) for n in nodes["colocated"]] == [1, 1]


def router_admin(router) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(rpc.make_channel(f"127.0.0.1:{router.port}"))


def test_a_request_held_in_prefill_is_listed_with_its_pair_and_an_abort_cancels_both_halves(fleet):
    router, nodes = fleet(prefill=1, decode=1)
    [p], [d] = nodes["prefill"], nodes["decode"]
    p.hold = threading.Event()  # never set: the request stays in prefill until aborted
    call = router_stub(router).Generate(make_request(), timeout=30)
    assert wait_until(lambda: p.requests and d.requests)
    [preq] = p.requests
    [info] = router_admin(router).ListRequests(admin_pb2.ListRequestsRequest(), timeout=5).requests
    # (a router without an admin key lists a room's low 24 bits only)
    assert (info.rid, info.room, info.phase, info.peer, info.prompt_tokens, info.output_tokens) == (
        preq.rid, preq.room & 0xFFFFFF, "prefill+decode", f"{p.address} -> {d.address}", 3, 0
    )  # fmt: skip
    aborted = router_admin(router).AbortRequest(admin_pb2.AbortRequestRequest(rid=preq.rid), timeout=5)
    assert (aborted.rid, aborted.phase) == (preq.rid, "prefill+decode")
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED and "an operator aborted" in err.value.details()
    assert wait_until(lambda: preq.rid in p.cancelled and preq.rid in d.cancelled)
    assert wait_until(lambda: set(router.pool.outstanding().values()) == {0})


def test_an_http_request_aborted_by_an_operator_gets_499_saying_so(fleet):
    router, nodes = fleet(colocated=1, first_s=60.0)
    result = []
    thread = threading.Thread(target=lambda: result.append(http(router, "POST", "/v1/completions", {"prompt": [1]})))
    thread.start()
    assert wait_until(lambda: nodes["colocated"][0].requests)
    [info] = router_admin(router).ListRequests(admin_pb2.ListRequestsRequest(), timeout=5).requests
    router_admin(router).AbortRequest(admin_pb2.AbortRequestRequest(rid=info.rid), timeout=5)
    thread.join(timeout=10)
    message = "an operator aborted the request (Admin.AbortRequest on the router)"
    error = {"message": message, "type": "server_error", "param": None, "code": "cancelled"}
    assert result == [(499, {"error": error})]
