"""kvbridge/bench/prefix.py: the prefix-cache benchmark's workload (seeded, deterministic), its figures
and summary on hand-made records (exact values), its bad flags, and (slow) one small run of every
mode on tiny-random."""

from __future__ import annotations

import itertools
import json

import pytest

from kvbridge import cli
from kvbridge.bench import prefix, prefix_report
from kvbridge.bench.prefix_load import TurnRecord, build_workload, user_range
from kvbridge.bench.prefix_report import change_pct, mode_row, on_prefix_node, percentile_ms, summary
from kvbridge.bench.serve import BenchUsageError
from kvbridge.engine.weights import tiny_random

ROW_KEYS = {
    "bench", "mode", "routing", "prefix_cache", "model", "seed", "conversations", "turns", "page_size", "turn_period_s",
    "caches_cleared", "requests", "failed", "failed_by_reason", "duration_s", "prompt_tokens", "cached_tokens",
    "prefill_query_tokens", "prefill_hit_tokens", "prefix_cache_hit_rate", "decode_hit_rate",
    "prefill_tokens_computed", "kv_bytes_moved", "transfer_kv_bytes", "decode_pages_skipped", "evicted_pages",
    "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_throughput", "later_turns_on_prefix_node",
    "routing_decisions",
}  # fmt: skip
SUMMARY_KEYS = {
    "bench", "summary", "modes", "ratio_of", "prefill_tokens_computed_reduction_pct", "ttft_p50_reduction_pct",
    "itl_p99_change_pct", "later_turns_on_prefix_node", "goals", "goals_met",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_random().tokenizer


# ---------------------------------------------------------------------------- the workload


def test_the_workload_is_fixed_by_the_seed(tokenizer):
    a = build_workload(tokenizer, 3, 4, 120, 45, 24, seed=7)
    assert a == build_workload(tokenizer, 3, 4, 120, 45, 24, seed=7)
    assert a != build_workload(tokenizer, 3, 4, 120, 45, 24, seed=8)
    assert len(a.users) == 3 and all(len(u) == 4 for u in a.users) and a.requests == 12
    assert a.output_tokens == 24
    assert len({u for conv in a.users for u in conv}) == 12  # every user message its own
    # the send schedule: first turns within one period, think times of 0.5..1.5 periods
    assert [len(s) for s in a.sends] == [4, 4, 4] and all(0 <= s[0] < 1 for s in a.sends)
    assert all(0.5 <= b - a_ <= 1.5 for s in a.sends for a_, b in itertools.pairwise(s))
    assert len({s[0] for s in a.sends}) == 3  # no two conversations in step


def test_the_workload_lengths_are_measured_and_near_their_targets(tokenizer):
    w = build_workload(tokenizer, 2, 3, 300, 45, 24, seed=0)
    assert w.system_tokens == len(tokenizer.encode(w.system))
    assert abs(w.system_tokens - 300) <= 8  # whole words: a few tokens either side
    lo, hi = user_range(45)
    for texts, lens in zip(w.users, w.user_tokens):
        for text, n in zip(texts, lens):
            assert n == len(tokenizer.encode(text))
            assert lo - 8 <= n <= hi + 8


def test_user_messages_range_over_two_thirds_to_four_thirds():
    assert user_range(45) == (30, 60)
    assert user_range(1) == (1, 1)


def test_a_conversation_over_the_context_is_a_usage_error(tokenizer):
    w = build_workload(tokenizer, 1, 2, 100, 20, 10, seed=0)
    prefix.check_context(w, 4096)
    with pytest.raises(BenchUsageError, match="context"):
        prefix.check_context(w, 100)


# ---------------------------------------------------------------------------- figures


def rec(c, t, prompt, cached, ttft, itl, ok=True, completion=4, kv=0, skipped=0, error=""):
    return TurnRecord(c, t, ok, error, prompt, cached, completion, ttft, itl, 0.1, kv, skipped)


RECORDS = [
    rec(0, 1, 100, 0, 0.010, [0.001, 0.002, 0.003], kv=1000),
    rec(0, 2, 150, 96, 0.020, [0.004, 0.005, 0.006], kv=500, skipped=6),  # 96 = 100 // 16 * 16: on its node
    rec(1, 1, 100, 80, 0.030, [0.007, 0.008, 0.009], kv=300),
    rec(1, 2, 160, 80, 0.040, [0.010, 0.011, 0.012], kv=700),  # 80 < 96: elsewhere
    rec(2, 1, 0, 0, None, [], ok=False, completion=0, error="unavailable"),
]
DELTA = {
    "prefill": {"hit": 256.0, "query": 510.0, "evicted": 1.0, "skipped": 0.0, "kv_bytes": 4096.0},
    "decode": {"hit": 32.0, "query": 64.0, "evicted": 2.0, "skipped": 5.0, "kv_bytes": 0.0},
}


def test_percentiles_are_numpys_linear_ones_in_ms():
    assert percentile_ms([0.001, 0.002, 0.003, 0.004], 50) == 2.5
    assert percentile_ms([0.001, 0.002, 0.003, 0.004], 99) == 3.97
    assert percentile_ms([0.005], 99) == 5.0
    assert percentile_ms([], 50) is None


def test_later_turns_on_prefix_node_compares_with_the_previous_prompts_full_pages():
    assert on_prefix_node(RECORDS, 16) == 0.5
    assert on_prefix_node(RECORDS, 40) == 1.0  # 100 // 40 * 40 = 80: both
    assert on_prefix_node(RECORDS, 20) == 0.0  # 100: neither
    assert on_prefix_node(RECORDS[:1], 16) is None  # no later turn
    after_failure = [rec(0, 1, 100, 0, 0.01, [], ok=False, error="x"), rec(0, 2, 150, 96, 0.02, [])]
    assert on_prefix_node(after_failure, 16) is None


def test_a_mode_row_from_records_and_counter_deltas():
    row = mode_row({"mode": "cache_aware"}, RECORDS, 2.0, DELTA, 16)
    assert row == {
        "mode": "cache_aware",
        "requests": 4,
        "failed": 1,
        "failed_by_reason": {"unavailable": 1},
        "duration_s": 2.0,
        "prompt_tokens": 510,
        "cached_tokens": 256,
        "prefill_query_tokens": 510,
        "prefill_hit_tokens": 256,
        "prefix_cache_hit_rate": 0.502,
        "decode_hit_rate": 0.5,
        "prefill_tokens_computed": 254,
        "kv_bytes_moved": 4096,
        "transfer_kv_bytes": 2500,
        "decode_pages_skipped": 5,
        "evicted_pages": 3,
        "ttft_p50_ms": 25.0,
        "ttft_p99_ms": 39.7,
        "itl_p50_ms": 6.5,
        "itl_p99_ms": 11.89,
        "output_throughput": 8.0,
        "later_turns_on_prefix_node": 0.5,
    }


def test_without_lookups_every_prompt_token_was_computed():
    off = {r: dict.fromkeys(DELTA[r], 0.0) | {"kv_bytes": DELTA[r]["kv_bytes"]} for r in DELTA}
    row = mode_row({}, RECORDS, 2.0, off, 16)
    assert row["prefill_tokens_computed"] == 510
    assert row["prefix_cache_hit_rate"] is None and row["decode_hit_rate"] is None


def test_counter_deltas_per_role():
    before = {"prefill": {"hit": 1.0, "query": 2.0}, "decode": {"hit": 0.0, "query": 5.0}}
    after = {"prefill": {"hit": 4.0, "query": 10.0}, "decode": {"hit": 3.0, "query": 5.0}}
    assert prefix_report.counter_delta(before, after) == {
        "prefill": {"hit": 3.0, "query": 8.0},
        "decode": {"hit": 3.0, "query": 0.0},
    }


def test_change_pct():
    assert change_pct(105, 100) == 5.0
    assert change_pct(30, 100) == -70.0
    assert change_pct(1, 0) is None and change_pct(None, 1) is None


def modes(ca: tuple, off: tuple) -> list[dict]:
    keys = ("prefill_tokens_computed", "ttft_p50_ms", "itl_p99_ms", "later_turns_on_prefix_node")
    return [{"mode": "cache_aware", **dict(zip(keys, ca))}, {"mode": "cache_off", **dict(zip(keys, off))}]


def test_the_summary_states_each_goal_met():
    s = summary(modes((100, 30.0, 10.5, 0.9), (1000, 100.0, 10.0, 0.0)))
    assert set(s) == SUMMARY_KEYS
    assert s["prefill_tokens_computed_reduction_pct"] == 90.0
    assert s["ttft_p50_reduction_pct"] == 70.0
    assert s["itl_p99_change_pct"] == 5.0
    assert s["later_turns_on_prefix_node"] == 0.9
    assert s["goals"] == {
        "prefill_tokens_computed_reduction_pct": {"goal": ">= 80", "met": True},
        "ttft_p50_reduction_pct": {"goal": ">= 60", "met": True},
        "itl_p99_change_pct": {"goal": "<= 10", "met": True},
    }
    assert s["goals_met"] is True and s["modes"] == ["cache_aware", "cache_off"]


def test_the_summary_states_each_goal_missed():
    s = summary(modes((300, 50.0, 12.0, 0.5), (1000, 100.0, 10.0, 0.0)))
    assert (s["prefill_tokens_computed_reduction_pct"], s["ttft_p50_reduction_pct"]) == (70.0, 50.0)
    assert s["itl_p99_change_pct"] == 20.0
    assert [g["met"] for g in s["goals"].values()] == [False, False, False]
    assert s["goals_met"] is False
    assert "NOT met" in prefix_report.text_of(s)


def test_without_both_modes_the_summary_has_no_ratios():
    s = summary(modes((100, 30.0, 10.0, 1.0), (1000, 100.0, 10.0, 0.0))[:1])
    assert s["prefill_tokens_computed_reduction_pct"] is None and s["goals_met"] is None
    assert all(g["met"] is None for g in s["goals"].values())


# ---------------------------------------------------------------------------- flags


def test_prefix_is_a_bench_of_the_cli():
    assert "prefix" in cli.BENCHES


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--modes", "cache_aware,foo"], "foo"), (["--turns", "0"], "--turns"), (["--modes", "cache_off,cache_off"], "")],
)
def test_a_bad_flag_is_one_line_and_exit_2(capsys, argv, named):
    assert prefix.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbridge bench prefix: error:") and "\n" not in err and named in err


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_every_mode_on_tiny_random(capsys):
    """Needs the node and router sides of the prefix cache (RouterConfig.routing, Usage.cached_tokens)."""
    argv = ["--model", "tiny-random", "--conversations", "2", "--turns", "2", "--system-tokens", "96",
            "--user-tokens", "12", "--output-tokens", "6", "--turn-period-s", "0.5", "--json"]  # fmt: skip
    assert prefix.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs, s = rows[:-1], rows[-1]
    assert [r["mode"] for r in runs] == list(prefix.MODES)
    for r in runs:
        assert set(r) == ROW_KEYS, set(r) ^ ROW_KEYS
        assert r["requests"] == 4 and r["failed"] == 0 and r["caches_cleared"], r
        assert sum(n for k, n in r["routing_decisions"].items() if k.startswith("prefill:")) == 4, r  # no warm-ups
    by = {r["mode"]: r for r in runs}
    off, ca = by["cache_off"], by["cache_aware"]
    assert off["prefill_tokens_computed"] == off["prompt_tokens"] and off["decode_pages_skipped"] == 0
    assert ca["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert ca["later_turns_on_prefix_node"] == 1.0
    assert set(s) == SUMMARY_KEYS and s["later_turns_on_prefix_node"] == 1.0
