"""kvbridge/bench/consensus.py runs end to end on a small workload (simulated time: deterministic)."""

from __future__ import annotations

import json

from kvbridge.bench import consensus as bench

KEYS = {
    "bench",
    "pp",
    "stage_ms",
    "hop_ms",
    "ours_ms",
    "ours_p90_ms",
    "ours_decided_ms",
    "baseline_ms",
    "baseline_p90_ms",
    "speedup",
    "samples",
    "baseline_samples",
    "target_ms",
    "within_target",
}


def test_bench_prints_one_json_object_per_pipeline_size(capsys):
    assert bench.main(["--pp", "2", "8", "--seeds", "2", "--requests", "12", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["pp"] for r in rows] == [2, 8]
    assert all(set(r) == KEYS and r["stage_ms"] == 50 and r["hop_ms"] == 0.2 for r in rows)
    pp8 = rows[1]
    assert pp8["samples"] > 12 and pp8["target_ms"] == 55 and pp8["within_target"] is True
    assert pp8["ours_ms"] <= 55.0 and pp8["speedup"] >= 4.0  # simulated time: the targets
    assert pp8["ours_decided_ms"] < 2 * (8 * (0.3 + 0.02) + 0.02)  # the bound: two rounds of 8 slowest hops


def test_bench_same_arguments_same_figures(capsys):
    argv = ["--pp", "3", "--seeds", "1", "--requests", "6"]
    bench.main(argv)
    first = capsys.readouterr().out
    bench.main(argv)
    assert capsys.readouterr().out == first


def test_bench_rejects_bad_arguments(capsys):
    assert bench.main(["--seeds", "0"]) == 2
    assert bench.main(["--hop-ms", "-1"]) == 2
    assert "bench consensus: error" in capsys.readouterr().err
