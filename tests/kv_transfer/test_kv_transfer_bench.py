"""kvbridge/bench/kv_transfer.py runs end to end and prints one JSON object per engine (no timing asserted)."""

from __future__ import annotations

import json

from kvbridge.bench import kv_transfer


def test_bench_prints_one_json_line_per_engine(capsys):
    assert kv_transfer.main(["--mib", "1", "--repeats", "1", "--engines", "shm,grpc", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["engine"] for r in rows] == ["shm", "grpc"]
    pages = (1 << 20) // (30 * 2 * 16 * 3 * 64 * 4)  # default geometry: 30 layers, 16-token pages, 3 x 64
    for r in rows:
        assert r["pages"] == pages and r["bytes"] == pages * 30 * 2 * 16 * 3 * 64 * 4
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0
        assert (
            r["ratio_to_memcpy"] == round(r["gbps"] / r["memcpy_gbps"], 3)
            or abs(r["ratio_to_memcpy"] - r["gbps"] / r["memcpy_gbps"]) < 0.01
        )
