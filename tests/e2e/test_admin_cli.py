"""`kvbridge admin`: the renderers on real Admin messages, argument and gRPC errors as one line,
the calls a fake Admin server receives, and `status` against a real colocated node."""

from __future__ import annotations

import json
import socket

import grpc
import pytest

import kvbridge
from kvbridge import admin_cli
from kvbridge.cli import main
from kvbridge.common import rpc
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import admin_pb2, admin_pb2_grpc

COLOCATED = admin_pb2.Status(
    role="colocated",
    model="tiny-random",
    model_fingerprint="abc123",
    pp_size=2,
    version="0.1.0",
    uptime_s=3725.0,
    serving=True,
    requests_in_flight=3,
    requests_served=17,
    queues={"waiting": 1, "running": 2},
    ranks=[
        admin_pb2.RankStatus(rank=0, alive=True, kv_pages_used=12, kv_pages_total=2048),
        admin_pb2.RankStatus(rank=1, alive=False, kv_pages_used=12, kv_pages_total=2048),
    ],
    prefix_cache=admin_pb2.PrefixCacheStatus(
        enabled=True, cached_pages=10, idle_pages=4, hit_tokens=30, query_tokens=120, evicted_pages=2
    ),
)

ROUTER = admin_pb2.Status(
    role="router",
    version="0.1.0",
    uptime_s=42.0,
    serving=True,
    requests_in_flight=2,
    requests_served=40,
    nodes=[
        admin_pb2.NodeInfo(
            role="prefill", address="127.0.0.1:50061", healthy=True, reported=True, outstanding=1, routed=20
        ),
        admin_pb2.NodeInfo(
            role="decode",
            address="127.0.0.1:50062",
            reported=True,
            outstanding=1,
            routed=20,
            model="tiny-random",
        ),
        admin_pb2.NodeInfo(role="colocated", address="10.0.0.7:50070"),
    ],
)

REQUESTS = admin_pb2.ListRequestsResponse(
    requests=[
        admin_pb2.RequestInfo(
            rid="r1",
            room=2**63 - 5,
            phase="transferring",
            age_s=1.5,
            kv_pages=8,
            peer="127.0.0.1:50062",
            prompt_tokens=30,
            output_tokens=1,
            backend="shm",
            kv_pages_moved=8,
            kv_bytes_moved=98304,
            handoff_s=0.0123,
        ),
        admin_pb2.RequestInfo(rid="r2", phase="waiting", age_s=75.0, prompt_tokens=5),
    ],
    next_page_token="2",
    total=5,
)


# ---------------------------------------------------------------------- pure renderers


def test_status_of_a_node():
    assert admin_cli.render_status(COLOCATED).splitlines() == [
        "role         colocated",
        "model        tiny-random",
        "fingerprint  abc123",
        "version      0.1.0",
        "pp size      2",
        "uptime       1h 02m",
        "serving      yes",
        "draining     no",
        "requests     3 in flight, 17 served",
        "transfers    0 in flight",
        "cache        10 pages (4 idle), hit 30 of 120 prompt tokens (25%), 2 evicted",
        "",
        "QUEUE    REQUESTS",
        "running  2",
        "waiting  1",
        "",
        "RANK  ALIVE  KV PAGES USED  KV PAGES TOTAL",
        "0     yes    12             2048",
        "1     no     12             2048",
    ]
    assert admin_cli.status_dict(COLOCATED) == {
        "role": "colocated",
        "model_fingerprint": "abc123",
        "pp_size": 2,
        "ranks": [
            {"rank": 0, "alive": True, "kv_pages_used": 12, "kv_pages_total": 2048},
            {"rank": 1, "alive": False, "kv_pages_used": 12, "kv_pages_total": 2048},
        ],
        "queues": {"running": 2, "waiting": 1},
        "requests_served": 17,
        "version": "0.1.0",
        "uptime_s": 3725.0,
        "draining": False,
        "transfers_in_flight": 0,
        "requests_in_flight": 3,
        "model": "tiny-random",
        "serving": True,
        "nodes": [],
        "prefix_cache": {
            "enabled": True,
            "cached_pages": 10,
            "idle_pages": 4,
            "hit_tokens": 30,
            "query_tokens": 120,
            "evicted_pages": 2,
        },
        "elastic": False,
        "role_epoch": 0,
        "switching_to": "",
        "planner_moves": [],
    }


def test_status_of_the_router_lists_its_nodes():
    assert admin_cli.render_status(ROUTER).splitlines() == [
        "role         router",
        "model        -",
        "fingerprint  -",
        "version      0.1.0",
        "uptime       42.0s",
        "serving      yes",
        "draining     no",
        "requests     2 in flight, 40 served",
        "transfers    0 in flight",
        "",
        "ROLE       ADDRESS          HEALTHY  OUTSTANDING  ROUTED  MODEL",
        "prefill    127.0.0.1:50061  yes      1            20      -",
        "decode     127.0.0.1:50062  no       1            20      tiny-random",
        "colocated  10.0.0.7:50070   unknown  0            0       -",
    ]
    st = admin_cli.status_dict(ROUTER)
    assert (st["role"], st["queues"], st["ranks"]) == ("router", {}, [])
    assert st["nodes"][1] == {
        "role": "decode",
        "address": "127.0.0.1:50062",
        "healthy": False,
        "reported": True,
        "outstanding": 1,
        "routed": 20,
        "model": "tiny-random",
        "elastic": False,
        "role_epoch": 0,
        "switching_to": "",
    }


def test_requests_table_and_json():
    assert admin_cli.render_requests(REQUESTS).splitlines() == [
        "RID  ROOM                 PHASE         AGE     PAGES  PEER             TOKENS  HANDOFF",
        "r1   9223372036854775803  transferring  1.5s    8      127.0.0.1:50062  30+1    8p 0.10MB shm 12.3ms",
        "r2   -                    waiting       1m 15s  0      -                5+0     -",
        "2 of 5 requests (--all for every page)",
    ]
    assert admin_cli.requests_dict(REQUESTS) == {
        "requests": [
            {
                "rid": "r1",
                "room": 9223372036854775803,  # a number, not json_format's string
                "phase": "transferring",
                "age_s": 1.5,
                "kv_pages": 8,
                "peer": "127.0.0.1:50062",
                "prompt_tokens": 30,
                "output_tokens": 1,
                "backend": "shm",
                "kv_pages_moved": 8,
                "kv_bytes_moved": 98304,
                "handoff_s": 0.0123,
            },
            {
                "rid": "r2",
                "room": 0,
                "phase": "waiting",
                "age_s": 75.0,
                "kv_pages": 0,
                "peer": "",
                "prompt_tokens": 5,
                "output_tokens": 0,
                "backend": "",
                "kv_pages_moved": 0,
                "kv_bytes_moved": 0,
                "handoff_s": 0.0,
            },
        ],
        "next_page_token": "2",
        "total": 5,
    }
    assert admin_cli.render_requests(admin_pb2.ListRequestsResponse()).splitlines() == [
        "RID  ROOM  PHASE  AGE  PAGES  PEER  TOKENS  HANDOFF",
        "0 of 0 requests",
    ]


def test_one_line_results():
    assert admin_cli.render_abort(admin_pb2.AbortRequestResponse(rid="r1", phase="decoding")) == (
        "aborted r1 (was decoding)"
    )
    assert admin_cli.render_drain(admin_pb2.DrainResponse(draining=True, requests_in_flight=4)) == (
        "draining: 4 requests in flight"
    )
    assert admin_cli.render_drain(admin_pb2.DrainResponse(draining=True, empty=True)) == (
        "draining: 0 requests in flight; empty, safe to stop"
    )
    assert admin_cli.render_drain(admin_pb2.DrainResponse(requests_in_flight=1)) == "serving: 1 requests in flight"
    node = admin_pb2.NodeInfo(role="decode", address="127.0.0.1:50062")
    assert admin_cli.render_node_change("added", node) == "added decode node 127.0.0.1:50062"
    cfg = admin_pb2.Config(role="prefill", version="0.1.0", json='{"page_size": 16, "model": "tiny-random"}')
    assert admin_cli.render_config(cfg) == '{\n  "model": "tiny-random",\n  "page_size": 16\n}'
    assert admin_cli.config_dict(cfg) == {
        "role": "prefill",
        "version": "0.1.0",
        "config": {"page_size": 16, "model": "tiny-random"},
    }


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.04, "0.0s"), (59.94, "59.9s"), (60, "1m 00s"), (3599, "59m 59s"), (3600, "1h 00m"), (90061, "1d 01h")],
)
def test_duration(seconds, text):
    assert admin_cli.duration(seconds) == text


# ---------------------------------------------------------------------- the command


def admin(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["admin", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("target", ["nohost", "127.0.0.1", "host:", ":50051", "host:0", "host:65536", "host:http"])
def test_bad_target_is_one_line_naming_it_and_exit_2(capsys, target):
    assert admin(capsys, "status", "--target", target) == (
        2,
        "",
        f"kvbridge admin: error: --target must be HOST:PORT, got {target!r}\n",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "--timeout", "0"], "--timeout must be a number of seconds > 0, got '0'"),
        (["status", "--timeout", "soon"], "--timeout must be a number of seconds > 0, got 'soon'"),
        (["drain", "--wait", "-1"], "--wait must be a number of seconds >= 0, got '-1'"),
        (["requests", "--limit", "0"], "--limit must be an integer in [1, 1000], got '0'"),
        (["requests", "--limit", "1001"], "--limit must be an integer in [1, 1000], got '1001'"),
        (["nodes", "add", "router", "127.0.0.1:5"], "ROLE must be one of colocated, prefill, decode, got 'router'"),
        (["nodes", "add", "decode", "nowhere"], "ADDR must be HOST:PORT, got 'nowhere'"),
        (["nodes", "remove"], "nodes takes list, add ROLE ADDR or remove ADDR, got 'remove'"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(capsys, args, message):
    # the target listens nowhere: every value is checked before anything is sent
    assert admin(capsys, *args, "--target", "127.0.0.1:9") == (2, "", f"kvbridge admin: error: {message}\n")


def test_unreachable_target_is_one_line_and_exit_1(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
    code, out, err = admin(capsys, "status", "--target", target)
    assert (code, out) == (1, "")
    assert err.startswith("kvbridge admin: error: UNAVAILABLE: ") and err.endswith(f" (target {target})\n")
    assert err.count("\n") == 1


PAGES = {"": (["a", "b"], "p2"), "p2": (["c", "d"], "p3"), "p3": (["e"], "")}  # page token: (rids, next token)


class FakeAdmin(admin_pb2_grpc.AdminServicer):
    """Records what it is asked; requests come in pages a,b | c,d | e."""

    def __init__(self):
        self.calls: list = []

    def ListRequests(self, request, context):
        self.calls.append(request)
        rids, next_token = PAGES[request.page_token]
        infos = [admin_pb2.RequestInfo(rid=rid, phase=request.phase or "decoding") for rid in rids]
        return admin_pb2.ListRequestsResponse(requests=infos, next_page_token=next_token, total=5)

    def AbortRequest(self, request, context):
        if request.rid != "a":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.rid!r}\non this node")
        return admin_pb2.AbortRequestResponse(rid=request.rid, phase="decoding")

    def Drain(self, request, context):
        self.calls.append((request.wait_s, context.time_remaining()))
        return admin_pb2.DrainResponse(draining=True, empty=True)

    def AddNode(self, request, context):
        self.calls.append(request)
        return admin_pb2.NodeInfo(role=request.role, address=request.address)

    def RemoveNode(self, request, context):
        self.calls.append(request)
        return admin_pb2.NodeInfo(role="decode", address=request.address)


@pytest.fixture(scope="module")
def fake():
    servicer = FakeAdmin()
    server, port, _ = rpc.make_server(
        "127.0.0.1", 0, [(admin_pb2_grpc.add_AdminServicer_to_server, servicer)], ["kvbridge.v1.Admin"]
    )
    server.start()
    servicer.target = f"127.0.0.1:{port}"
    yield servicer
    server.stop(0)


def test_requests_all_follows_every_page(capsys, fake):
    fake.calls.clear()
    code, out, _ = admin(
        capsys, "requests", "--all", "--limit", "2", "--phase", "waiting", "--json", "--target", fake.target
    )
    assert code == 0
    assert [(c.page_size, c.page_token, c.phase) for c in fake.calls] == [
        (2, "", "waiting"),
        (2, "p2", "waiting"),
        (2, "p3", "waiting"),
    ]
    result = json.loads(out)
    assert [r["rid"] for r in result["requests"]] == ["a", "b", "c", "d", "e"]
    assert (result["total"], result["next_page_token"]) == (5, "")


def test_requests_without_all_shows_the_first_page(capsys, fake):
    code, out, _ = admin(capsys, "requests", "--target", fake.target)
    assert code == 0
    assert out.splitlines()[-1] == "2 of 5 requests (--all for every page)"


def test_abort_prints_the_phase_and_server_errors_are_one_line(capsys, fake):
    assert admin(capsys, "abort", "a", "--target", fake.target) == (0, "aborted a (was decoding)\n", "")
    assert admin(capsys, "abort", "zz", "--target", fake.target) == (
        1,
        "",
        f"kvbridge admin: error: NOT_FOUND: no request 'zz' on this node (target {fake.target})\n",
    )
    assert admin(capsys, "config", "--target", fake.target) == (
        1,
        "",
        f"kvbridge admin: error: UNIMPLEMENTED: Method not implemented! (target {fake.target})\n",
    )


def test_drain_wait_extends_the_deadline(capsys, fake):
    fake.calls.clear()
    code, out, _ = admin(capsys, "drain", "--wait", "5", "--timeout", "10", "--json", "--target", fake.target)
    assert (code, json.loads(out)) == (0, {"draining": True, "requests_in_flight": 0, "empty": True})
    [(wait_s, remaining)] = fake.calls
    # --timeout plus --wait: more than --timeout alone once the call's way here is taken off (seconds on a
    # loaded host), at most 15 s (gRPC rounds the deadline up a little)
    assert wait_s == 5.0 and 10 < remaining < 16


def test_nodes_add_and_remove(capsys, fake):
    fake.calls.clear()
    assert admin(capsys, "nodes", "add", "prefill", "127.0.0.1:50061", "--target", fake.target) == (
        0,
        "added prefill node 127.0.0.1:50061\n",
        "",
    )
    assert admin(capsys, "nodes", "remove", "127.0.0.1:50062", "--role", "decode", "--target", fake.target) == (
        0,
        "removed decode node 127.0.0.1:50062\n",
        "",
    )
    assert [(c.role, c.address) for c in fake.calls] == [("prefill", "127.0.0.1:50061"), ("decode", "127.0.0.1:50062")]


# ---------------------------------------------------------------------- a real node


@pytest.fixture(scope="module")
def node():
    serving = start_node(
        "colocated", NodeConfig(EngineConfig(model="tiny-random", page_size=4, kv_cache_tokens=8192), PPConfig())
    )
    yield serving
    serving.stop()


def test_status_of_a_real_colocated_node(capsys, node, tiny_model):
    code, out, err = admin(capsys, "status", "--json", "--target", node.address)
    assert (code, err) == (0, "")
    [line] = out.splitlines()  # one JSON object
    st = json.loads(line)
    assert set(st) == {f.name for f in admin_pb2.Status.DESCRIPTOR.fields}
    assert (st["role"], st["model"], st["pp_size"], st["version"]) == (
        "colocated",
        "tiny-random",
        1,
        kvbridge.__version__,
    )
    assert st["model_fingerprint"] == tiny_model.fingerprint
    assert st["ranks"] == [{"rank": 0, "alive": True, "kv_pages_used": 0, "kv_pages_total": 2048}]
    assert {"running", "waiting"} <= set(st["queues"]) and set(st["queues"].values()) == {0}
    assert (st["requests_served"], st["requests_in_flight"], st["serving"], st["draining"]) == (0, 0, True, False)
    assert st["nodes"] == [] and st["uptime_s"] > 0

    code, out, _ = admin(capsys, "status", "--target", node.address)
    lines = out.splitlines()
    assert code == 0 and lines[0] == "role         colocated" and lines[1] == "model        tiny-random"
    assert lines[-2:] == ["RANK  ALIVE  KV PAGES USED  KV PAGES TOTAL", "0     yes    0              2048"]
    assert "cache        0 pages (0 idle), hit 0 of 0 prompt tokens, 0 evicted" in lines
    assert admin(capsys, "clear-cache", "--target", node.address) == (0, "dropped 0 cached pages\n", "")
    code, out, _ = admin(capsys, "clear-cache", "--json", "--target", node.address)
    assert (code, json.loads(out)) == (0, {"pages_dropped": 0})


def test_set_role_and_an_elastic_node_and_the_planner_moves_render():
    moved = admin_pb2.SetRoleResponse(old_role="decode", role="prefill", role_epoch=3, drain_s=1.25, switch_s=1.5,
                                      node="10.0.0.2:50051")  # fmt: skip
    assert admin_cli.render_set_role(moved) == (
        "10.0.0.2:50051: decode -> prefill (switch 3) in 1.500 s, 1.250 s of it waiting for its requests to end"
    )
    same = admin_pb2.SetRoleResponse(old_role="decode", role="decode", node="10.0.0.2:50051")
    assert admin_cli.render_set_role(same) == "10.0.0.2:50051 is a decode node already"
    st = admin_pb2.Status(role="decode", elastic=True, role_epoch=2, switching_to="prefill")
    assert "elastic      yes, 2 switches, switching to prefill" in admin_cli.render_status(st).splitlines()
    router = admin_pb2.Status(role="router", planner_moves=["a:1 decode -> prefill (ttft ...) in 2.0 s"])
    assert admin_cli.render_status(router).endswith("PLANNER MOVES\na:1 decode -> prefill (ttft ...) in 2.0 s")
