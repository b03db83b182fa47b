"""common/tracing.py in one process: the trace context as it arrives from the network (hostile
values ignored), a served gRPC call's span and status, sampling, both OTLP transports against real
receivers, and a collector that cannot be reached (said once). The fleet-wide traces are
tests/e2e/test_tracing.py."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace.export import SpanExportResult

from kvbridge.bench.otlp_sink import OTLPSink
from kvbridge.common import tracing
from kvbridge.v1 import generation_pb2, generation_pb2_grpc


@pytest.fixture
def sink():
    receiver = OTLPSink()
    url = receiver.start()
    tracing.setup("kvbridge-test", url)
    yield receiver
    tracing.shutdown()
    receiver.stop()


def flushed(receiver: OTLPSink, trace_id: str, count: int) -> list:
    tracing._provider.force_flush()
    return receiver.wait_for(trace_id, lambda s: len(s) >= count, timeout=10)


def header(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent, f"00-{trace_id}-{parent}-{'01' if sampled else '00'}"


def test_a_trace_context_from_the_network_is_taken_only_when_well_formed():
    trace_id, parent, good = header()
    ctx = tracing.extract([("traceparent", good), ("authorization", "Bearer x")])
    got = trace.get_current_span(ctx).get_span_context()
    assert (f"{got.trace_id:032x}", f"{got.span_id:016x}", got.is_remote) == (trace_id, parent, True)
    assert tracing.extract({"TraceParent": good}) is not None  # (header names are case-insensitive)
    hostile = [
        "", "garbage", "00-" + "0" * 32 + "-" + parent + "-01",  # the all-zero trace id is invalid
        f"00-{trace_id}-{'0' * 16}-01", f"00-{trace_id[:-1]}z-{parent}-01", f"ff-{trace_id}-{parent}-01",
        good + "-" + "a" * 600,  # longer than any header we take
    ]  # fmt: skip
    assert [tracing.extract({"traceparent": h}) for h in hostile] == [None] * len(hostile)
    assert tracing.extract([("traceparent", b"00-bytes")]) is None and tracing.extract(None) is None
    assert tracing.context_of("") is None


def test_spans_recorded_under_a_hostile_context_are_not_recorded(sink):
    """What a decode rank does with a TransferNotice's traceparent: a bad one records nothing, raises nothing."""
    for bad in ("garbage", "00-" + "f" * 31 + "-" + "1" * 16 + "-01", "x" * 10_000):
        tracing.record("kv landed", bad, 1, 2, {"kvbridge.bytes": 1})
    trace_id, _, good = header()
    tracing.record("kv landed", good, 1, 2, {"kvbridge.bytes": 7})
    spans = flushed(sink, trace_id, 1)
    assert [(s.name, s.attributes) for s in sink.spans] == [("kv landed", {"kvbridge.bytes": 7})]
    assert spans[0].parent_id and spans[0].service == "kvbridge-test"


def test_sampling_follows_the_callers_flag_and_the_ratio_for_new_traces():
    receiver = OTLPSink()
    tracing.setup("kvbridge-test", receiver.start(), ratio=0.0)
    try:
        tracing.start("new trace").end()  # (ratio 0: not sampled)
        sampled, _, on = header(sampled=True)
        unsampled, _, off = header(sampled=False)
        tracing.start("child of a sampled caller", on).end()
        tracing.start("child of an unsampled caller", off).end()
        tracing.record("recorded under an unsampled caller", off, 1, 2)
        got = flushed(receiver, sampled, 1)
        assert [s.name for s in got] == ["child of a sampled caller"]
        assert [s.name for s in receiver.spans] == ["child of a sampled caller"] and not receiver.of_trace(unsampled)
    finally:
        tracing.shutdown()
        receiver.stop()
    with pytest.raises(ValueError, match=r"--otlp-traces-sample-ratio must be in \[0, 1\], got 1.5"):
        tracing.setup("x", "http://127.0.0.1:1", ratio=1.5)
    with pytest.raises(ValueError, match="must be an http:// or https:// URL, got 'collector:4317'"):
        tracing.setup("x", "collector:4317")


class _Servicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self):
        self.current: dict[str, str] = {}  # rid -> tracing.current() inside the call

    @tracing.served("kvbridge.v1.Generation/Generate")
    async def Generate(self, request, context):
        self.current[request.rid] = tracing.current()
        if request.rid == "refused":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias holds token id 999999")
        yield generation_pb2.GenerateResponse(rid=request.rid, token_ids=[1])
        await asyncio.sleep(30 if request.rid == "left" else 0)
        yield generation_pb2.GenerateResponse(rid=request.rid, token_ids=[2], finish_reason="length")


def test_a_served_call_is_a_server_span_under_its_caller_ending_with_its_status(sink):
    servicer, ids = _Servicer(), {}

    async def main():
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for rid in ("ok", "refused", "left"):
                ids[rid], parent, tp = header()
                call = stub.Generate(generation_pb2.GenerateRequest(rid=rid), metadata=(("traceparent", tp),))
                ids[rid] = (ids[rid], parent)
                try:
                    await call.read()
                    if rid == "left":
                        call.cancel()  # (the client leaves mid-stream)
                    else:
                        while await call.read() is not grpc.aio.EOF:
                            pass
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            await asyncio.sleep(0.3)
        await server.stop(None)

    asyncio.run(main())
    for rid, want in (("ok", None), ("refused", "INVALID_ARGUMENT"), ("left", "CANCELLED")):
        trace_id, parent = ids[rid]
        (span,) = flushed(sink, trace_id, 1)
        assert (span.name, span.parent_id, span.error) == ("kvbridge.v1.Generation/Generate", parent, want is not None)
        assert span.attributes.get("rpc.grpc.status_code") == want
        assert (span.attributes["rpc.service"], span.attributes["rpc.method"]) == ("kvbridge.v1.Generation", "Generate")
        assert servicer.current[rid] == f"00-{trace_id}-{span.span_id}-01"  # (what the call hands to its node)


def test_otlp_over_http_for_a_url_ending_in_v1_traces():
    got: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            assert (self.path, self.headers["Content-Type"]) == ("/v1/traces", "application/x-protobuf")
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tracing.setup("kvbridge-http", f"http://127.0.0.1:{server.server_port}/v1/traces")
        tracing.start("over http").end()
        tracing.shutdown()
    finally:
        server.shutdown()
    names = [s.name for r in got for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert names == ["over http"]


class _Flaky:
    def __init__(self, results):
        self.results = list(results)

    def export(self, spans):
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


def test_an_unreachable_collector_is_said_once_and_its_return_once(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="kvbridge.tracing")
    F, S = SpanExportResult.FAILURE, SpanExportResult.SUCCESS
    reported = tracing._Reported(_Flaky([F, ConnectionError("refused"), F, S, S, F]), "http://c:4317", "kvbridge-x")
    assert [reported.export([]) for _ in range(6)] == [F, F, F, S, S, F]
    events = [r.fields["event"] for r in caplog.records if r.name == "kvbridge.tracing"]
    assert events == ["tracing_unreachable", "tracing_reachable", "tracing_unreachable"]

    # a real exporter to a port nobody listens on: the process goes on; one line for two failed batches
    caplog.clear()
    monkeypatch.setattr(tracing, "EXPORT_TIMEOUT_S", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tracing.setup("kvbridge-test", f"http://127.0.0.1:{port}")
    try:
        for _ in range(2):
            tracing.start("dropped").end()
            tracing._provider.force_flush()
    finally:
        tracing.shutdown()
    lines = [r.fields for r in caplog.records if r.name == "kvbridge.tracing" and r.levelno == logging.WARNING]
    assert [(f["event"], f["service"], f["endpoint"]) for f in lines] == [
        ("tracing_unreachable", "kvbridge-test", f"http://127.0.0.1:{port}")
    ]


@pytest.mark.parametrize("path", ["", "/v1/traces"], ids=["grpc", "http"])
def test_an_exit_waits_at_most_a_second_on_a_silent_collector_and_counts_the_spans_it_drops(caplog, monkeypatch, path):
    """A collector that takes the connection and never answers held each export for its whole
    timeout, and shutdown waited for the export under way and then for the queue's: 9-10 s at
    EXPORT_TIMEOUT_S 5 (30 here). Now the queue gets SHUTDOWN_S, and one line counts what is dropped."""
    caplog.set_level(logging.INFO, logger="kvbridge.tracing")
    monkeypatch.setattr(tracing, "EXPORT_TIMEOUT_S", 30.0)
    exporting = threading.Event()
    export = tracing._Reported.export
    monkeypatch.setattr(tracing._Reported, "export", lambda self, spans: exporting.set() or export(self, spans))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # (the kernel takes connections; nobody reads them)
        tracing.setup("kvbridge-test", f"http://127.0.0.1:{silent.getsockname()[1]}{path}")
        for _ in range(3):
            tracing.start("under way").end()
        under_way = exporting.wait(timeout=30)  # (the batch goes after EXPORT_DELAY_MS)
        for _ in range(2):
            tracing.start("queued").end()
        started = time.monotonic()
        tracing.shutdown()
        took = time.monotonic() - started
    assert under_way and took < tracing.SHUTDOWN_S + tracing.GIVE_UP_S + 2.5  # (generous: 60 s before)
    lines = [r.fields for r in caplog.records if r.name == "kvbridge.tracing" and r.levelno == logging.WARNING]
    assert [(f["event"], f["service"], f["spans"]) for f in lines] == [("tracing_dropped", "kvbridge-test", 5)]
