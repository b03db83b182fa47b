"""Prometheus metrics of every kvbridge process, named by the Prometheus conventions
(prefix `kvbridge_`, base units, `_total` on counters, few and low-cardinality labels).

Every series is defined here; in each process one recorder counts them (the only code that
touches them), fed events by the code it serves:
- a node's front process (`NodeMetrics`, one registry per node; serving/metrics.py NodeRecorder):
  requests by outcome, aborts, latencies seen by the node; queue lengths, KV pages and rank
  liveness are read from the node when scraped (`StatusCollector`);
- its rank processes (`RankMetrics`; pipeline/metrics.py RankRecorder): KV transfer bytes,
  durations and failures, consensus rounds, decisions, prefill chunk sizes, retractions. Ranks
  are separate processes, so they write prometheus-client's multiprocess files into the node's
  own directory (`init_rank_metrics`), which the front's registry reads on every scrape;
- the router (`RouterMetrics`; router/metrics.py Recorder): client-facing latencies (TTFT,
  inter-token, end to end), requests by outcome, retries, per-node health and load.

`MetricsServer` serves a registry's text format at /metrics on its own port.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbridge.common import rpc

disable_created_metrics()  # no `_created` series: start times say nothing a dashboard uses

# seconds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROUND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# tokens
CHUNK_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

OUTCOMES = ("stop", "length", "abort", "error")  # label values of kvbridge_requests_total{outcome}
PD_OUTCOMES = ("disaggregated", "colocated", "fallback")  # of kvbridge_router_pd_decisions_total{outcome}


def outcome_of(finish_reason: str, error: str = "") -> str:
    """The low-cardinality outcome label of a finished request: how it ended, or "error"."""
    if finish_reason in ("stop", "length", "abort") and not (error and finish_reason != "abort"):
        return finish_reason
    return "error"


def failure_reason(reason: str) -> str:
    """A transfer failure's free-text reason, reduced to a label value."""
    text = reason.lower()
    for label, words in (
        ("aborted", ("abort",)),
        ("injected", ("injected",)),
        ("timeout", ("timeout", "timed out", "deadline")),
        ("peer", ("unavailable", "connect", "closed", "reset", "unreachable")),
        ("mismatch", ("layout", "disagree", "page", "says", "range", "fit")),
    ):
        if any(w in text for w in words):
            return label
    return "other"


class NodeMetrics:
    """A node front's own series, in a registry of its own (several nodes may share a process)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter("kvbridge_requests", "Requests that ended, by outcome", ["outcome"], registry=r)
        self.aborts = Counter("kvbridge_aborts", "Requests aborted, by who asked", ["source"], registry=r)
        self.prompt_tokens = Counter("kvbridge_prompt_tokens", "Prompt tokens of requests that ended", registry=r)
        self.generation_tokens = Counter(
            "kvbridge_generation_tokens", "Tokens generated for requests that ended", registry=r
        )
        self.ttft = Histogram(
            "kvbridge_node_time_to_first_token_seconds",
            "From the node receiving a request to its first token leaving the node",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvbridge_node_request_duration_seconds",
            "From the node receiving a request to its end there",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.invariant_violations = Counter(
            "kvbridge_invariant_violations", "Broken invariants found by the node's checks (see logs)", registry=r
        )
        self.timeouts = Counter(
            "kvbridge_timeouts", "Requests ended by a timeout, by which one", ["timeout"], registry=r
        )


class RankMetrics:
    """Series counted inside rank processes (multiprocess files; see init_rank_metrics)."""

    def __init__(self, registry: CollectorRegistry | None):
        r = registry
        kw = {"registry": r} if r is not None else {}
        self.transfer_bytes = Counter(
            "kvbridge_kv_transfer_bytes", "KV cache bytes moved between nodes, by rank", ["rank"], **kw
        )
        self.transfer_duration = Histogram(
            "kvbridge_kv_transfer_duration_seconds",
            "Per request and rank: from the route being known to the rank's last KV page landing",
            ["rank"],
            buckets=TRANSFER_BUCKETS,
            **kw,
        )
        self.push_seconds = Counter(
            "kvbridge_kv_push_seconds",
            "Time a prefill rank spent writing KV pages to decode ranks (the push itself, not the prefill it "
            "overlaps), by rank: kvbridge_kv_transfer_bytes over it is the push's bytes per second",
            ["rank"],
            **kw,
        )
        self.handoff = Histogram(
            "kvbridge_kv_handoff_seconds",
            "Per request, prefill node: from its prompt computed and its route known to every rank's pushes "
            "landing (what the hand-off adds after prefill)",
            buckets=TRANSFER_BUCKETS,
            **kw,
        )
        self.transfer_failures = Counter(
            "kvbridge_kv_transfer_failures", "KV transfers that failed on a rank, by reason", ["rank", "reason"], **kw
        )
        self.rounds = Counter("kvbridge_consensus_rounds", "Consensus rounds completed round the ring", **kw)
        self.round_duration = Histogram(
            "kvbridge_consensus_round_duration_seconds",
            "One consensus round: rank 0 sending it to its result coming back",
            buckets=ROUND_BUCKETS,
            **kw,
        )
        self.verdicts = Counter(
            "kvbridge_consensus_decisions",
            "Consensus decisions taken, by stream and verdict",
            ["stream", "verdict"],
            **kw,
        )
        self.decisions = Counter(
            "kvbridge_scheduler_decisions", "Ordered scheduler decisions sent to every rank, by kind", ["kind"], **kw
        )
        self.retractions = Counter(
            "kvbridge_retractions", "Decoding requests retracted (KV to host memory) under memory pressure", **kw
        )
        self.chunk_tokens = Histogram(
            "kvbridge_prefill_chunk_tokens", "Prompt tokens computed per prefill chunk", buckets=CHUNK_BUCKETS, **kw
        )
        self.cache_hit_tokens = Counter(
            "kvbridge_prefix_cache_hit_tokens", "Prompt tokens found in the node's prefix cache (not computed)", **kw
        )
        self.cache_query_tokens = Counter(
            "kvbridge_prefix_cache_query_tokens", "Prompt tokens looked up in the node's prefix cache", **kw
        )
        self.cache_evictions = Counter(
            "kvbridge_prefix_cache_evicted_pages", "Cached pages evicted to make room (LRU, unused ones only)", **kw
        )
        self.pages_skipped = Counter(
            "kvbridge_kv_transfer_pages_skipped",
            "Decode node: prompt pages not moved because its prefix cache held them",
            **kw,
        )
        self.rooms_revoked = Counter(
            "kvbridge_kv_rooms_revoked",
            "Prefill node: rooms of requests that ended early dropped by a rank's sender, by rank (no write "
            "into them was under way any more)",
            ["rank"],
            **kw,
        )
        self.quarantine_releases = Counter(
            "kvbridge_kv_quarantine_releases",
            "Decode node: failed hand-offs whose pages left the quarantine, by reason (revoked: by the prefill "
            "node; prefill_gone: its process died; timeout: it never confirmed, see logs; shutdown)",
            ["reason"],
            **kw,
        )


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter(
            "kvbridge_router_requests", "Client requests that ended, by outcome", ["outcome"], registry=r
        )
        self.retries = Counter(
            "kvbridge_router_retries", "Requests retried on another node, by reason", ["reason"], registry=r
        )
        self.migrations = Counter(
            "kvbridge_router_migrations",
            "Streams moved to another node pair after tokens reached the client, by the failure's reason",
            ["reason"],
            registry=r,
        )
        self.timeouts = Counter(
            "kvbridge_router_timeouts",
            "Requests whose upstream calls the router cancelled for its own timeouts",
            ["timeout"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvbridge_time_to_first_token_seconds",
            "From the router receiving a request to the first token reaching the client",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvbridge_inter_token_latency_seconds",
            "Gaps between consecutive tokens sent to a client",
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvbridge_request_duration_seconds",
            "From the router receiving a request to its last response",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.routing = Counter(
            "kvbridge_router_routing_decisions",
            "Nodes chosen for requests, by role, routing policy and why that node",
            ["role", "policy", "reason"],
            registry=r,
        )
        self.pd_decisions = Counter(
            "kvbridge_router_pd_decisions",
            "Attempts by how they were served: disaggregated (a prefill and a decode node), colocated (a "
            "colocated node chosen), fallback (a colocated node because no prefill node could take it)",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvbridge_router_prompt_tokens",
            "Prompt tokens of the attempts routed, by the kind of node that computes them: prefill (a "
            "disaggregated pair's prefill node) or colocated (a colocated node, fallbacks included); a "
            "prefill fleet left idle while colocated nodes compute prompts shows here",
            ["computed_by"],
            registry=r,
        )
        self.planner_switches = Counter(
            "kvbridge_planner_switches",
            "Elastic nodes the SLO planner moved, by their role before and after and the SLO missed (ttft, itl)",
            ["from", "to", "reason"],
            registry=r,
        )
        self.kv_resyncs = Counter(
            "kvbridge_router_kv_event_resyncs",
            "KV event streams re-opened for a fresh snapshot, by why",
            ["reason"],
            registry=r,
        )


# ---------------------------------------------------------------------- rank processes


def init_rank_metrics(directory: str) -> RankMetrics:
    """In a rank process, before any rank series is touched: write them to `directory`'s
    multiprocess files (the node front reads them). The mode is switched here rather than
    by the environment at import, so the order of imports in the rank does not matter."""
    from prometheus_client import values

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.MultiProcessValue()
    return RankMetrics(None)  # the default registry: in multiprocess mode it is never served here


class RankFiles:
    """A node's directory of rank metric files: fresh at start, removed at shutdown."""

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="kvbridge-metrics-")

    def collector(self, registry: CollectorRegistry) -> None:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry, path=self.path)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# ---------------------------------------------------------------------- read at scrape time


# A request counts as waiting, for the gateway gauges below, in the queues where it waits to be
# computed on this node: the scheduler's waiting queue, choices waiting for their prompt, and a
# decode node's prealloc, transfer and retracted queues. (A prefill node's bootstrap and inflight
# queues hold requests whose prompt is computed: their pages count in the KV usage, not here.)
WAITING_QUEUES = ("waiting", "forked", "prealloc", "transfer", "retracted")


class StatusCollector(Collector):
    """Gauges read from a node's status when scraped: queues, KV pages per rank, rank liveness,
    transfers in flight, draining. `status()` returns the dict of node_status (or raises).

    With `model` (the served model's name) and `page_size`, also the gauges the Kubernetes inference
    gateway's model-server protocol reads, under vLLM's names (its endpoint picker's default,
    pod label llm-d.ai/engine-type: vllm) and with vLLM's meaning: vllm:num_requests_running (the
    scheduler's running batch), vllm:num_requests_waiting (WAITING_QUEUES), vllm:kv_cache_usage_perc
    (pages held by requests over the pool, 0 to 1; idle prefix-cache pages count as free, as
    vLLM's evictable blocks do) and vllm:cache_config_info{block_size,num_gpu_blocks}."""

    def __init__(self, status: Callable[[], dict], model: str = "", page_size: int = 0):
        self.status = status
        self.model, self.page_size = model, page_size

    def collect(self) -> Iterable[GaugeMetricFamily]:
        try:
            st = self.status()
        except Exception:
            return []
        queue = GaugeMetricFamily("kvbridge_queue_requests", "Requests in each queue of the node", labels=["queue"])
        for name, n in sorted(st["queues"].items()):
            queue.add_metric([name], n)
        used = GaugeMetricFamily("kvbridge_kv_pages_used", "KV cache pages in use, per rank", labels=["rank"])
        total = GaugeMetricFamily("kvbridge_kv_pages", "KV cache pages in the pool, per rank", labels=["rank"])
        up = GaugeMetricFamily("kvbridge_rank_up", "1 while the rank process is alive", labels=["rank"])
        for r in st["ranks"]:
            used.add_metric([str(r["rank"])], r["kv_pages_used"])
            total.add_metric([str(r["rank"])], r["kv_pages_total"])
            up.add_metric([str(r["rank"])], 1 if r["alive"] else 0)
        transfers = GaugeMetricFamily("kvbridge_kv_transfers_in_flight", "Requests whose KV is moving now")
        transfers.add_metric([], st["transfers_in_flight"])
        inflight = GaugeMetricFamily("kvbridge_requests_in_flight", "Requests held by the node, every phase")
        inflight.add_metric([], st["requests_in_flight"])
        draining = GaugeMetricFamily("kvbridge_draining", "1 while the node is draining (admits nothing new)")
        draining.add_metric([], 1 if st["draining"] else 0)
        families = [queue, used, total, up, transfers, inflight, draining]
        cache = st.get("prefix_cache")
        if cache and cache["enabled"]:
            pages = GaugeMetricFamily(
                "kvbridge_prefix_cache_pages", "Pages indexed by the prefix cache, by state", labels=["state"]
            )
            pages.add_metric(["in_use"], cache["cached_pages"] - cache["idle_pages"])
            pages.add_metric(["idle"], cache["idle_pages"])
            families.append(pages)
        if self.model:
            families += self._gateway(st)
        return families

    def _gateway(self, st: dict) -> list[GaugeMetricFamily]:
        label, queues = [self.model], st["queues"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in the running batch (vLLM's meaning)", labels=["model_name"]
        )
        running.add_metric(label, queues.get("running", 0))
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Requests waiting to be computed on this node (vLLM's meaning; kvbridge_queue_requests has each queue)",
            labels=["model_name"],
        )
        waiting.add_metric(label, sum(queues.get(q, 0) for q in WAITING_QUEUES))
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV cache pages held by requests, 0 to 1 (vLLM's meaning)",
            labels=["model_name"],
        )
        usage.add_metric(label, st["pages_used"] / st["pages_total"] if st["pages_total"] else 0.0)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's page size (block_size, tokens) and pages (num_gpu_blocks); value 1",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        info.add_metric([self.model, str(self.page_size), str(st["pages_total"])], 1)
        return [running, waiting, usage, info]


# ---------------------------------------------------------------------- /metrics


class MetricsServer:
    """GET /metrics (the registry's text format) on host:port; port 0 picks a free one. HTTPS with
    the process's TLS (common/security.py), asking for a client certificate under mutual TLS."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry):
        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # seconds a connection may take per read (the TLS handshake included)

            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args) -> None:
                pass

        # a refused handshake (plaintext, no or a foreign certificate) only ends its connection
        quiet = {"daemon_threads": True, "handle_error": lambda self, request, address: None}
        server_cls = type("Server", (ThreadingHTTPServer,), quiet)
        try:
            self.server = server_cls((host, port), Handler)
        except OSError as e:
            raise ValueError(f"cannot bind {host}:{port} for metrics: {e.strerror or e}") from None
        tls = rpc.security().server_context()
        if tls is not None:  # the handshake runs on the connection's thread, not the accepting one
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.port = self.server.server_address[1]
        self.address = f"{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvbridge-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
