"""`kvbridge demo` from a shell: answers, a summary, and nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def children_of(pid: int) -> list[int]:
    """Processes spawned by `pid` (multiprocessing's spawn command line names its parent)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"parent_pid={pid}" in cmd:
            found.append(int(proc.name))
    return found


def test_demo_answers_summarizes_and_leaves_nothing_behind():
    before = {p.name for p in Path("/dev/shm").glob("kvbridge-*")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "demo", "--model", "tiny-random", "--requests", "3", "--json",
         "--max-new-tokens", "6", "--prefill-pp", "2", "--decode-pp", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    answers, summary = lines[:-1], lines[-1]["summary"]
    assert [a["question"] for a in answers][:1] == ["What is the capital of France?"] and len(answers) == 3
    assert all(a["tokens"] == 6 and a["kv_bytes"] > 0 for a in answers)
    assert summary["requests"] == 3 and summary["output_tokens"] == 18
    assert summary["backend"] == ["shm"] and summary["kv_bytes"] == sum(a["kv_bytes"] for a in answers)
    # the hand-off itself (the prefill node's series): its time after prefill, and the push's own speed
    assert summary["kv_handoff_s_mean"] > 0 and summary["kv_push_s"] > 0
    # (P's bytes are D's kv_bytes: every page it wrote landed; kv_push_s is shown rounded to 0.1 ms)
    assert summary["kv_push_gb_per_s"] == pytest.approx(summary["kv_bytes"] / summary["kv_push_s"] / 1e9, rel=0.05)
    assert "requests: 3/3" in err  # the progress bar
    assert "terminate called" not in err
    assert {p.name for p in Path("/dev/shm").glob("kvbridge-*")} <= before  # every segment unlinked
    assert children_of(proc.pid) == []


def test_demo_rejects_a_bad_request_count():
    r = subprocess.run([sys.executable, "-m", "kvbridge", "demo", "--requests", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--requests must be in [1, 8], got 0" in r.stderr
