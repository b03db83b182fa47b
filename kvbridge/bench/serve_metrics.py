"""bench serve's figures from the client's request records, as `vllm bench serve` computes them
(vllm/benchmarks/serve.py calculate_metrics). Pure: no I/O, no clock.

    completed / failed          requests that streamed to [DONE] with usage / the others (by reason)
    duration                    seconds from the run's first send to its last request's end
    request_throughput          completed / duration
    request_goodput             completed requests meeting every given SLO / duration (DistServe's
                                goodput, vLLM's rule: TTFT, TPOT and E2EL each <= its SLO; a request
                                of one output token has TPOT 0); None without SLOs
    output_throughput           output tokens of completed requests / duration
    total_token_throughput      (prompt + output tokens of completed requests) / duration
    ttft                        send -> first content chunk
    tpot                        (e2el - ttft) / (output tokens - 1), requests of > 1 output token
    itl                         gaps between consecutive content chunks, all requests pooled (a chunk
                                can carry several tokens when text is held back, e.g. half a UTF-8
                                character)
    e2el                        send -> end of the stream
Each of ttft, tpot, itl, e2el as mean, median and p99 in ms (numpy's linear-interpolation
percentile, as vLLM); None when there is no value. Output tokens come from the final usage chunk.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds (perf_counter differences)."""

    ok: bool  # streamed to [DONE] with at least one content chunk and a usage chunk
    error: str = ""  # why not ok: "http_503", "stream_error:unavailable", "ReadTimeout", ... ("" when ok)
    prompt_len: int = 0  # prompt tokens: the server's usage, else the dataset's
    expected_output_len: int = 0  # max_tokens asked for (exact with ignore_eos)
    output_len: int = 0  # completion tokens of the final usage chunk
    ttft: float | None = None  # send -> first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    latency: float = 0.0  # send -> end of the stream (or the failure)
    start: float = 0.0  # send time, seconds after the run's start
    chunk_times: list[float] = field(default_factory=list)  # content chunk arrivals, seconds after the run's start

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first; 0 for a single-token answer (vLLM's goodput rule)."""
        if self.output_len <= 1 or self.ttft is None:
            return 0.0
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (ms); ValueError naming a bad item."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput items are KEY:MS with KEY in {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not 0 < ms < float("inf"):
            raise ValueError(f"--goodput {key} must be a positive number of ms, got {value!r}")
        if key in out:
            raise ValueError(f"--goodput names {key} twice")
        out[key] = ms
    return out


def is_good(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft or 0.0, "tpot": r.tpot, "e2el": r.latency}
    return all(values[k] * 1000 <= ms for k, ms in slo_ms.items())


def _ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values) * 1000
    return {
        "mean": round(float(np.mean(a)), 3),
        "median": round(float(np.median(a)), 3),
        "p99": round(float(np.percentile(a, 99)), 3),
    }


def latency_summary(name: str, values: list[float]) -> dict[str, float | None]:
    """{"mean_NAME_ms", "median_NAME_ms", "p99_NAME_ms"} of values in seconds."""
    return {f"{stat}_{name}_ms": v for stat, v in _ms(values).items()}


def compute_metrics(records: list[RequestRecord], duration: float, slo_ms: dict[str, float]) -> dict:
    done = [r for r in records if r.ok]
    failed = Counter(r.error for r in records if not r.ok)
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    good = sum(is_good(r, slo_ms) for r in done) if slo_ms else None
    out = {
        "completed": len(done),
        "failed": sum(failed.values()),
        "failed_by_reason": dict(sorted(failed.items())),
        "duration": round(duration, 3),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "expected_output_tokens": sum(r.expected_output_len for r in done),
        "output_len_mismatches": sum(r.output_len != r.expected_output_len for r in done),
        "content_chunks": sum(len(r.itl) + 1 for r in done),
        "request_throughput": round(len(done) / duration, 3),
        "request_goodput": None if good is None else round(good / duration, 3),
        "output_throughput": round(total_out / duration, 3),
        "total_token_throughput": round((total_in + total_out) / duration, 3),
    }
    out |= latency_summary("ttft", [r.ttft for r in done])
    out |= latency_summary("tpot", [r.tpot for r in done if r.output_len > 1])
    out |= latency_summary("itl", [g for r in done for g in r.itl])
    out |= latency_summary("e2el", [r.latency for r in done])
    return out
