"""Which test cases belong in tests/long_cases.txt: those whose setup, call and teardown took more
than `--over` seconds in a run written with `pytest --junitxml FILE` (on the slowest CPU of our
kind: an AVX2-only 2-core host, or any host with KVBRIDGE_ISA=avx2).

    .venv/bin/python -m pytest -q --junitxml /tmp/t.xml   # the default run
    .venv/bin/python scripts/long_cases.py /tmp/t.xml --over 4.5 >> tests/long_cases.txt

Prints one node id a line, slowest first, with its seconds as a comment."""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET


def node_id(case: ET.Element) -> str:
    """tests.e2e.test_x (.TestY) + name -> tests/e2e/test_x.py(::TestY)::name"""
    parts = case.get("classname", "").split(".")
    module = next(i for i, part in enumerate(parts) if part.startswith("test_"))
    return "::".join(["/".join(parts[: module + 1]) + ".py", *parts[module + 1 :], case.get("name", "")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="pytest --junitxml output")
    parser.add_argument("--over", type=float, default=4.5, help="seconds a case may take in the default run")
    args = parser.parse_args(argv)
    cases = [(float(c.get("time", 0)), node_id(c)) for c in ET.parse(args.junit).iter("testcase")]
    for seconds, name in sorted(cases, reverse=True):
        if seconds > args.over:
            print(f"{name}  # {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
