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
        # the ratio of the unrounded speeds: within what rounding each to 3 decimals (±0.0005) allows
        g, m, half = r["gbps"], r["memcpy_gbps"], 0.0005
        assert (g - half) / (m + half) - half <= r["ratio_to_memcpy"] <= (g + half) / max(m - half, 1e-9) + half
