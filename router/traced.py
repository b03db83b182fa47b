"""A routed request's spans (common/tracing.py), after the OpenTelemetry GenAI conventions.

    chat MODEL | text_completion MODEL   SERVER, the request from its arrival to its last response
      route                              the pick: policy, reason, the nodes, the prompt's cached share, and
                                         for a decode node the local-prefill decision (router/local_prefill.py)
      attempt                            CLIENT, one per attempt: its upstream calls carry this span's
                                         context; a migrated stream has one per pair it ran on; its mode:
                                         disaggregated, colocated or local_prefill

The request span's parent is the client's `traceparent` when it sent one (HTTP header or gRPC
metadata); it carries the usage, the finish reason and an event at the first token. Tracing off,
every span here is a no-op.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from kvbridge.common import tracing
from kvbridge.router.pool import Pick
from kvbridge.v1 import generation_pb2

PROVIDER = "kvbridge"  # gen_ai.provider.name


def request_span(request: generation_pb2.GenerateRequest, parent: Context | None) -> trace.Span:
    operation = "chat" if request.prompt.WhichOneof("kind") == "chat" else "text_completion"
    s = request.sampling
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.max_tokens": s.max_new_tokens,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_p": s.top_p,
        "gen_ai.response.id": request.rid,
    }
    return tracing.start(operation, parent, trace.SpanKind.SERVER, attributes=attributes)


def picked(
    span: trace.Span, pick: Pick, prefill: Pick | None, policy: str, started_ns: int, migration: int, local=None
):
    """Record the route span (from `started_ns`) and open the attempt's span; name the request's
    span after the model once a node says which it serves. `local`: the local-prefill decision of a
    decode node's attempt (router/local_prefill.py Decision), None when none was made."""
    node = pick.node
    if span.is_recording() and node.model is not None and node.model.model:  # (off: a no-op span)
        span.update_name(f"{span.name.split()[0]} {node.model.model}")
        span.set_attribute("gen_ai.request.model", node.model.model)
    parent = trace.set_span_in_context(span)
    route = {"kvbridge.policy": policy, "kvbridge.reason": pick.reason, "kvbridge.node": node.address}
    if prefill is not None:
        route |= {"kvbridge.prefill": prefill.node.address, "kvbridge.prefill_reason": prefill.reason}
    route["kvbridge.cached_tokens"] = pick.cached  # (the prefill node's, when there is one, computes the prompt)
    if prefill is not None:
        route["kvbridge.cached_tokens"] = prefill.cached
    if local is not None:
        route |= {"kvbridge.local_prefill": local.local, "kvbridge.local_prefill_reason": local.reason}
    tracing.start("route", parent, start_ns=started_ns, attributes=route).end()
    mode = "disaggregated" if prefill is not None else "colocated"
    if local is not None and local.local:
        mode = "local_prefill"
    attempt = {"kvbridge.mode": mode, "server.address": node.address, "kvbridge.migration": migration}
    if prefill is not None:
        attempt["kvbridge.prefill"] = prefill.node.address
    return tracing.start("attempt", parent, trace.SpanKind.CLIENT, attributes=attempt)


def ended(span: trace.Span, routed, error: Exception | None) -> None:
    """End the request's span with what it came to."""
    span.set_attribute("gen_ai.usage.input_tokens", routed.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", routed.output_tokens)
    span.set_attribute("kvbridge.attempts", routed.attempts)
    span.set_attribute("kvbridge.migrations", routed.migrations)
    if routed.finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [routed.finish_reason])
    if error is not None:
        code = getattr(error, "code", None)
        name = code.name if code is not None else type(error).__name__
        span.set_attribute("error.type", name)
        span.set_status(Status(StatusCode.ERROR, getattr(error, "message", "") or name))
    span.end()


def attempt_ended(span: trace.Span, error: BaseException | None) -> None:
    if isinstance(error, Exception):  # (GeneratorExit: the consumer stopped reading; not a failure)
        code = getattr(getattr(error, "code", None), "name", type(error).__name__)
        span.set_attribute("error.type", code)
        span.set_status(Status(StatusCode.ERROR, getattr(error, "message", "") or code))
    span.end()
