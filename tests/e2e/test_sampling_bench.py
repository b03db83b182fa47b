"""kvbridge/bench/sampling.py: one small run of every variant on tiny-random (JSON lines, one per
variant and a summary; plain-greedy's ratio exactly 1), its bad flags, and its place in the CLI."""

from __future__ import annotations

import json

import pytest

from kvbridge import cli
from kvbridge.bench import sampling

ROW_KEYS = {
    "bench", "model", "device", "threads", "batch", "prompt_tokens", "steps", "repeats", "variant", "output_tokens",
    "decode_tokens", "decode_tok_s", "decode_step_ms", "ttft_ms", "ratio", "ttft_ratio",
}  # fmt: skip
POSITIVE = ("output_tokens", "decode_tokens", "decode_tok_s", "decode_step_ms", "ttft_ms", "ratio", "ttft_ratio")


def test_every_variant_on_tiny_random(capsys):
    argv = ["--model", "tiny-random", "--batch", "2", "--steps", "4", "--repeats", "1"]
    assert sampling.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs, s = rows[:-1], rows[-1]
    assert [r["variant"] for r in runs] == list(sampling.VARIANTS)
    for r in runs:
        assert set(r) == ROW_KEYS, set(r) ^ ROW_KEYS
        assert r["bench"] == "sampling" and r["model"] == "tiny-random"
        assert (r["batch"], r["steps"], r["repeats"]) == (2, 4, 1)
        assert all(r[k] > 0 for k in POSITIVE), r
        assert r["output_tokens"] <= 2 * 5 and r["decode_tokens"] == r["output_tokens"] - 2, r
        if r["variant"] not in ("json_schema", "json_object"):  # (structured output may end early)
            assert r["output_tokens"] == 2 * 5, r
    greedy = runs[0]
    assert greedy["variant"] == "plain-greedy" and greedy["ratio"] == 1.0 and greedy["ttft_ratio"] == 1.0
    assert s["summary"] is True and s["baseline"] == "plain-greedy"
    assert s["ratio"] == {r["variant"]: r["ratio"] for r in runs}
    assert s["slowest_decode"] in sampling.VARIANTS[1:]


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--repeats", "0"], ["--steps", "0"], ["--batch", "65"]])
def test_a_bad_flag_is_one_line_and_exit_2(capsys, argv):
    assert sampling.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbridge bench sampling: error:") and "\n" not in err and argv[0] in err


def test_sampling_is_a_bench_of_the_cli():
    assert "sampling" in cli.BENCHES
