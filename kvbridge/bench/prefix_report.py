"""bench prefix's figures from the client's turn records and the nodes' counter deltas (see
kvbridge/bench/prefix.py for what each one means). Pure: no I/O, no clock."""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvbridge.bench.prefix_load import TurnRecord

GOALS = {  # summary key -> (comparison, bound)
    "prefill_tokens_computed_reduction_pct": (">=", 80.0),
    "ttft_p50_reduction_pct": (">=", 60.0),
    "itl_p99_change_pct": ("<=", 10.0),
}


def percentile_ms(values: list[float], q: float) -> float | None:
    """The q-th percentile (numpy linear) of seconds, in ms rounded to 3 places; None when empty."""
    return round(float(np.percentile(np.asarray(values) * 1000, q)), 3) if values else None


def counter_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {r: {k: after[r][k] - before[r][k] for k in after[r]} for r in after}


def on_prefix_node(records: list[TurnRecord], page_size: int) -> float | None:
    """Of turns >= 2 following an ok turn: the share with cached_tokens >= the previous prompt's full pages."""
    by = {(r.conversation, r.turn): r for r in records}
    later = [(r, by[(r.conversation, r.turn - 1)]) for r in records if r.ok and r.turn >= 2]
    later = [(r, prev) for r, prev in later if prev.ok]
    if not later:
        return None
    hits = sum(r.cached_tokens >= prev.prompt_tokens // page_size * page_size for r, prev in later)
    return round(hits / len(later), 4)


def _rate(hit: float, query: float) -> float | None:
    return round(hit / query, 4) if query else None


def mode_row(head: dict, records: list[TurnRecord], duration: float, delta: dict, page_size: int) -> dict:
    done = [r for r in records if r.ok]
    p, d = delta["prefill"], delta["decode"]
    prompt, cached = sum(r.prompt_tokens for r in done), sum(r.cached_tokens for r in done)
    computed = p["query"] - p["hit"] if p["query"] else prompt
    return head | {
        "requests": len(done),
        "failed": len(records) - len(done),
        "failed_by_reason": dict(sorted(Counter(r.error for r in records if not r.ok).items())),
        "duration_s": round(duration, 3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_query_tokens": int(p["query"]),
        "prefill_hit_tokens": int(p["hit"]),
        "prefix_cache_hit_rate": _rate(p["hit"], p["query"]),
        "decode_hit_rate": _rate(d["hit"], d["query"]),
        "prefill_tokens_computed": int(computed),
        "kv_bytes_moved": int(p["kv_bytes"]),
        "transfer_kv_bytes": sum(r.kv_bytes for r in done),
        "decode_pages_skipped": int(d["skipped"]),
        "evicted_pages": int(p["evicted"] + d["evicted"]),
        "ttft_p50_ms": percentile_ms([r.ttft for r in done], 50),
        "ttft_p99_ms": percentile_ms([r.ttft for r in done], 99),
        "itl_p50_ms": percentile_ms([g for r in done for g in r.itl], 50),
        "itl_p99_ms": percentile_ms([g for r in done for g in r.itl], 99),
        "output_throughput": round(sum(r.completion_tokens for r in done) / duration, 3) if duration > 0 else None,
        "later_turns_on_prefix_node": on_prefix_node(records, page_size),
    }


def change_pct(a, b) -> float | None:
    """100 * (a / b - 1), rounded to 2 places; None without both or with b == 0."""
    return round(100 * (a / b - 1), 2) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def summary(rows: list[dict]) -> dict:
    by = {r["mode"]: r for r in rows}
    ca, off = by.get("cache_aware", {}), by.get("cache_off", {})

    def reduction(key: str) -> float | None:
        c = change_pct(ca.get(key), off.get(key))
        return None if c is None else round(-c, 2)

    out = {
        "bench": "prefix",
        "summary": True,
        "modes": [r["mode"] for r in rows],
        "ratio_of": "cache_aware vs cache_off",
        "prefill_tokens_computed_reduction_pct": reduction("prefill_tokens_computed"),
        "ttft_p50_reduction_pct": reduction("ttft_p50_ms"),
        "itl_p99_change_pct": change_pct(ca.get("itl_p99_ms"), off.get("itl_p99_ms")),
        "later_turns_on_prefix_node": ca.get("later_turns_on_prefix_node"),
    }
    goals = {}
    for key, (op, bound) in GOALS.items():
        v = out[key]
        met = None if v is None else (v >= bound if op == ">=" else v <= bound)
        goals[key] = {"goal": f"{op} {bound:g}", "met": met}
    out["goals"] = goals
    out["goals_met"] = None if any(g["met"] is None for g in goals.values()) else all(g["met"] for g in goals.values())
    return out


def text_of(row: dict) -> str:
    if row.get("summary"):
        goals = [f"{k} {row[k]} ({g['goal']}: {'met' if g['met'] else 'NOT met'})" for k, g in row["goals"].items()]
        later = row["later_turns_on_prefix_node"]
        return f"summary, cache_aware vs cache_off: {', '.join(goals)}; later turns on prefix node {later}"
    return (
        f"{row['mode']}: {row['requests']} ok, {row['failed']} failed; hit rate {row['prefix_cache_hit_rate']}, "
        f"prefill tokens {row['prefill_tokens_computed']}, KV {row['kv_bytes_moved'] / 1e6:.1f} MB, "
        f"pages skipped {row['decode_pages_skipped']}; TTFT p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, "
        f"ITL p50/p99 {row['itl_p50_ms']}/{row['itl_p99_ms']} ms, {row['output_throughput']} tok/s; "
        f"later turns on prefix node {row['later_turns_on_prefix_node']}"
    )
