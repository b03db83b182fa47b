"""kvbridge/bench/choices.py: one small run on tiny-random, exact prefill token counts (the prompt
once with n, n times as separate requests on a node without a prefix cache), every choice equal to
its separate request; its bad flags, and its place in the CLI."""

from __future__ import annotations

import json

import pytest

from kvbridge import cli
from kvbridge.bench import choices


def test_n_computes_the_prompt_once_and_equals_separate_requests(capsys):
    argv = ["--model", "tiny-random", "--prompt-tokens", "40", "--output-tokens", "4", "--repeats", "1"]
    assert choices.main([*argv, "--cache", "off"]) == 0
    n4, separate, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # pages of 16: the first 2 pages (32 tokens) shared, each other choice computes the last 8 again
    assert (n4["variant"], n4["prefill_tokens"]) == ("n=4", 40 + 3 * 8)
    assert (separate["variant"], separate["prefill_tokens"], separate["ratio"]) == ("4 requests", 4 * 40, 1.0)
    assert n4["seconds"] > 0 and n4["ttft_ms"] > 0 and n4["ratio"] > 0
    assert summary["choices_equal_separate_requests"] is True and summary["distinct_choices"] == 4
    assert summary["prefill_tokens_saved_pct"] == 60.0


@pytest.mark.parametrize(("flag", "value"), [("--n", "1"), ("--n", "17"), ("--prompt-tokens", "0"), ("--repeats", "0")])
def test_bad_flags_exit_2_naming_the_flag(flag, value, capsys):
    assert choices.main([flag, value]) == 2
    assert f"{flag} must be in" in capsys.readouterr().err


def test_it_is_a_cli_bench():
    assert "choices" in cli.BENCHES
