"""The checked-in stubs in kvbridge/v1/ are exactly what scripts/gen_proto.py makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)], check=True)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert fresh, "protoc generated nothing"
    for rel, content in fresh.items():
        checked_in = ROOT / rel
        assert checked_in.exists(), f"{rel} is generated but not checked in: run scripts/gen_proto.py"
        assert checked_in.read_bytes() == content, f"{rel} is stale: run scripts/gen_proto.py"
    stale = {p.relative_to(ROOT) for p in (ROOT / "kvbridge" / "v1").glob("*_pb2*")} - set(fresh)
    assert not stale, f"stubs without a .proto: {sorted(map(str, stale))}"
