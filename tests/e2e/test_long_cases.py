"""tests/long_cases.txt names cases that exist, and tests/conftest.py marks them `long` (the
default run leaves them out; CI runs them with `-m long`)."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from scripts.long_cases import main as long_cases_main
from scripts.long_cases import node_id
from tests.conftest import long_cases

ROOT = Path(__file__).resolve().parents[2]


def test_every_listed_case_names_a_test_function_of_an_existing_module():
    listed = long_cases()
    assert len(listed) > 50
    for case in sorted(listed):
        path, *names = case.split("::")
        function = re.sub(r"\[.*\]$", "", names[-1])
        assert (ROOT / path).is_file(), case
        assert re.search(rf"^\s*def {re.escape(function)}\(", (ROOT / path).read_text(), re.M), case


def collected(*args: str) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *args], capture_output=True, text=True, cwd=ROOT
    )
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_a_listed_case_is_left_out_of_the_default_run_and_taken_by_m_long():
    module = "tests/nodes/test_listeners.py"
    listed = sorted(c for c in long_cases() if c.startswith(module + "::"))
    assert listed  # (its one case is listed)
    assert [c for c in collected(module) if c in listed] == []
    assert collected("-m", "long", module) == listed


@pytest.mark.parametrize(
    "classname,name,want",
    [
        ("tests.e2e.test_cli", "test_x[a-b]", "tests/e2e/test_cli.py::test_x[a-b]"),
        ("tests.nodes.test_pp.TestRing", "test_y", "tests/nodes/test_pp.py::TestRing::test_y"),
    ],
)
def test_junit_names_become_node_ids(classname, name, want):
    assert node_id(ET.Element("testcase", classname=classname, name=name)) == want


def test_the_script_lists_cases_over_the_line_slowest_first(tmp_path, capsys):
    junit = tmp_path / "t.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.a.test_b" name="test_fast" time="1.0"/>'
        '<testcase classname="tests.a.test_b" name="test_slow[x]" time="9.25"/>'
        '<testcase classname="tests.a.test_c" name="test_mid" time="5.0"/></testsuite></testsuites>'
    )
    assert long_cases_main([str(junit), "--over", "4.5"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "tests/a/test_b.py::test_slow[x]  # 9.2 s",
        "tests/a/test_c.py::test_mid  # 5.0 s",
    ]
