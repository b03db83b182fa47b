"""A local OTLP trace receiver (opentelemetry-proto's TraceService over gRPC): it keeps every span
it is sent, for `kvbridge bench serve --mode tracing` and the tracing tests. Not a collector: no
processing, no forwarding; spans are held in memory until `clear`."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    service: str  # its process's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict
    error: bool  # its status is ERROR
    start_ns: int
    end_ns: int


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _spans_of(request) -> list[Span]:
    got = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                got.append(
                    Span(
                        service=resource.get("service.name", ""),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == s.status.STATUS_CODE_ERROR,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                    )
                )
    return got


class OTLPSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self._requests: list = []  # ExportTraceServiceRequests not read yet
        self._spans: list[Span] = []
        self.exports = 0  # Export calls served
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.port = 0

    def start(self, host: str = "127.0.0.1") -> str:
        """Listen on a free port; returns the URL to give --otlp-traces-endpoint."""
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def Export(self, request, context):
        # kept as received (parsed by protobuf's C++ runtime); read into Spans when asked: a receiver
        # that runs beside the process it measures must cost it little
        with self._lock:
            self._requests.append(request)
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            fresh, self._requests = self._requests, []
            for request in fresh:
                self._spans += _spans_of(request)
            return list(self._spans)

    def of_trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, done, timeout: float = 30.0) -> list[Span]:
        """The trace's spans once `done(spans)` holds (or the timeout passed: the last look)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.of_trace(trace_id)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def clear(self) -> None:
        with self._lock:
            self._requests, self._spans = [], []
