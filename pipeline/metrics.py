"""What a rank process counts, in one place: the loops, the control channel and the KV agents
report events to the rank's `RankRecorder` (made once per rank process, handed out through its
RankContext); only the recorder touches the series (common/metrics.py RankMetrics), which a rank
writes to its node's multiprocess files for the front to serve, and records the spans of the
requests whose trace is sampled (common/tracing.py): after the fact, with the times the loops
measured, and not at all while tracing is off.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from kvbridge.common import tracing
from kvbridge.common.metrics import RankMetrics, failure_reason
from kvbridge.engine.batch import ForwardBatch


class RankRecorder:
    def __init__(self, series: RankMetrics | None = None):
        # without series (a part built alone, in a test): counted in a registry nobody serves
        self._m = series or RankMetrics(CollectorRegistry())
        self._cache_counts = (0, 0, 0)  # the prefix cache's (hit, query, evicted) as last counted
        self._traces: dict[str, str] = {}  # rid -> traceparent, for the requests this rank traces

    # tracing: every rank
    def traced(self, rid: str, trace: str) -> None:
        """The request's trace context (its ADMIT's; rank 0: its Add's): its spans go under it."""
        if trace and tracing.enabled():
            self._traces[rid] = trace

    def untraced(self, rid: str) -> None:
        self._traces.pop(rid, None)

    def trace_of(self, rid: str) -> str:
        return self._traces.get(rid, "")

    def span(self, rid: str, name: str, start_ns: int, attributes: dict, end_ns: int | None = None) -> None:
        """A finished span of the request (to now, unless `end_ns`), if it is traced."""
        if trace := self._traces.get(rid):
            tracing.record(name, trace, start_ns, end_ns or time.time_ns(), attributes)

    def forwarded(self, rank: int, batch: ForwardBatch, start_ns: int) -> None:
        """This rank computed `batch` since `start_ns`: a span for each traced request's prompt chunk."""
        if not self._traces:
            return
        end_ns = time.time_ns()
        for rid, start, q_len in zip(batch.rids, batch.starts, batch.q_lens):
            if q_len > 1 and rid in self._traces:  # (a decode step's one token: its phase's span covers it)
                where = {"kvbridge.rank": rank, "kvbridge.rid": rid, "kvbridge.start": start, "kvbridge.tokens": q_len}
                tracing.record("prefill chunk", self._traces[rid], start_ns, end_ns, where)

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

    def quarantine_released(self, reason: str) -> None:
        """Decode node: a failed hand-off's pages left the quarantine (reason: "revoked", "prefill_gone",
        "timeout", "shutdown")."""
        self._m.quarantine_releases.labels(reason).inc()

    # rank 0's consensus channel
    def round_done(self, seconds: float) -> None:
        self._m.rounds.inc()
        self._m.round_duration.observe(seconds)

    def ruled(self, stream: str, verdict: str) -> None:
        self._m.verdicts.labels(stream, verdict).inc()

    # every rank's KV agent
    def pushed(self, rank: int, nbytes: int) -> None:
        self._m.transfer_bytes.labels(str(rank)).inc(nbytes)

    def transfer_done(self, rank: int, seconds: float, push_seconds: float = 0.0) -> None:
        """The rank's pushes of a request landed, `seconds` after its route was known; `push_seconds`
        of that went to writing them (the push itself)."""
        self._m.transfer_duration.labels(str(rank)).observe(seconds)
        self._m.push_seconds.labels(str(rank)).inc(push_seconds)

    def handed_off(self, seconds: float) -> None:
        """Prefill rank 0: a request's hand-off after its prefill (routed and computed, to every push landed)."""
        self._m.handoff.observe(seconds)

    def room_revoked(self, rank: int) -> None:
        """Prefill node: the rank's sender dropped the room of a request that ended early (no write into it
        under way any more)."""
        self._m.rooms_revoked.labels(str(rank)).inc()

    def transfer_failed(self, rank: int, reason: str) -> None:
        """reason: the backend's words (bounded to a few labels here) or "injected"."""
        label = reason if reason == "injected" else failure_reason(reason)
        self._m.transfer_failures.labels(str(rank), label).inc()
