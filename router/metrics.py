"""The router's Prometheus series, in a registry of its own (tests run several routers in one
process). The series are defined in common.metrics.RouterMetrics; here they are observed:

    kvbridge_router_requests_total{outcome}         client requests that ended: stop | length | abort | error
    kvbridge_router_retries_total{reason}           attempts moved to another node pair before any token reached
                                                    the client, by the failure's status code (unavailable,
                                                    resource_exhausted, deadline_exceeded)
    kvbridge_router_migrations_total{reason}        streams resubmitted to another node pair after tokens reached
                                                    the client (prompt + the tokens sent), by the failure's status
                                                    code or router timeout (MIGRATION_REASONS)
    kvbridge_router_timeouts_total{timeout}         the router's own timeouts: first_token | idle_stream
    kvbridge_router_routing_decisions_total{role, policy, reason}
                                                    nodes picked, by the node's role, the policy and why
                                                    (router/policy.py REASONS)
    kvbridge_router_kv_event_resyncs_total{reason}  KV indexes cleared to resync from a snapshot: gap | error |
                                                    lagged | overflow (router/pool.py)
    kvbridge_router_local_prefill_decisions_total{decision, reason}
                                                    P/D attempts by who computes the prompt: local (the decode
                                                    node, the prefill queue being long) or prefill, and why
                                                    (router/local_prefill.py REASONS); none while it is off.
                                                    Local attempts are pd_decisions{outcome="local"} and their
                                                    prompt tokens prompt_tokens{computed_by="decode"}
    kvbridge_planner_switches_total{from,to,reason} elastic nodes the SLO planner moved (router/planner.py)
    kvbridge_time_to_first_token_seconds            router received the request -> first token handed to the client
    kvbridge_inter_token_latency_seconds            gaps between consecutive token-bearing responses to a client
    kvbridge_request_duration_seconds               router received the request -> its end, any outcome

and read from the pool when scraped (NodeCollector):

    kvbridge_router_node_up{role,address}                    1 while the node's last health report was SERVING
    kvbridge_router_node_outstanding_requests{role,address}  requests routed to the node and not finished
    kvbridge_router_requests_in_flight                       client requests held by the router now
    kvbridge_router_draining                                 1 while the router is draining
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbridge.common.metrics import OUTCOMES, PD_OUTCOMES, RouterMetrics
from kvbridge.router.local_prefill import Decision
from kvbridge.router.pool import NodePool

RETRY_REASONS = ("unavailable", "resource_exhausted", "deadline_exceeded")  # the retried status codes, lowercased
TIMEOUTS = ("first_token", "idle_stream")
# what ends a stream that is then migrated: a status code of the node, lowercased, or a router timeout
MIGRATION_REASONS = ("unavailable", "unknown", "internal", "deadline_exceeded", "resource_exhausted", *TIMEOUTS)
RESYNC_REASONS = ("gap", "error", "lagged", "overflow")


class Recorder:
    """One router's registry; the dispatcher calls these hooks as its requests move on."""

    def __init__(self, pool: NodePool, draining: Callable[[], bool], in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.series = RouterMetrics(self.registry)
        for outcome in OUTCOMES:  # every outcome is exported from the start, at 0
            self.series.requests.labels(outcome)
        self.retries, self.timeouts = self.series.retries, self.series.timeouts
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for timeout in TIMEOUTS:
            self.timeouts.labels(timeout)
        self.migrations = self.series.migrations
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason)
        self.pd_decisions = self.series.pd_decisions
        for outcome in PD_OUTCOMES:  # (a fleet silently serving without its prefill nodes shows as fallback > 0)
            self.pd_decisions.labels(outcome)
        self.local_prefill = Counter(
            "kvbridge_router_local_prefill_decisions",
            "Disaggregated attempts by who computes the prompt: local (the decode node, while the prefill "
            "queue is long) or prefill (its prefill node), and why (router/local_prefill.py)",
            ["decision", "reason"],
            registry=self.registry,
        )
        self.prompt_tokens = self.series.prompt_tokens
        for kind in ("prefill", "colocated"):  # (and decode, from its first local prefill: router/local_prefill.py)
            self.prompt_tokens.labels(kind)
        self.routing, self.kv_resyncs = self.series.routing, self.series.kv_resyncs
        for reason in RESYNC_REASONS:
            self.kv_resyncs.labels(reason)
        self.registry.register(NodeCollector(pool, draining, in_flight))
        self.window = None  # the SLO planner's (router/planner.py Window), when it runs

    def first_token(self, seconds: float) -> None:
        self.series.ttft.observe(seconds)
        if self.window is not None:
            self.window.add("ttft", seconds)

    def token_gap(self, seconds: float) -> None:
        self.series.itl.observe(seconds)
        if self.window is not None:
            self.window.add("itl", seconds)

    def planner_switched(self, old: str, role: str, reason: str) -> None:
        self.series.planner_switches.labels(old, role, reason).inc()

    def retry(self, reason: str) -> None:
        self.retries.labels(reason).inc()

    def migrated(self, reason: str) -> None:
        self.migrations.labels(reason).inc()

    def timed_out(self, timeout: str) -> None:
        self.timeouts.labels(timeout).inc()

    def pd_decision(self, outcome: str, prompt_tokens: int = 0) -> None:
        """An attempt served `outcome` (PD_OUTCOMES, or local), its prompt of `prompt_tokens` computed accordingly."""
        self.pd_decisions.labels(outcome).inc()
        computed_by = {"disaggregated": "prefill", "local": "decode"}.get(outcome, "colocated")
        self.prompt_tokens.labels(computed_by).inc(prompt_tokens)

    def local_prefill_decided(self, decision: Decision) -> None:
        self.local_prefill.labels(decision.label, decision.reason).inc()

    def routed(self, role: str, policy: str, reason: str) -> None:
        self.routing.labels(role, policy, reason).inc()

    def kv_resync(self, reason: str) -> None:
        self.kv_resyncs.labels(reason).inc()

    def ended(self, outcome: str, seconds: float) -> None:
        self.series.requests.labels(outcome).inc()
        self.series.e2e.observe(seconds)


class NodeCollector(Collector):
    """Gauges read when scraped: each node's health and load, the router's requests and draining."""

    def __init__(self, pool: NodePool, draining: Callable[[], bool], in_flight: Callable[[], int]):
        self.pool, self.draining, self.in_flight = pool, draining, in_flight

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["role", "address"]
        up = GaugeMetricFamily(
            "kvbridge_router_node_up", "1 while the node's last health report was SERVING", labels=labels
        )
        outstanding = GaugeMetricFamily(
            "kvbridge_router_node_outstanding_requests", "Requests routed to the node and not finished", labels=labels
        )
        for node in self.pool.nodes:
            up.add_metric([node.role, node.address], 1 if node.healthy else 0)
            outstanding.add_metric([node.role, node.address], node.outstanding)
        in_flight = GaugeMetricFamily("kvbridge_router_requests_in_flight", "Client requests held by the router")
        in_flight.add_metric([], self.in_flight())
        draining = GaugeMetricFamily("kvbridge_router_draining", "1 while the router is draining (admits nothing new)")
        draining.add_metric([], 1 if self.draining() else 0)
        return [up, outstanding, in_flight, draining]
