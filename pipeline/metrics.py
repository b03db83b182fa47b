"""What a rank process counts, in one place: the loops, the control channel and the KV agents
report events to the rank's `RankRecorder` (made once per rank process, handed out through its
RankContext); only the recorder touches the series (common/metrics.py RankMetrics), which a rank
writes to its node's multiprocess files for the front to serve.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvbridge.common.metrics import RankMetrics, failure_reason


class RankRecorder:
    def __init__(self, series: RankMetrics | None = None):
        # without series (a part built alone, in a test): counted in a registry nobody serves
        self._m = series or RankMetrics(CollectorRegistry())
        self._cache_counts = (0, 0, 0)  # the prefix cache's (hit, query, evicted) as last counted

    # rank 0's loop
    def decided(self, kind: str) -> None:
        """An entry of the node's log went out (ADMIT, ROUTE, FINISH, ...)."""
        self._m.decisions.labels(kind).inc()

    def chunk(self, tokens: int) -> None:
        """A prefill chunk of `tokens` prompt tokens was scheduled."""
        self._m.chunk_tokens.observe(tokens)

    def retracted(self) -> None:
        self._m.retractions.inc()

    def cache_counts(self, hit_tokens: int, query_tokens: int, evicted_pages: int) -> None:
        """The prefix cache's running totals (engine/prefix_cache.py); counted as they grow."""
        now = (hit_tokens, query_tokens, evicted_pages)
        if now != self._cache_counts:
            was, self._cache_counts = self._cache_counts, now
            self._m.cache_hit_tokens.inc(now[0] - was[0])
            self._m.cache_query_tokens.inc(now[1] - was[1])
            self._m.cache_evictions.inc(now[2] - was[2])

    def pages_skipped(self, pages: int) -> None:
        """Decode node: prompt pages its prefix cache held, so they were not moved."""
        self._m.pages_skipped.inc(pages)

    # rank 0's consensus channel
    def round_done(self, seconds: float) -> None:
        self._m.rounds.inc()
        self._m.round_duration.observe(seconds)

    def ruled(self, stream: str, verdict: str) -> None:
        self._m.verdicts.labels(stream, verdict).inc()

    # every rank's KV agent
    def pushed(self, rank: int, nbytes: int) -> None:
        self._m.transfer_bytes.labels(str(rank)).inc(nbytes)

    def transfer_done(self, rank: int, seconds: float) -> None:
        self._m.transfer_duration.labels(str(rank)).observe(seconds)

    def transfer_failed(self, rank: int, reason: str) -> None:
        """reason: the backend's words (bounded to a few labels here) or "injected"."""
        label = reason if reason == "injected" else failure_reason(reason)
        self._m.transfer_failures.labels(str(rank), label).inc()
