"""Regenerate kvbridge/v1/*_pb2*.py from proto/kvbridge/v1/*.proto (checked in; a test keeps them fresh).

python scripts/gen_proto.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
    if protoc.main([*args, f"--pyi_out={out}", *protos]) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    generate(ap.parse_args(sys.argv[1:]).out)
