"""One connected trace per request, across every process it touches (issue 28): a real OTLP
receiver (opentelemetry-proto's TraceService, kvbridge/bench/otlp_sink.py) on a local port, and a
fleet of `kvbridge` CLI processes exporting to it: router + P (pp 2) + D1 (pp 2) + D2 (pp 1).

Each request is sent with a W3C `traceparent` of the test's own (a client span the test never
exports): every span of the trace must carry its trace id, every span's parent must be that client
span or a span of the trace, and spans must come from each process the request touched. The same
for a stream migrated off a drained decode node, and for a request a node refuses."""

from __future__ import annotations

import functools
import json
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvbridge.bench.otlp_sink import OTLPSink, Span
from kvbridge.v1 import admin_pb2
from tests.nodes.test_failover import STARTED, NodeProcess
from tests.pd import admin

HARD_TIMEOUT_S = 300
pytestmark = [pytest.mark.long, pytest.mark.usefixtures("hard_timeout")]
STEP_DELAY_MS = 20  # each decode step: a 200-token stream lasts ~4 s, so it is caught mid-way


def before_hard_exit() -> None:
    for node in STARTED:
        node.kill()


class RouterProcess:
    """`python -m kvbridge router` on free ports; its stderr drained by a thread."""

    def __init__(self, *flags: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge", "router", "--port", "0", "--http-port", "0", "--health-retry-s",
             "0.2", "--log-level", "info", *flags],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.http = self.grpc = 0
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("kvbridge router: grpc on "):
                self.grpc = int(line.split("grpc on ")[1].split(",")[0].rsplit(":", 1)[1])
                self.http = int(line.split("http on ")[1].split(",")[0].rsplit(":", 1)[1])
                break
        assert self.http, "".join(self.lines)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def fleet():
    sink = OTLPSink()
    url = sink.start()
    traced = ("--otlp-traces-endpoint", url, "--log-level", "info")
    slow = ("--fault-inject", f"step_delay_ms={STEP_DELAY_MS}", "--shutdown-grace-s", "0.5")
    nodes = {
        "p": NodeProcess("prefill", "--pp-size", "2", *traced),
        "d1": NodeProcess("decode", "--pp-size", "2", *slow, *traced),
        "d2": NodeProcess("decode", *slow, *traced),
    }
    for node in nodes.values():
        node.wait_ready()
    decode = f"{nodes['d1'].address},{nodes['d2'].address}"
    router = RouterProcess("--prefill", nodes["p"].address, "--decode", decode, "--routing", "least_loaded", *traced)
    try:
        wait_routable(router)
        yield sink, router, nodes
    finally:
        router.stop()
        for node in nodes.values():
            node.stop()
        sink.stop()


def wait_routable(router: RouterProcess) -> None:
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{router.http}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        threading.Event().wait(0.1)
    raise AssertionError("the router never became healthy:\n" + "".join(router.lines[-20:]))


def chat(router: RouterProcess, traceparent: str, max_tokens: int, **extra) -> tuple[int, str, list[dict]]:
    """A streamed chat through the router's HTTP API: (status, body if refused, the stream's chunks)."""
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": max_tokens}
    body |= {"stream": True, "temperature": 0, **extra}
    url = f"http://127.0.0.1:{router.http}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers={"traceparent": traceparent}, timeout=120) as resp:
        if resp.status_code != 200:
            return resp.status_code, resp.read().decode(), []
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    return resp.status_code, "", chunks


def new_trace() -> tuple[str, str, str]:
    """(trace id, the client's span id, the traceparent header carrying them, sampled)."""
    trace_id, client = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, client, f"00-{trace_id}-{client}-01"


def check_connected(spans: list[Span], client: str) -> None:
    """Every span's parent is the client's span or a span of the trace; exactly one span (the
    router's request span) hangs under the client."""
    ids = {s.span_id for s in spans}
    orphans = [(s.service, s.name, s.parent_id) for s in spans if s.parent_id not in ids | {client}]
    assert orphans == []
    assert [(s.service, s.name.split()[0]) for s in spans if s.parent_id == client] == [("kvbridge-router", "chat")]


def names(spans: list[Span], service: str) -> set[str]:
    return {s.name for s in spans if s.service == service}


def test_one_streamed_chat_is_one_trace_across_every_process(fleet):
    sink, router, nodes = fleet
    trace_id, client, header = new_trace()
    status, _, chunks = chat(router, header, 8)
    assert status == 200 and sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) >= 1
    attempt = sink.wait_for(trace_id, lambda s: any(x.name == "attempt" for x in s), timeout=30)
    decode = next(s for s in attempt if s.name == "attempt").attributes["server.address"]
    d = "d1" if decode == nodes["d1"].address else "d2"  # (D1 runs two ranks, D2 one)
    assert decode == nodes[d].address
    want = {"kvbridge-router", "kvbridge-prefill", "kvbridge-prefill-rank0", "kvbridge-prefill-rank1"}
    want |= {"kvbridge-decode", "kvbridge-decode-rank0"} | ({"kvbridge-decode-rank1"} if d == "d1" else set())
    spans = sink.wait_for(trace_id, lambda s: want <= {x.service for x in s} and _complete(s), timeout=30)
    assert {s.trace_id for s in spans} == {trace_id}
    assert {s.service for s in spans} == want and len(want) >= 6
    check_connected(spans, client)

    root = next(s for s in spans if s.name.startswith("chat "))
    assert root.name == "chat tiny-random" and not root.error
    assert (
        root.attributes["gen_ai.operation.name"] == "chat" and root.attributes["gen_ai.request.model"] == "tiny-random"
    )
    assert root.attributes["gen_ai.usage.output_tokens"] == 8 and root.attributes["gen_ai.response.finish_reasons"] == [
        "length"
    ]
    assert names(spans, "kvbridge-router") == {"chat tiny-random", "route", "attempt"}
    assert names(spans, "kvbridge-prefill") == {"kvbridge.v1.Prefill/Prefill"}
    assert names(spans, "kvbridge-decode") == {"kvbridge.v1.Generation/Generate"}
    # P's rank 0: the queues and the consensus ruling it waited for, and its chunks; rank 1 its chunks and push
    assert {"waiting", "prefilling", "transferring", "prefill chunk", "kv push"} <= names(
        spans, "kvbridge-prefill-rank0"
    )
    assert names(spans, "kvbridge-prefill-rank1") == {"prefill chunk", "kv push"}
    assert {"prealloc", "transferring", "decoding", "kv landed"} <= names(spans, "kvbridge-decode-rank0")
    prompt = root.attributes["gen_ai.usage.input_tokens"]
    chunks_r1 = [s for s in spans if s.service == "kvbridge-prefill-rank1" and s.name == "prefill chunk"]
    assert sum(s.attributes["kvbridge.tokens"] for s in chunks_r1) == prompt  # (no prefix cached: a new prompt)

    # the hand-off, proved: each push span's bytes landed on the decode rank it names, under that span
    pushes = {s.span_id: s for s in spans if s.name == "kv push"}
    landed = [s for s in spans if s.name == "kv landed"]
    assert landed and all(s.parent_id in pushes for s in landed)
    assert sorted(s.attributes["kvbridge.bytes"] for s in landed) == sorted(
        p.attributes["kvbridge.bytes"] for p in pushes.values()
    )
    handed = next(s for s in spans if s.service == "kvbridge-prefill-rank0" and s.name == "transferring")
    pages = -(-prompt // 4)  # (page size 4; nothing held on the decode node: a new prompt)
    assert handed.attributes["kvbridge.kv_pages_moved"] == pages and handed.attributes["kvbridge.backend"] == "shm"
    assert handed.attributes["kvbridge.kv_bytes_moved"] == sum(p.attributes["kvbridge.bytes"] for p in pushes.values())
    assert 0 < handed.attributes["kvbridge.handoff_s"] <= (handed.end_ns - handed.start_ns) / 1e9 + 1e-3
    # the same figures in the prefill node's log (rank 0), and each rank's push with its own
    for _ in range(100):  # (its stderr is read by a thread)
        if any("event=handoff" in line for line in nodes["p"].lines):
            break
        threading.Event().wait(0.05)
    logged = [line for line in nodes["p"].lines if "event=handoff" in line]
    assert f"kv_pages_moved={pages} " in logged[-1] and "backend=shm" in logged[-1]
    pushed = [line for line in nodes["p"].lines if "event=kv_push" in line]
    assert {line.split(" rank=")[1].split()[0] for line in pushed} == {"0", "1"}


def _complete(spans: list[Span]) -> bool:
    """Every process's spans of the request are in (each exports on its own schedule)."""
    named = [(s.service, s.name) for s in spans]
    ends = ("kvbridge-decode-rank0", "decoding") in named and ("kvbridge-prefill-rank0", "transferring") in named
    return (
        ends
        and any(s.name.startswith("chat ") for s in spans)
        and named.count(("kvbridge-prefill-rank1", "kv push")) == 1
    )


def test_a_request_refused_by_a_node_is_one_trace(fleet):
    """A logit_bias token id past the vocabulary: the router cannot know the vocabulary; the nodes
    refuse it (INVALID_ARGUMENT; the router opens P and D at once, so whichever answers first refuses
    it and the other's call is cancelled), the client gets 400; the trace shows where it was refused."""
    sink, router, _ = fleet
    trace_id, client, header = new_trace()
    status, body, _ = chat(router, header, 4, logit_bias={"999999": 5})
    assert status == 400 and "999999" in body
    nodes = ("kvbridge-decode", "kvbridge-prefill")
    spans = sink.wait_for(trace_id, lambda s: _refused(s, nodes), timeout=30)
    assert {s.trace_id for s in spans} == {trace_id}
    check_connected(spans, client)
    root = next(s for s in spans if s.name.startswith("chat "))
    assert root.error and root.attributes["error.type"] == "INVALID_ARGUMENT"
    # the node that refused it; the other's call ended CANCELLED, or was cancelled before it reached it
    served = {s.service: (s.error, s.attributes["rpc.grpc.status_code"]) for s in spans if s.service in nodes}
    assert all(error for error, _ in served.values())
    assert "INVALID_ARGUMENT" in {code for _, code in served.values()} <= {"INVALID_ARGUMENT", "CANCELLED"}
    assert {s.service for s in spans} <= {"kvbridge-router", "kvbridge-decode", "kvbridge-prefill"}
    assert not any(s.service.endswith(("rank0", "rank1")) for s in spans)  # (refused before any rank saw it)


def _refused(spans: list[Span], nodes: tuple[str, ...]) -> bool:
    codes = [s.attributes.get("rpc.grpc.status_code") for s in spans if s.service in nodes]
    return any(s.name.startswith("chat ") for s in spans) and "INVALID_ARGUMENT" in codes


def test_a_migrated_stream_is_one_trace(fleet):
    """The decode node streaming a request is drained mid-stream (SIGTERM, 0.5 s grace): the router
    migrates the stream to the other decode node; both attempts and both decode nodes' spans are in
    the one trace, the second attempt marked as migration 1."""
    sink, router, nodes = fleet
    trace_id, client, header = new_trace()
    result: dict = {}
    ask = functools.partial(chat, router, header, 200, ignore_eos=True)  # (200 tokens on any host's numerics)
    thread = threading.Thread(target=lambda: result.update(out=ask()), daemon=True)
    thread.start()
    holder = None
    for _ in range(1200):  # (until a decode node streams it)
        if holder := _holder(router, nodes):
            break
        threading.Event().wait(0.05)
    assert holder is not None, "no decode node streamed the request"
    threading.Event().wait(1.0)  # (mid-stream: 200 tokens take ~4 s)
    holder.proc.send_signal(signal.SIGTERM)
    thread.join(timeout=120)
    status, _, chunks = result["out"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert (status, finish) == (200, ["length"])
    spans = sink.wait_for(trace_id, lambda s: _migrated(s), timeout=30)
    assert {s.trace_id for s in spans} == {trace_id}
    check_connected(spans, client)
    attempts = sorted((s for s in spans if s.name == "attempt"), key=lambda s: s.start_ns)
    assert [a.attributes["kvbridge.migration"] for a in attempts] == [0, 1]
    assert attempts[0].error and not attempts[1].error
    generates = [s for s in spans if s.name == "kvbridge.v1.Generation/Generate"]
    assert sorted(g.parent_id for g in generates) == sorted(a.span_id for a in attempts)  # one on each decode node
    root = next(s for s in spans if s.name.startswith("chat "))
    assert root.attributes["kvbridge.migrations"] == 1 and root.attributes["gen_ai.usage.output_tokens"] == 200
    other = next(n for k, n in nodes.items() if k.startswith("d") and n is not holder)
    assert other.proc.poll() is None


def _holder(router: RouterProcess, nodes: dict) -> NodeProcess | None:
    listed = admin(f"127.0.0.1:{router.grpc}").ListRequests(admin_pb2.ListRequestsRequest(), timeout=5).requests
    for r in listed:
        for key in ("d1", "d2"):
            if r.output_tokens and r.peer.endswith(" -> " + nodes[key].address):
                return nodes[key]
    return None


def _migrated(spans: list[Span]) -> bool:
    root = [s for s in spans if s.name.startswith("chat ")]
    return bool(root) and len([s for s in spans if s.name == "kvbridge.v1.Generation/Generate"]) == 2


def test_processes_exit_promptly_on_sigterm_with_a_collector_that_never_answers():
    """A node and a router exporting to a collector that takes connections and never answers: each
    took 9-10 s to exit on SIGTERM, waiting on the export under way and then the queue's (5 s each);
    now the queue gets tracing.SHUTDOWN_S (what it drops is counted: tests/nodes/test_trace_context.py)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # (the kernel takes connections; nobody reads them)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        node = NodeProcess("serve", "--otlp-traces-endpoint", url, "--shutdown-grace-s", "0.5")
        router = None
        try:
            node.wait_ready()
            router = RouterProcess("--colocated", node.address, "--otlp-traces-endpoint", url)
            wait_routable(router)
            status, _, chunks = chat(router, new_trace()[2], max_tokens=4)  # spans in every process, queued
            assert (status, chunks[-1]["choices"][0]["finish_reason"]) == (200, "length")
            took = {}
            for name, proc in (("router", router.proc), ("serve", node.proc)):
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=60) == 0
                took[name] = time.monotonic() - started
        finally:
            for p in (router, node):
                if p is not None:
                    p.stop()
    assert max(took.values()) < 6.0, took  # (generous: 1.2 s and 2.8 s here; 9-10 s each before)
    for lines in (router.lines, node.lines):  # each said why its spans went nowhere
        said = {line.split("event=")[1].split()[0] for line in lines if "logger=kvbridge.tracing" in line}
        assert said & {"tracing_dropped", "tracing_unreachable"} and said <= {"tracing", "tracing_dropped",
                                                                             "tracing_unreachable"}, said  # fmt: skip
