"""kvbridge/bench/hostile_sampling.py: one small run on tiny-random (JSON lines: quiet, hostile,
summary, with exact token and gap counts, the hostile client's requests all served at the limits),
its bad flags, and its place in the CLI."""

from __future__ import annotations

import json

import pytest

from kvbridge import cli
from kvbridge.bench import hostile_sampling
from kvbridge.common.sampling import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    from_proto,
)

RUN_KEYS = {"bench", "model", "streams", "tokens", "prompt_tokens", "repeats", "clients", "threads", "run", "runs",
            "stream_tokens", "gaps", "itl_p50_ms", "itl_p99_ms", "itl_max_ms"}  # fmt: skip
CLIENT_KEYS = {"client_requests", "client_tokens", "client_errors"}


def test_quiet_plain_and_hostile_runs_on_tiny_random(capsys):
    argv = ["--model", "tiny-random", "--streams", "3", "--tokens", "6", "--hostile-tokens", "4", "--repeats", "2"]
    assert hostile_sampling.main(argv) == 0
    quiet, plain, hostile, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (set(quiet), set(plain), set(hostile)) == (
        RUN_KEYS,
        RUN_KEYS | CLIENT_KEYS,
        RUN_KEYS | CLIENT_KEYS | {"sizes"},
    )
    for row, kind in ((quiet, "quiet"), (plain, "plain"), (hostile, "hostile")):
        assert (row["bench"], row["model"], row["run"], row["runs"]) == ("hostile_sampling", "tiny-random", kind, 2)
        # every token; a gap before each from the 4th on (WARM_GAPS)
        assert (row["stream_tokens"], row["gaps"]) == (2 * 3 * 6, 2 * 3 * (6 - 1 - hostile_sampling.WARM_GAPS))
        assert 0 <= row["itl_p50_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
    for row in (plain, hostile):  # at least one request a counted run (the streams wait for it), each its 4 tokens
        assert row["client_requests"] >= 2 and row["client_tokens"] == 4 * row["client_requests"]
        assert row["client_errors"] == [] and row["clients"] == 1
    assert hostile["sizes"] == {
        "stop": [MAX_STOP_STRINGS, MAX_STOP_CHARS],
        "bad_words": [MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS],
        "logit_bias": 259,  # tiny-random's text vocabulary: 256 bytes and 3 special tokens
        "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS,
        "stop_token_ids": MAX_STOP_TOKEN_IDS,
    }
    assert summary["summary"] is True
    assert summary["hostile_over_quiet_itl_p99"] == round(hostile["itl_p99_ms"] / quiet["itl_p99_ms"], 3)
    assert summary["hostile_over_plain_itl_p50"] == round(hostile["itl_p50_ms"] / plain["itl_p50_ms"], 3)
    assert summary["p99_within_1_5x"] == (summary["hostile_over_quiet_itl_p99"] <= 1.5)


def test_the_hostile_request_is_at_every_limit_and_passes_them():
    params = from_proto(hostile_sampling.at_the_limits(vocab=49152, max_new_tokens=8))
    assert (len(params.stop), sum(map(len, params.stop))) == (MAX_STOP_STRINGS, MAX_STOP_CHARS)
    assert (len(params.bad_words), sum(map(len, params.bad_words))) == (MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS)
    assert (len(params.logit_bias), len(params.stop_token_ids)) == (MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS)
    assert params.allowed_token_ids == tuple(range(49152))  # (65,536 sent: the vocabulary, then its start again)


BAD_FLAGS = [("--streams", "0"), ("--tokens", "3"), ("--hostile", "0"), ("--repeats", "0"), ("--hostile-tokens", "0"),
             ("--threads", "-1")]  # fmt: skip


@pytest.mark.parametrize(("flag", "value"), BAD_FLAGS)
def test_bad_flags_exit_2_naming_the_flag(flag, value, capsys):
    assert hostile_sampling.main([flag, value]) == 2
    assert f"{flag} must be in" in capsys.readouterr().err


def test_it_is_a_cli_bench():
    assert "hostile_sampling" in cli.BENCHES
