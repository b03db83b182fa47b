"""What a node's front process counts, in one place: the front (serving/front.py) and the server
report events to the node's `NodeRecorder`; only the recorder touches the series (common/metrics.py
NodeMetrics). What the ranks count is theirs (pipeline/metrics.py) and reaches the same registry
through their multiprocess files.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvbridge.common.metrics import NodeMetrics


class NodeRecorder:
    def __init__(self, registry: CollectorRegistry | None = None):
        # without a registry (a front built alone, in a test): counted where nobody serves it
        self.registry = registry or CollectorRegistry()
        self._m = NodeMetrics(self.registry)

    def aborted(self, source: str) -> None:
        """A request was aborted; source: who asked ("client", "operator", ...)."""
        self._m.aborts.labels(source).inc()

    def first_token(self, seconds: float) -> None:
        """A request's first token left the node, `seconds` after it arrived."""
        self._m.ttft.observe(seconds)

    def timed_out(self, timeout: str) -> None:
        """A request was ended by one of the node's timeouts (bootstrap, prealloc, transfer)."""
        self._m.timeouts.labels(timeout).inc()

    def finished(self, outcome: str, prompt_tokens: int, output_tokens: int, seconds: float) -> None:
        m = self._m
        m.requests.labels(outcome).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(output_tokens)
        m.e2e.observe(seconds)

    def violations(self, n: int) -> None:
        """The node's invariant checks found `n` problems (each is logged)."""
        self._m.invariant_violations.inc(n)
