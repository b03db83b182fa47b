"""OpenTelemetry traces: one connected trace per request, across every process it touches.

Off unless a process is started with `--otlp-traces-endpoint URL` (as vLLM's flag): OTLP over
gRPC, or OTLP/HTTP when the URL's path ends in `/v1/traces`; `--otlp-traces-sample-ratio R`
samples new traces (a request that comes with a `traceparent` follows its sampled flag: W3C
parent-based sampling). Rank processes inherit the front's settings through the environment, as
they do its log level.

The context travels with the request as a W3C `traceparent` string: the router takes the
client's (HTTP header, gRPC metadata) or starts one; it goes to the nodes in gRPC metadata, into
rank 0 on the request's message, down the pipeline log to every rank (the ADMIT record), and to
the decode ranks with the KV route. Spans in the ranks are made after the fact, with the times
the loops measured (`record`), so a rank's hot path never waits on the tracer; with tracing off
every call here returns at once.

A process that cannot reach the collector serves on; it says so once (and once more when the
collector answers again), and the SDK's own per-batch complaints are muted. Nor does it wait on
the collector to exit: `shutdown` gives what is queued SHUTDOWN_S to go out, then drops the rest
(the export under way too: gRPC's is cancelled with its channel, an HTTP one is left to time out in
a daemon thread) and says in one line how many spans it dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context, attach
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvbridge import __version__
from kvbridge.common.logs import log_event

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

ENV_ENDPOINT = "KVBRIDGE_OTLP_TRACES_ENDPOINT"  # rank processes inherit the front's settings
ENV_RATIO = "KVBRIDGE_OTLP_TRACES_SAMPLE_RATIO"
ENV_SERVICE = "KVBRIDGE_OTLP_SERVICE"
TRACEPARENT = "traceparent"
MAX_HEADER = 512  # a traceparent or tracestate longer than this is ignored (W3C's are 55 and <= 512)
EXPORT_TIMEOUT_S = 5.0  # one export's wait on the collector
QUEUE_SPANS = 16384  # spans a process holds for export at most (then drops): bursts of thousands fit
EXPORT_DELAY_MS = 500  # spans leave a process at most this long after they end (the SDK's default: 5 s)
SHUTDOWN_S = 1.0  # at exit, what is queued gets this long to go out; the rest is dropped
GIVE_UP_S = 0.5  # then this long at most for the rest to be passed through (and counted), once dropped
# the SDK's loggers that complain once per failed batch (or dropped span): reported once here instead
_NOISY = ("opentelemetry.exporter.otlp", "opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export")
log = logging.getLogger("kvbridge.tracing")

_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer = trace.NoOpTracer()
_provider = None  # the SDK's TracerProvider, once set up
_lock = threading.Lock()


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing (OpenTelemetry)")
    group.add_argument(
        "--otlp-traces-endpoint", default="", metavar="URL",
        help="export traces over OTLP to this collector: gRPC (e.g. http://collector:4317), or OTLP/HTTP for a "
        "URL ending in /v1/traces (default: off)",
    )  # fmt: skip
    group.add_argument(
        "--otlp-traces-sample-ratio", type=float, default=1.0, metavar="R",
        help="the share of new traces sampled, 0 to 1 (a request with a traceparent follows its sampled flag; "
        "default: 1)",
    )  # fmt: skip


def check(endpoint: str, ratio: float) -> None:
    """ValueError naming the bad setting."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--otlp-traces-sample-ratio must be in [0, 1], got {ratio}")
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--otlp-traces-endpoint must be an http:// or https:// URL, got {endpoint!r}")


def setup(service: str, endpoint: str = "", ratio: float = 1.0) -> bool:
    """Export this process's spans as `service` (OpenTelemetry's service.name) when `endpoint` is
    set; child processes started afterwards inherit the settings (`setup_from_env`). True when on."""
    global _tracer, _provider
    check(endpoint, ratio)
    if not endpoint:
        return False
    os.environ[ENV_ENDPOINT], os.environ[ENV_RATIO], os.environ[ENV_SERVICE] = endpoint, repr(ratio), service
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    with _lock:
        if _provider is not None:
            _provider.shutdown()
        for name in _NOISY:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        resource = Resource.create({"service.name": service, "service.version": __version__})
        _provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(ratio)))
        _provider.add_span_processor(_batches()(_Reported(_exporter(endpoint), endpoint, service)))
        _tracer = _provider.get_tracer("kvbridge", __version__)
    log_event(log, "tracing", service=service, endpoint=endpoint, sample_ratio=ratio)
    return True


def setup_from_env(suffix: str) -> bool:
    """A child process's setup, with the settings its parent's `setup` left in the environment; its
    service is the parent's with `suffix` (e.g. kvbridge-prefill-rank1)."""
    endpoint = os.environ.get(ENV_ENDPOINT, "")
    if not endpoint:
        return False
    service = os.environ.get(ENV_SERVICE, "kvbridge") + suffix
    return setup(service, endpoint, float(os.environ.get(ENV_RATIO, "1")))


def shutdown() -> None:
    """Send what is queued within SHUTDOWN_S, drop the rest (a process about to exit), and stop
    tracing here and in children started later."""
    global _tracer, _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _provider, _tracer = None, trace.NoOpTracer()
    for name in (ENV_ENDPOINT, ENV_RATIO, ENV_SERVICE):
        os.environ.pop(name, None)


def enabled() -> bool:
    return _provider is not None


def _exporter(endpoint: str):
    if endpoint.rstrip("/").endswith("/v1/traces"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

        return HTTPExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

    host = endpoint.split("://", 1)[1].rstrip("/")
    return GRPCExporter(endpoint=host, insecure=endpoint.startswith("http://"), timeout=EXPORT_TIMEOUT_S)


@functools.cache
def _batches():
    """The SDK's BatchSpanProcessor, counting the spans it takes, with a shutdown bounded by SHUTDOWN_S
    (a class made on first use: the SDK is imported only when tracing is on)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class Batches(BatchSpanProcessor):
        def __init__(self, exporter: _Reported):
            super().__init__(exporter, max_queue_size=QUEUE_SPANS, schedule_delay_millis=EXPORT_DELAY_MS)
            self.exporter = exporter
            self.taken = 0  # sampled spans handed to the queue
            self._counting = threading.Lock()

        def on_end(self, span: ReadableSpan) -> None:
            if span.context.trace_flags.sampled:
                with self._counting:
                    self.taken += 1
            super().on_end(span)

        def shutdown(self) -> None:
            """The SDK's shutdown (what is queued exported, then the exporter shut down), given
            SHUTDOWN_S; past it the exporter drops what is left. One line says how many spans never
            went out (those that failed before were said when the collector was found unreachable)."""
            exporter = self.exporter
            failed_before = exporter.failed
            ending = threading.Thread(target=super().shutdown, name="kvbridge-tracing-shutdown", daemon=True)
            ending.start()
            ending.join(SHUTDOWN_S)
            if ending.is_alive():
                exporter.give_up()
                ending.join(GIVE_UP_S)
            with self._counting:
                dropped = self.taken - exporter.sent - failed_before
            if dropped > 0:
                log_event(
                    log, "tracing_dropped", logging.WARNING, service=exporter.service, endpoint=exporter.endpoint,
                    spans=dropped, reason=f"the collector did not take them within {SHUTDOWN_S:g} s of the exit",
                )  # fmt: skip

    return Batches


class _Reported:
    """An exporter that says once that the collector is unreachable (and once that it is back),
    counts the spans sent and failed, and refuses every export once told to give up."""

    def __init__(self, inner, endpoint: str, service: str):
        self.inner, self.endpoint, self.service, self.failing = inner, endpoint, service, False
        self.sent = self.failed = 0  # spans of exports that succeeded, and of those that did not
        self.dropping = False  # give_up() was called: nothing more goes out
        self._shut = False

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self.dropping:
            self.failed += len(spans)
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception as e:  # (the SDK would log each batch's exception)
            result, why = SpanExportResult.FAILURE, f"{type(e).__name__}: {e}"
        else:
            why = "the export failed (unreachable, or refused)"
        if result == SpanExportResult.SUCCESS:
            self.sent += len(spans)
        else:
            self.failed += len(spans)
        if self.dropping:  # (cancelled by give_up: tracing_dropped says it)
            return result
        if result == SpanExportResult.FAILURE and not self.failing:
            self.failing = True
            log_event(
                log, "tracing_unreachable", logging.WARNING, service=self.service, endpoint=self.endpoint, reason=why,
                effect="serving on; spans are dropped until the collector answers (said once)",
            )  # fmt: skip
        elif result == SpanExportResult.SUCCESS and self.failing:
            self.failing = False
            log_event(log, "tracing_reachable", service=self.service, endpoint=self.endpoint)
        return result

    def give_up(self) -> None:
        """Refuse every export from now on, and end the one under way: the gRPC exporter's shutdown
        closes its channel, which cancels its call (an HTTP one runs until its timeout)."""
        self.dropping = True
        self.shutdown()

    def shutdown(self) -> None:
        if not self._shut:
            self._shut = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


# ---------------------------------------------------------------- context across processes


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Context | None:
    """The remote parent a request came with (HTTP headers, gRPC metadata), or None."""
    if not carrier:
        return None
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    found = {
        k.lower(): v
        for k, v in items
        if k.lower() in ("traceparent", "tracestate") and isinstance(v, str) and len(v) <= MAX_HEADER
    }
    if TRACEPARENT not in found:
        return None
    ctx = _propagator.extract(found)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def context_of(traceparent: str) -> Context | None:
    """A `traceparent` string (what travels inside the node) as a parent context; None for ""."""
    return extract({TRACEPARENT: traceparent}) if traceparent else None


def traceparent(span: trace.Span) -> str:
    """The span as a W3C `traceparent` (what its children in other processes take), "" for none."""
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def current() -> str:
    """The traceparent of the span current in this task (a served call's: `served`), "" for none."""
    return traceparent(trace.get_current_span()) if _provider is not None else ""


def served(name: str):
    """Decorate a gRPC servicer method (unary, or streaming: an async generator): while it runs, a
    SERVER span under the caller's traceparent is current in its task (`current`), ended with the
    call's status. grpc.aio runs each call in a task of its own, so nothing leaks between calls."""

    def wrap(method):
        if inspect.isasyncgenfunction(method):

            @functools.wraps(method)
            async def streaming(self, request, context):
                if _provider is None:
                    async for item in method(self, request, context):
                        yield item
                    return
                span = _served_span(name, context)
                try:
                    async for item in method(self, request, context):
                        yield item
                except BaseException as e:
                    _ended_with(span, context, e)
                    raise
                span.end()

            return streaming

        @functools.wraps(method)
        async def unary(self, request, context):
            if _provider is None:
                return await method(self, request, context)
            span = _served_span(name, context)
            try:
                answer = await method(self, request, context)
            except BaseException as e:
                _ended_with(span, context, e)
                raise
            span.end()
            return answer

        return unary

    return wrap


def _served_span(name: str, context) -> trace.Span:
    service, _, method = name.rpartition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    span = _tracer.start_span(
        name, extract(context.invocation_metadata()), trace.SpanKind.SERVER, attributes=attributes
    )
    attach(trace.set_span_in_context(span))  # (this call's task only; it ends with the call)
    return span


def _ended_with(span: trace.Span, context, error: BaseException) -> None:
    """End a served call's span with its status: the code it aborted with, or the client's leaving."""
    code = context.code() if hasattr(context, "code") else None
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        name, message = "CANCELLED", "the caller cancelled the call"
    else:
        name = getattr(code, "name", None) or type(error).__name__
        message = (context.details() if hasattr(context, "details") else "") or str(error)
    span.set_attribute("rpc.grpc.status_code", name)
    span.set_attribute("error.type", name)
    span.set_status(Status(StatusCode.ERROR, message[:500]))
    span.end()


def metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the span's context to the callee."""
    tp = traceparent(span)
    return ((TRACEPARENT, tp),) if tp else ()


def start(
    name: str, parent: Context | str | None = None, kind=trace.SpanKind.INTERNAL, start_ns=None, attributes=None
) -> trace.Span:
    """A span, started now (or at `start_ns`, time.time_ns()) under `parent` (a context, a
    traceparent, or none: a new trace); end it with span.end()."""
    if isinstance(parent, str):
        parent = context_of(parent)
    return _tracer.start_span(name, parent, kind, attributes=attributes, start_time=start_ns)


def record(name: str, parent: str, start_ns: int, end_ns: int, attributes: dict | None = None) -> None:
    """A finished span under the `traceparent` `parent`, with times measured by the caller
    (time.time_ns()); nothing when tracing is off or the request is not sampled."""
    if not parent or _provider is None:
        return
    ctx = context_of(parent)
    if ctx is None or not trace.get_current_span(ctx).get_span_context().trace_flags.sampled:
        return
    span = _tracer.start_span(name, ctx, attributes=attributes, start_time=start_ns)
    span.end(end_time=end_ns)
