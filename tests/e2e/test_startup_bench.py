"""`kvbridge bench startup`: a first start with an empty weight cache and a restart that finds it,
each timed to SERVING, as JSON; bad flags exit 2 naming the value."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.bench import startup


@pytest.mark.long
def test_a_first_start_and_a_restart_are_timed_to_serving():
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge", "bench", "startup", "--model", "tiny-random", "--restarts", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["bench"], r["role"], r["start"], r["fresh_kernels"]) for r in rows] == [
        ("startup", "serve", "first", False),
        ("startup", "serve", "restart", False),
    ]
    assert all(0 < r["seconds_to_serving"] < 300 for r in rows)
    assert "start 1/2" in out.stderr and "start 2/2" in out.stderr


def test_bad_restarts_exit_2_naming_the_value(capsys):
    assert startup.main(["--restarts", "-1"]) == 2
    assert "--restarts must be >= 0, got -1" in capsys.readouterr().err
