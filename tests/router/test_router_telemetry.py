"""What the router tells its operators besides Admin: Prometheus metrics after real traffic (a
tiny-random node; gRPC and HTTP, streamed and not, every outcome) and one log line per phase of
each request (in-test nodes, so that retries and failures happen on cue)."""

from __future__ import annotations

import json
import logging
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.common import rpc
from kvbridge.common.limits import room_tag
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, generation_pb2_grpc
from tests.pd import wait_idle
from tests.router.fakes import generate, make_request, wait_until


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted label pairs) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def outcomes(samples: dict) -> dict[str, float]:
    requests = ((labels, v) for (name, labels), v in samples.items() if name == "kvbridge_router_requests_total")
    return {dict(labels)["outcome"]: v for labels, v in requests}


def counts(samples: dict) -> dict[str, float]:
    """_count of each histogram."""
    names = ("time_to_first_token", "inter_token_latency", "request_duration")
    return {n: samples[(f"kvbridge_{n}_seconds_count", ())] for n in names}


def post(port: int, body: dict) -> bytes:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read()


def test_metrics_count_every_request_by_outcome_and_time_each_token(colocated_node):
    r = start_router(RouterConfig(port=0, http_port=0, metrics_port=0, colocated=(colocated_node.address,)))
    try:
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{r.port}"))
        before = scrape(r.metrics_port)
        assert outcomes(before) == {"stop": 0, "length": 0, "abort": 0, "error": 0}
        assert counts(before) == {"time_to_first_token": 0, "inter_token_latency": 0, "request_duration": 0}

        streams = []  # the token-bearing responses of each gRPC request
        for req in (
            make_request([5, 6, 7], max_new_tokens=4, ignore_eos=True),
            make_request([8, 9], max_new_tokens=5, ignore_eos=True),
        ):
            responses = list(stub.Generate(req, timeout=60))
            assert responses[-1].finish_reason == "length"
            streams.append([x.token_ids[:] for x in responses if x.token_ids])
        second = [t for ids in streams[0] for t in ids][1]  # greedy: the same prompt stops at its second token
        responses = list(stub.Generate(make_request([5, 6, 7], stop_token_ids=[second]), timeout=60))
        assert responses[-1].finish_reason == "stop"
        streams.append([x.token_ids[:] for x in responses if x.token_ids])
        choices = make_request([5, 6, 8], max_new_tokens=4, ignore_eos=True, temperature=1.0, seed=3)
        choices.sampling.n = 3
        responses = list(stub.Generate(choices, timeout=60))
        for i in range(3):  # (gaps are timed within each choice, not across the interleaved ones)
            streams.append([x.token_ids[:] for x in responses if x.token_ids and x.index == i])
            assert [x.finish_reason for x in responses if x.index == i][-1] == "length"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(make_request([5, 1000], max_new_tokens=2), timeout=60))  # 1000: past the vocabulary
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a gap is timed between two token-bearing responses (a node sends tokens that queued up behind a slow
        # reader in one response, so the gaps are counted from the responses the client saw)
        grpc_gaps = sum(len(s) - 1 for s in streams)
        assert counts(scrape(r.metrics_port))["inter_token_latency"] == grpc_gaps
        body = {"prompt": [8, 9], "max_tokens": 3, "ignore_eos": True}
        assert json.loads(post(r.http_port, body))["usage"]["completion_tokens"] == 3
        streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
        *_, usage, done, _ = post(r.http_port, streamed).decode().split("\n\n")
        assert json.loads(usage.removeprefix("data: "))["usage"]["completion_tokens"] == 3 and done == "data: [DONE]"

        after = scrape(r.metrics_port)
        assert outcomes(after) == {"stop": 1, "length": 5, "abort": 0, "error": 1}
        timed = counts(after)
        # the two HTTP requests of 3 tokens: at most 2 gaps each (fewer when tokens shared a response)
        assert grpc_gaps <= timed.pop("inter_token_latency") <= grpc_gaps + 2 * (3 - 1)
        assert timed == {"time_to_first_token": 6, "request_duration": 7}
        retries = {
            dict(labels)["reason"]: v for (name, labels), v in after.items() if name == "kvbridge_router_retries_total"
        }
        assert retries == {"unavailable": 0, "resource_exhausted": 0, "deadline_exceeded": 0}
        timeouts = {
            dict(labels)["timeout"]: v
            for (name, labels), v in after.items()
            if name == "kvbridge_router_timeouts_total"
        }
        assert timeouts == {"first_token": 0, "idle_stream": 0}
        node_labels = (("address", colocated_node.address), ("role", "colocated"))
        assert after[("kvbridge_router_node_up", node_labels)] == 1
        assert after[("kvbridge_router_node_outstanding_requests", node_labels)] == 0
        assert after[("kvbridge_router_requests_in_flight", ())] == 0
        assert after[("kvbridge_router_draining", ())] == 0

        call = stub.Generate(make_request(list(range(5, 40)), max_new_tokens=3000, ignore_eos=True), timeout=60)
        next(call)
        assert scrape(r.metrics_port)[("kvbridge_router_node_outstanding_requests", node_labels)] == 1
        assert scrape(r.metrics_port)[("kvbridge_router_requests_in_flight", ())] == 1
        call.cancel()
        assert wait_until(lambda: outcomes(scrape(r.metrics_port))["abort"] == 1)
        admin = admin_pb2_grpc.AdminStub(rpc.make_channel(f"127.0.0.1:{r.port}"))
        admin.Drain(admin_pb2.DrainRequest(), timeout=10)
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(make_request([5], max_new_tokens=1), timeout=60))  # refused: an error
        end = scrape(r.metrics_port)
        assert outcomes(end) == {"stop": 1, "length": 5, "abort": 1, "error": 2}
        assert end[("kvbridge_request_duration_seconds_count", ())] == 9
        assert end[("kvbridge_router_draining", ())] == 1
    finally:
        r.stop(grace_s=0)
    wait_idle(colocated_node.address)


# ---------------------------------------------------------------- logs


@pytest.fixture
def phases():
    """The fields of every `event=phase` line the router logs during the test."""
    logger, lines = logging.getLogger("kvbridge.router"), []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "fields", {})
            if fields.get("event") == "phase":
                lines.append(dict(fields))

    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def without_seconds(lines: list[dict]) -> list[dict]:
    assert all(line["seconds"] >= 0 for line in lines if "seconds" in line)
    return [{k: v for k, v in line.items() if k not in ("event", "seconds")} for line in lines]


def test_each_phase_is_one_log_line_retry_included(fleet, phases):
    router, nodes = fleet(colocated=2)
    a, b = nodes["colocated"]
    a.fail = grpc.StatusCode.UNAVAILABLE  # the first pick (round-robin starts at the first node)
    assert len(generate(router)) == 5
    rid = phases[0]["rid"]
    assert without_seconds(phases) == [
        {"rid": rid, "room": "0", "phase": "routed", "colocated": a.address},
        {
            "rid": rid,
            "room": "0",
            "phase": "retry",
            "code": "UNAVAILABLE",
            "reason": f"{a.address} fails as told (from colocated/{a.address})",
            "attempt": 2,
        },
        {"rid": rid, "room": "0", "phase": "routed", "colocated": b.address},
        {"rid": rid, "room": "0", "phase": "first_token"},
        {"rid": rid, "room": "0", "phase": "finished", "outcome": "length", "tokens": 4},
    ]
    registry = router.dispatcher.metrics.registry
    assert registry.get_sample_value("kvbridge_router_retries_total", {"reason": "unavailable"}) == 1


def test_a_failed_disaggregated_request_logs_its_pair_room_and_status(fleet, phases):
    router, nodes = fleet(prefill=1, decode=1)
    [p], [d] = nodes["prefill"], nodes["decode"]
    d.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError):
        generate(router)
    [dreq] = d.requests
    room = dreq.prefill.room
    assert without_seconds(phases) == [
        {"rid": dreq.rid, "room": room_tag(room), "phase": "routed", "prefill": p.address, "decode": d.address},
        {
            "rid": dreq.rid,
            "room": room_tag(room),
            "phase": "failed",
            "outcome": "error",
            "code": "RESOURCE_EXHAUSTED",
            "message": f"{d.address} fails as told (from decode/{d.address})",
        },
    ]


def test_a_client_cancel_is_logged_as_an_abort(fleet, phases):
    router, _ = fleet(colocated=1, tokens=5000, token_s=0.01)
    call = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{router.port}")).Generate(
        make_request(), timeout=30
    )
    next(call)
    call.cancel()
    assert wait_until(lambda: phases and phases[-1]["phase"] == "failed")
    assert without_seconds(phases[-1:]) == [
        {
            "rid": phases[0]["rid"],
            "room": "0",
            "phase": "failed",
            "outcome": "abort",
            "code": "CANCELLED",
            "message": "the client cancelled the request",
        }
    ]
    samples = router.dispatcher.metrics.registry  # counted as the request ends, just after its last log line
    assert wait_until(lambda: samples.get_sample_value("kvbridge_router_requests_total", {"outcome": "abort"}) == 1)
