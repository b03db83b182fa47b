"""The Kubernetes inference gateway's model-server gauges, under vLLM's names (GIE's endpoint picker
reads vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc and
vllm:cache_config_info by default), on every node's /metrics, scraped by a real Prometheus under
load, each sample checked against the node's own Admin status at the moment it was scraped.

Load: a prefill and a decode node, and a colocated node, with a step delay (and the colocated node
two requests at most in its running batch), so that requests run, wait and hold pages for seconds;
four streams on each. A thread reads every node's GetStatus every 50 ms; a Prometheus sample is checked where
the status read just before and just after its scrape time agree (the state did not move)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from kvbridge.common import rpc
from kvbridge.common.metrics import WAITING_QUEUES
from kvbridge.engine.config import PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.pd import TINY, pd_generate, status, token_prompt, wait_idle
from tests.prom import PrometheusServer, check_metrics, prometheus_path

# a step takes 400 ms, the colocated node runs two requests at a time (a decode node takes each
# transferred request into its batch at once), and a 20-token prompt with its 12 tokens fits one
# 32-token page: the state holds still for most of a second at a time, long enough to be compared
LOADED = replace(TINY, page_size=32, max_running_requests=2, fault_inject="step_delay_ms=400")
STREAMS, MAX_NEW = 4, 12
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def nodes():
    prometheus_path()  # installed (or the module skipped, saying why) before anything starts
    made = {
        "prefill": start_node(
            "prefill",
            NodeConfig(replace(TINY, page_size=32, fault_inject="step_delay_ms=100"), PPConfig(), metrics_port=0),
        ),
        "decode": start_node("decode", NodeConfig(LOADED, PPConfig(), metrics_port=0)),
        "colocated": start_node("colocated", NodeConfig(LOADED, PPConfig(), metrics_port=0)),
    }
    yield made
    for n in made.values():
        n.stop()


def expected(st) -> dict[str, float]:
    """The gauges' values by the node's Admin status."""
    pages = st.ranks[0]
    return {
        "vllm:num_requests_running": st.queues.get("running", 0),
        "vllm:num_requests_waiting": sum(st.queues.get(q, 0) for q in WAITING_QUEUES),
        "vllm:kv_cache_usage_perc": pages.kv_pages_used / pages.kv_pages_total,
    }


class Watch:
    """Each node's Admin status, read over and over (a thread per node), with the wall time at the
    start and the end of each read. A read waits for rank 0 between two steps, as a scrape does."""

    SPAN_S = 0.4  # a scrape at t reads the node's state at some moment in [t, t + SPAN_S]

    def __init__(self, nodes: dict):
        self.seen: dict[str, list] = {name: [] for name in nodes}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(n, node), daemon=True) for n, node in nodes.items()]
        for t in self.threads:
            t.start()

    def _run(self, name: str, node) -> None:
        while not self.stop.is_set():
            t0 = time.time()
            st = status(node.address)
            self.seen[name].append((t0, time.time(), expected(st)))

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)

    def at(self, name: str, t: float) -> dict | None:
        """The node's state around a scrape at wall time t: every read from the last one started
        before t to the first one that ended after t + SPAN_S saw the same; None when it moved."""
        rows = self.seen[name]
        before = [r for r in rows if r[0] <= t]
        after = [r for r in rows if r[1] >= t + self.SPAN_S]
        if not before or not after:
            return None
        window = [r[2] for r in rows if before[-1][0] <= r[0] <= after[0][0]]
        return window[0] if all(w == window[0] for w in window) else None


def load(nodes: dict) -> list:
    """STREAMS streams on the pair and as many on the colocated node, at once; their token counts."""
    out: list = []

    def pair(i):
        tokens, _, _ = pd_generate(
            nodes["prefill"].address, nodes["decode"].address, token_prompt([3 + i] * 20), MAX_NEW
        )
        out.append(len(tokens))

    def colocated(i):
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(nodes["colocated"].address))
        req = generation_pb2.GenerateRequest(
            prompt=token_prompt([40 + i] * 20),
            sampling=common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
        )
        out.append(sum(len(r.token_ids) for r in stub.Generate(req, timeout=120)))

    threads = [threading.Thread(target=f, args=(i,)) for i in range(STREAMS) for f in (pair, colocated)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.mark.long  # (~25 s: the load is slowed down so that its state can be compared)
def test_the_vllm_named_gauges_equal_each_nodes_admin_status_under_load(nodes):
    targets = {f"kvbridge-{name}": [f"127.0.0.1:{n.metrics_port}"] for name, n in nodes.items()}
    with PrometheusServer(targets, scrape_interval="1s") as prom:
        prom.wait_for('count(up{job=~"kvbridge-.*"} == 1) == 3')
        watch = Watch(nodes)
        start = time.time()
        counts = load(nodes)
        time.sleep(2.5)  # two more scrapes of the idle state
        watch.join()
        assert counts == [MAX_NEW] * (2 * STREAMS)
        checked = {name: {g: 0 for g in GAUGES} for name in nodes}
        busy = {name: 0 for name in nodes}  # samples checked while requests ran there
        for name in nodes:
            for gauge in GAUGES:
                window = f"{int(time.time() - start) + 2}s"
                [series] = prom.query(f'{gauge}{{job="kvbridge-{name}",model_name="tiny-random"}}[{window}]')
                for t, value in series["values"]:
                    want = watch.at(name, float(t))
                    if want is None:
                        continue
                    assert float(value) == pytest.approx(want[gauge]), (name, gauge, t, want)
                    checked[name][gauge] += 1
                    busy[name] += gauge == "vllm:num_requests_running" and want[gauge] > 0
        assert all(n >= 3 for per in checked.values() for n in per.values()), checked
        assert busy["decode"] >= 2 and busy["colocated"] >= 2, busy  # compared while under load
        waits = prom.query('max_over_time(vllm:num_requests_waiting{job="kvbridge-colocated"}[1m])')
        assert float(waits[0]["value"][1]) >= 1  # four streams, two run at a time: the others waited
        for name, node in nodes.items():
            [info] = prom.query(f'vllm:cache_config_info{{job="kvbridge-{name}"}}')
            assert (info["metric"]["block_size"], info["metric"]["num_gpu_blocks"]) == (
                "32",
                str(wait_idle(node.address).ranks[0].kv_pages_total),
            )
            assert info["value"][1] == "1"


def test_the_gauges_pass_promtool_on_every_node(nodes):
    from urllib.request import urlopen

    for node in nodes.values():
        body = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
        check_metrics(body)
        assert 'vllm:num_requests_running{model_name="tiny-random"} 0.0' in body
        assert 'vllm:kv_cache_usage_perc{model_name="tiny-random"} 0.0' in body
