"""The metrics as Prometheus sees them: promtool accepts a /metrics body, a real Prometheus scrapes
one and computes a quantile from it, and the shipped scrape config and Grafana dashboard are valid
and use only series kvbridge defines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvbridge.common.metrics import MetricsServer, NodeMetrics, RankFiles, RankMetrics, RouterMetrics, StatusCollector
from tests.prom import PrometheusServer, check_config, check_metrics, check_promql

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvbridge.json"

STATUS = {
    "queues": {"running": 2, "waiting": 1},
    "ranks": [
        {"rank": 0, "alive": True, "kv_pages_used": 12, "kv_pages_total": 2048},
        {"rank": 1, "alive": False, "kv_pages_used": 12, "kv_pages_total": 2048},
    ],
    "transfers_in_flight": 1,
    "requests_in_flight": 3,
    "draining": False,
    "prefix_cache": {"enabled": True, "cached_pages": 10, "idle_pages": 4},
}

# What a rank process counts, written to the node's multiprocess files as a real rank does.
RANK_SCRIPT = """
import sys
from kvbridge.common.metrics import init_rank_metrics

m = init_rank_metrics(sys.argv[1])
m.transfer_bytes.labels("0").inc(4096)
m.transfer_duration.labels("0").observe(0.003)
m.transfer_failures.labels("0", "timeout").inc()
m.rounds.inc(5)
m.round_duration.observe(0.0004)
m.verdicts.labels("prefill", "ready").inc()
m.decisions.labels("admit").inc(2)
m.chunk_tokens.observe(64)
"""

# The router's gauges read at scrape time (router/metrics.py NodeCollector), not in common/metrics.py.
ROUTER_NODE_GAUGES = {
    "kvbridge_router_node_up",
    "kvbridge_router_node_outstanding_requests",
    "kvbridge_router_requests_in_flight",
    "kvbridge_router_draining",
}


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


@pytest.fixture
def rank_files():
    files = RankFiles()
    subprocess.run([sys.executable, "-c", RANK_SCRIPT, files.path], cwd=ROOT, check=True, timeout=60)
    yield files
    files.close()


def test_promtool_accepts_a_node_and_router_metrics_page(rank_files):
    registry = CollectorRegistry()
    node, router = NodeMetrics(registry), RouterMetrics(registry)
    registry.register(StatusCollector(lambda: STATUS))
    rank_files.collector(registry)
    node.requests.labels("stop").inc()
    node.aborts.labels("client").inc()
    node.timeouts.labels("transfer").inc()
    node.ttft.observe(0.02)
    node.e2e.observe(0.4)
    router.requests.labels("length").inc()
    router.ttft.observe(0.03)
    router.itl.observe(0.004)
    router.e2e.observe(1.5)
    server = MetricsServer("127.0.0.1", 0, registry)
    try:
        body = get(f"http://{server.address}/metrics")
    finally:
        server.stop()
    check_metrics(body)
    lines = set(body.splitlines())
    for line in [
        'kvbridge_requests_total{outcome="stop"} 1.0',
        'kvbridge_router_requests_total{outcome="length"} 1.0',
        'kvbridge_queue_requests{queue="running"} 2.0',
        'kvbridge_kv_pages_used{rank="1"} 12.0',
        'kvbridge_rank_up{rank="1"} 0.0',
        'kvbridge_prefix_cache_pages{state="in_use"} 6.0',
        'kvbridge_prefix_cache_pages{state="idle"} 4.0',
        'kvbridge_time_to_first_token_seconds_bucket{le="0.05"} 1.0',
        # from the rank process's files
        'kvbridge_kv_transfer_bytes_total{rank="0"} 4096.0',
        'kvbridge_kv_transfer_failures_total{rank="0",reason="timeout"} 1.0',
        "kvbridge_consensus_rounds_total 5.0",
        'kvbridge_scheduler_decisions_total{kind="admit"} 2.0',
        'kvbridge_prefill_chunk_tokens_bucket{le="64.0"} 1.0',
    ]:
        assert line in lines, line


def test_promtool_checks_fail_on_bad_input():
    with pytest.raises(pytest.fail.Exception, match='should have "_total" suffix'):
        check_metrics("# HELP foo_count x\n# TYPE foo_count counter\nfoo_count 1\n")
    with pytest.raises(pytest.fail.Exception, match="bad_rule"):
        check_promql({"good_rule": "sum(rate(x_total[1m]))", "bad_rule": "sum(rate(x_total[1m])"})


def test_prometheus_scrapes_a_metrics_server_and_computes_the_ttft_median():
    registry = CollectorRegistry()
    router = RouterMetrics(registry)
    server = MetricsServer("127.0.0.1", 0, registry)
    try:
        with PrometheusServer({"kvbridge-router": [server.address]}) as prom:
            prom.wait_for('kvbridge_time_to_first_token_seconds_count{job="kvbridge-router"}')  # a first, empty scrape
            for seconds in (0.03, 0.04, 0.07):
                router.ttft.observe(seconds)
            prom.wait_for("kvbridge_time_to_first_token_seconds_count == 3")
            [sample] = prom.query(
                "histogram_quantile(0.5, sum(rate(kvbridge_time_to_first_token_seconds_bucket[1m])) by (le))"
            )
    finally:
        server.stop()
    p50 = float(sample["value"][1])
    # cumulative buckets: le=0.025 -> 0, le=0.05 -> 2, le=0.1 -> 3. The median's rank 1.5 falls in
    # (0.025, 0.05], 1.5 of its 2 observations in: 0.025 + 0.025 * 1.5 / 2 (rates scale every bucket alike)
    assert 0.025 < p50 <= 0.05
    assert p50 == pytest.approx(0.04375, rel=1e-9)


# ---------------------------------------------------------------------- deploy/


def test_scrape_config_passes_promtool():
    check_config(ROOT / "deploy" / "prometheus.yml")


def defined_series() -> set[str]:
    """Every series name kvbridge can expose: its metric classes' and StatusCollector's families, the
    router's node gauges, and Prometheus's own `up`."""
    registry = CollectorRegistry()
    NodeMetrics(registry)
    RouterMetrics(registry)
    RankMetrics(registry)
    registry.register(StatusCollector(lambda: STATUS))
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}
    names = {f.name + s for f in registry.collect() for s in suffixes.get(f.type, ("",))}
    return names | ROUTER_NODE_GAUGES | {"up"}


PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label matchers,
    range selectors and grouping clauses are removed, that are not followed by `(` (functions,
    aggregations) and are not keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    return set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", e)) - PROMQL_WORDS


def all_panels(panels: list[dict]) -> list[dict]:
    """Panels, and those inside collapsed rows."""
    return [q for p in panels for q in (p, *all_panels(p.get("panels", [])))]


def dashboard_exprs() -> dict[str, str]:
    """{"panel_<id>_<refId>": expr} of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = all_panels(dashboard["panels"])
    return {f"panel_{p['id']}_{t['refId']}": t["expr"] for p in panels for t in p.get("targets", [])}


def test_dashboard_is_importable_and_queries_only_defined_series():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] == 39 and dashboard["uid"] == "kvbridge"
    [ds] = dashboard["templating"]["list"]
    assert (ds["name"], ds["type"], ds["query"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    panels = all_panels(dashboard["panels"])
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
            assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]

    defined = defined_series()
    used = set()
    for key, expr in dashboard_exprs().items():
        names = metric_names(expr)
        assert names, f"{key}: no metric in {expr!r}"
        assert names <= defined, f"{key}: {sorted(names - defined)} not defined by kvbridge, in {expr!r}"
        used |= names
    assert used >= {
        "kvbridge_router_requests_total",
        "kvbridge_time_to_first_token_seconds_bucket",
        "kvbridge_inter_token_latency_seconds_bucket",
        "kvbridge_request_duration_seconds_bucket",
        "kvbridge_queue_requests",
        "kvbridge_kv_pages_used",
        "kvbridge_kv_pages",
        "kvbridge_kv_transfer_bytes_total",
        "kvbridge_kv_transfer_duration_seconds_bucket",
        "kvbridge_kv_transfer_failures_total",
        "kvbridge_aborts_total",
        "kvbridge_timeouts_total",
        "kvbridge_retractions_total",
        "kvbridge_consensus_round_duration_seconds_bucket",
        "kvbridge_consensus_rounds_total",
        "kvbridge_router_node_up",
        "kvbridge_rank_up",
    }


def test_dashboard_queries_parse_as_promql():
    check_promql(dashboard_exprs())


def test_metric_names_of_an_expression():
    expr = 'histogram_quantile(0.9, sum by (le, job) (rate(a_bucket{job=~"x.*"}[1m]))) / on(job) b * 1e9 > bool c'
    assert metric_names(expr) == {"a_bucket", "b", "c"}
