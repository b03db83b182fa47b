"""kvbridge/bench/soak.py: a short soak with a high injected transfer failure rate ends with exact client
accounting, no leak, no dead process, and transfer failures seen in the nodes' metrics."""

from __future__ import annotations

import json

import pytest

from kvbridge.bench import soak
from kvbridge.cli import build_parser


@pytest.mark.long
def test_short_soak_with_many_transfer_failures_leaks_nothing(capsys):
    code = soak.main(
        [
            "--seconds", "15", "--concurrency", "6", "--cancel-rate", "0.25", "--node-timeout-s", "3",
            "--fault-inject", "transfer_fail=0.2,transfer_delay_ms=20", "--decode-faults", "rank1:transfer_fail=0.1",
        ]
    )  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    row = json.loads(lines[0])
    assert code == 0, row

    assert row["bench"] == "soak" and row["model"] == "tiny-random"
    assert row["prefill_pp"] == 2 and row["decode_pp"] == 2
    assert row["faults"]["prefill"].endswith("transfer_fail=0.2,transfer_delay_ms=20")
    assert row["faults"]["decode"].endswith("transfer_fail=0.2,transfer_delay_ms=20,rank1:transfer_fail=0.1")
    assert row["duration_s"] >= 15

    # every request sent has exactly one client-side outcome
    failed = sum(row["failed_by_reason"].values())
    assert row["requests"] == row["served"] + failed + row["cancelled"]
    assert row["requests"] > 0 and row["served"] > 0 and row["cancelled"] > 0
    assert all(isinstance(n, int) and n > 0 for n in row["failed_by_reason"].values())
    assert sum(row["kinds"].values()) == row["requests"]
    # a transfer failure is a node-side error: never a client-side or protocol surprise
    assert not {"CLIENT_ERROR", "NO_FINISH", "CONNECTION"} & set(row["failed_by_reason"]), row["failure_examples"]

    # the injected failures happened and cost requests (failed, or retried by the router)
    assert row["transfer_failures"] > 0 and row["transfer_failures_by_reason"].get("injected", 0) > 0
    assert row["transfer_failures"] == sum(row["transfer_failures_by_node"].values())
    assert isinstance(row["retries"], int) and failed + row["retries"] > 0
    # the router ended every request that reached it (a client may hang up before sending)
    assert row["served"] + failed <= sum(row["router_outcomes"].values()) <= row["requests"]

    for name in ("ttft_s", "itl_s", "e2e_s"):
        p = row[name]
        assert p["n"] > 0 and 0 < p["p50"] <= p["p99"], (name, p)
    assert row["e2e_s"]["n"] == row["served"]
    assert row["tokens"] > 0 and row["tokens_per_s"] > 0

    # nothing left behind once the traffic stopped
    assert row["pages_used_start"] == {"prefill": [0, 0], "decode": [0, 0]}
    assert row["pages_used_end"] == {"prefill": [0, 0], "decode": [0, 0]}
    assert row["requests_in_flight_end"] == {"prefill": 0, "decode": 0, "router": 0}
    assert row["leaks"] is False
    assert row["dead_processes"] == [] and row["rank_errors"] == {} and row["invariant_violations"] == 0
    assert row["logs_agree"] is True and row["shm_left"] == [] and row["replay_mismatches"] == 0

    procs = {"front", "prefill.rank0", "prefill.rank1", "decode.rank0", "decode.rank1"}
    for key in ("rss_mb_start", "rss_mb_end", "cpu_s"):
        assert set(row[key]) == procs and all(v > 0 for v in row[key].values()), row[key]
    assert row["tokens_per_s_windows"] and all(r >= 0 for r in row["tokens_per_s_windows"])


def test_bad_flags_exit_2_before_starting_anything(capsys):
    assert soak.main(["--seconds", "0"]) == 2
    assert soak.main(["--seconds", "1", "--fault-inject", "transfer_fail=2"]) == 2
    assert soak.main(["--seconds", "1", "--cancel-rate", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "duration must be > 0" in err and "transfer_fail" in err and "--cancel-rate" in err


def test_the_cli_knows_the_soak_bench():
    args = build_parser().parse_args(["bench", "soak", "--seconds", "5"])
    assert args.name == "soak" and args.rest == ["--seconds", "5"]
