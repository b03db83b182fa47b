"""The fleet seen from outside, on real processes: the demo's fleet (router, prefill node pp 2,
decode node pp 2) with /metrics on, the demo's chat traffic through it, a real Prometheus
server (Debian's package) scraping all three while it runs, and promtool on every process's
/metrics after it."""

from __future__ import annotations

import threading
from urllib.request import urlopen

import pytest

from kvbridge.demo import QUESTIONS, run_traffic, start_fleet
from kvbridge.engine.config import EngineConfig
from tests.prom import PrometheusServer, check_metrics, prometheus_path, promtool_path


@pytest.fixture(scope="module")
def fleet():
    prometheus_path(), promtool_path()  # installed (or the module skipped, saying why) before anything starts
    prefill, decode, router = start_fleet(EngineConfig(model="tiny-random", kv_cache_tokens=8192), 2, 2, metrics=True)
    yield prefill, decode, router
    for s in (router, decode, prefill):
        s.stop()


def scrape(port: int) -> str:
    return urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_prometheus_scrapes_the_fleet_during_demo_traffic_and_answers_ttft_p50(fleet):
    prefill, decode, router = fleet
    targets = {
        "kvbridge-router": [f"127.0.0.1:{router.metrics_port}"],
        "kvbridge-prefill": [f"127.0.0.1:{prefill.metrics_port}"],
        "kvbridge-decode": [f"127.0.0.1:{decode.metrics_port}"],
    }
    with PrometheusServer(targets, scrape_interval="1s") as prom:
        prom.wait_for('count(up{job=~"kvbridge-.*"} == 1) == 3')  # all three scraped before the traffic
        answers: list = []
        traffic = threading.Thread(
            target=lambda: [
                answers.extend(run_traffic(router.port, len(QUESTIONS), 24, progress=False)) for _ in range(3)
            ]
        )
        traffic.start()  # three rounds of the demo's questions while Prometheus scrapes
        p50 = prom.wait_for(
            "histogram_quantile(0.5, sum(rate(kvbridge_time_to_first_token_seconds_bucket[1m])) by (le)) > 0",
            timeout=60,
        )
        traffic.join(120)
        # 24 tokens each, or fewer where tiny-random's text reached its EOS
        assert len(answers) == 3 * len(QUESTIONS) and all(0 < a["tokens"] <= 24 for a in answers)
        short = sum(a["tokens"] < 24 for a in answers)
        value = float(p50[0]["value"][1])
        assert 0 < value < 60, p50  # a number, within the histogram's finite buckets
        # the ranks' series arrive too: prefill ranks pushed KV, decode ranks received it
        sent = prom.wait_for('sum(kvbridge_kv_transfer_bytes_total{job="kvbridge-prefill"}) > 0')
        assert float(sent[0]["value"][1]) > 0
        served = prom.wait_for(
            f'sum(kvbridge_router_requests_total{{outcome=~"length|stop"}}) >= {len(answers)}', timeout=30
        )
        assert float(served[0]["value"][1]) == len(answers)
        by_length = prom.wait_for('sum(kvbridge_router_requests_total{outcome="length"}) >= 0', timeout=30)
        assert float(by_length[0]["value"][1]) == len(answers) - short


def test_promtool_accepts_every_process_metrics_after_traffic(fleet):
    prefill, decode, router = fleet
    answers = run_traffic(router.port, 4, 8, progress=False)
    assert [a["tokens"] for a in answers] == [8] * 4
    for name, port in (
        ("router", router.metrics_port),
        ("prefill", prefill.metrics_port),
        ("decode", decode.metrics_port),
    ):
        body = scrape(port)
        check_metrics(body)
        assert "kvbridge_" in body, name
    p_body, d_body = scrape(prefill.metrics_port), scrape(decode.metrics_port)
    # both prefill ranks pushed their layers' pages; both decode ranks timed their arrivals
    for rank in ("0", "1"):
        assert f'kvbridge_kv_transfer_bytes_total{{rank="{rank}"}}' in p_body
        assert f'kvbridge_kv_transfer_duration_seconds_count{{rank="{rank}"}}' in d_body
    assert 'kvbridge_consensus_decisions_total{stream="prefill_transferred",verdict="ready"}' in p_body
    assert 'kvbridge_consensus_decisions_total{stream="decode_transferred",verdict="ready"}' in d_body
