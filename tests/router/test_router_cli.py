"""`kvbridge router` as an operator runs it: a real process, one ready line, one-line errors."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import urllib.request

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.logs import parse_line
from kvbridge.v1 import common_pb2, generation_pb2_grpc
from tests.router.fakes import FakeNode, Rooms, make_request


def router_process(*flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "router", *flags], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_router_prints_its_ports_serves_logs_each_phase_and_stops_on_sigterm():
    node = FakeNode("colocated", Rooms())
    proc = router_process("--colocated", node.address, "--port", "0", "--http-port", "0", "--metrics-port", "0")
    try:
        line = proc.stderr.readline()
        assert line.startswith("kvbridge router: grpc on 127.0.0.1:"), line
        grpc_part, http_part, metrics_part = line.strip().split(", ")
        assert http_part.startswith("http on 127.0.0.1:") and metrics_part.startswith("metrics on 127.0.0.1:")
        port = int(grpc_part.rsplit(":", 1)[1])
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{port}"))
        req = make_request()
        req.rid = "cli-1"
        responses = list(stub.Generate(req, timeout=30))
        assert [t for r in responses for t in r.token_ids] == [100, 101, 102, 103]
        logged = [parse_line(proc.stderr.readline().rstrip("\n")) for _ in range(3)]
        assert [(f["logger"], f["event"], f["rid"], f["phase"]) for f in logged] == [
            ("kvbridge.router", "phase", "cli-1", phase) for phase in ("routed", "first_token", "finished")
        ]
        assert (logged[0]["colocated"], logged[2]["outcome"], logged[2]["tokens"]) == (node.address, "length", "4")
        metrics_url = f"http://{metrics_part.removeprefix('metrics on ')}/metrics"
        with urllib.request.urlopen(metrics_url, timeout=10) as resp:
            assert 'kvbridge_router_requests_total{outcome="length"} 1.0' in resp.read().decode().splitlines()
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        node.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--colocated", "127.0.0.1:1", "--port", "x"], "--port must be an integer, got 'x'"),
        (["--colocated", "127.0.0.1:1", "--port", "-5"], "--port must be in [0, 65535] (or -1: no gRPC), got -5"),
        (["--colocated", "nohost"], "--colocated: expected HOST:PORT with a port in [1, 65535], got 'nohost'"),
        (["--metrics-port", "-2"], "--metrics-port must be -1 (off) or in [0, 65535], got -2"),
        (["--colocated", "127.0.0.1:1", "--request-timeout-s", "0"], "--request-timeout-s must be > 0, got 0.0"),
        (["--colocated", "127.0.0.1:1", "--request-timeout-s", "soon"], "--request-timeout-s must be a number"),
        (["--colocated", "127.0.0.1:1", "--host", "256.0.0.1"], "cannot bind 256.0.0.1:"),
        (["--routing", "fastest"], "--routing must be one of cache_aware, least_loaded, round_robin, got 'fastest'"),
        (["--client-cert-reqs", "maybe"], "--client-cert-reqs must be one of none, optional, required, got 'maybe'"),
        (["--admin-port", "-2"], "--admin-port must be -1 (Admin on the gRPC port) or in [0, 65535], got -2"),
    ],
)
def test_bad_flags_are_one_line_naming_the_value_and_exit_2(flags, message):
    proc = router_process(*flags)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("kvbridge router: error: "), err
    assert message in err


def test_log_level_takes_only_the_known_levels():
    proc = router_process("--log-level", "loud")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "argument --log-level: invalid choice: 'loud'" in err


def test_a_json_schema_request_leaves_the_router_without_libtorch():
    """The router checks a schema itself (llguidance, common/text/schema.py) and never loads torch:
    after a good and a bad json_schema request its process maps llguidance and no libtorch."""
    node = FakeNode("colocated", Rooms())
    proc = router_process("--colocated", node.address, "--port", "0", "--http-port", "0")
    try:
        port = int(proc.stderr.readline().split(", ")[0].rsplit(":", 1)[1])
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{port}"))
        good = make_request(structured=common_pb2.StructuredOutput(json_schema='{"type": "object"}'))
        assert [t for r in stub.Generate(good, timeout=30) for t in r.token_ids] == [100, 101, 102, 103]
        bad = make_request(structured=common_pb2.StructuredOutput(json_schema='{"type": "nosuchtype"}'))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "sampling.structured.json_schema: json_schema: Invalid type: nosuchtype"
        maps = pathlib.Path(f"/proc/{proc.pid}/maps").read_text()
        assert "llguidance" in maps  # (the check ran in this process)
        assert [line for line in maps.splitlines() if "libtorch" in line or "libc10" in line] == []
    finally:
        proc.kill()
        node.stop()
