"""scripts/gpu_check.sh, checked without a GPU: it parses, every test path and bench flag it names
exists, it refuses to run where no GPU is, and its --cpu mode runs stages, records a failed one and
goes on, and writes the KV transfer bench's rows. Its --quick mode's dry run, with the GPU machine's
python emulated (tests/gpu/image.py), collects every quick case and skips each one for want of CUDA
and for nothing else; every GPU test has a quick case; the wheels it carries are what that python
lacks. (The stages themselves run on a GPU machine.)"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from kvbridge.bench.kv_transfer import BenchConfig, why_not
from tests.gpu import image

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NO_GPU = (
    "gpu_check: no NVIDIA GPU here (nvidia-smi -L failed or is missing): run it on a GPU machine, "
    "or pass --cpu to run the stages on CPU\n"
)


def gpu_check(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def flags_of(command: list[str]) -> set[str]:
    """The long options a command's --help lists."""
    r = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"--[a-z][a-z0-9-]*", r.stdout))


def test_the_script_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert (r.returncode, r.stderr) == (0, "")


def test_every_test_and_script_path_it_names_exists():
    named = set(re.findall(r"(?<![\w/.-])((?:tests|scripts)/[\w./-]*\w)", SCRIPT.read_text()))
    assert {"tests/gpu", "scripts/setup.sh", "tests/e2e/test_gpu_check.py"} <= named
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def test_every_bench_flag_it_passes_exists():
    kv, serve = set(), set()
    for line in SCRIPT.read_text().splitlines():
        flags = set(re.findall(r"(?<!\S)--[a-z][a-z0-9-]*", line))
        if re.match(r"\s*kv_bench ", line) or "-m kvbridge.bench.kv_transfer" in line:
            kv |= flags
        elif re.match(r"\s*serve_bench ", line) or " bench serve " in line:
            serve |= flags
    assert {"--device", "--decode-device", "--engines", "--mib", "--dtype", "--json"} <= kv
    assert {"--model", "--num-prompts", "--request-rates", "--json"} <= serve
    assert kv - flags_of([sys.executable, "-m", "kvbridge.bench.kv_transfer"]) == set()
    assert serve - flags_of([str(Path(sys.executable).parent / "kvbridge"), "bench", "serve"]) == set()


def test_without_a_gpu_it_refuses_with_a_clear_message(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = os.environ | {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    r = gpu_check(env=env, timeout=30)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", NO_GPU)
    assert not (tmp_path / "out").exists()


def test_an_unknown_stage_is_refused_with_the_usage():
    r = gpu_check("--cpu", "--stages", "tests,nope", timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("gpu_check: unknown stage 'nope'\nThe GPU path in one run")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """--cpu with two stages: tests, given 1 s (it times out), then kv_bench."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = os.environ | {"OUT": str(out), "GPU_CHECK_TIMEOUT_TESTS": "1"}
    return gpu_check("--cpu", "--stages", "tests,kv_bench", env=env), out


def test_a_failed_stage_is_recorded_the_next_still_runs_and_the_exit_is_1(cpu_run):
    r, out = cpu_run
    assert r.returncode == 1, r.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert re.fullmatch(r"tests FAIL \d+s pytest_gpu\.log \(timed out after 1s\)", lines[0]), lines
    assert re.fullmatch(r"kv_bench PASS \d+s kv_transfer\.log", lines[1]), lines
    assert re.fullmatch(rf"gpu_check: FAIL \(tests; passed: kv_bench\) in \d+s; see {re.escape(str(out))}", lines[2])
    assert r.stdout == lines[2] + "\n"
    written = {
        "gpu_check.log",
        "summary.txt",
        "nvidia-smi.txt",
        "pytest_gpu.log",
        "kv_transfer.log",
        "kv_transfer.jsonl",
    }
    assert {p.name for p in out.iterdir()} == written
    progress = [
        re.sub(r"^gpu_check \[\d+s\]", "gpu_check [T]", p) for p in (out / "gpu_check.log").read_text().splitlines()
    ]
    assert progress[:2] == [
        f"gpu_check [T] mode cpu, outputs in {out}",
        "gpu_check [T] stage tests: running (timeout 1s) -> pytest_gpu.log",
    ]
    assert re.fullmatch(r"gpu_check \[T\] stage tests: FAIL in \d+s \(timed out after 1s\)", progress[2])
    assert progress[3] == "gpu_check [T] stage kv_bench: running (timeout 100s) -> kv_transfer.log"
    assert re.fullmatch(r"gpu_check \[T\] stage kv_bench: PASS in \d+s", progress[4])
    assert progress[5:] == [lines[2]]


def test_the_kv_bench_stage_writes_a_row_per_engine_and_skips_cuda_ipc_on_cpu(cpu_run):
    _, out = cpu_run
    rows = [json.loads(line) for line in (out / "kv_transfer.jsonl").read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["shm", "torch", "cuda_ipc"]
    assert rows[2] == {
        "bench": "kv_transfer",
        "engine": "cuda_ipc",
        "device": "cpu",
        "decode_device": "cpu",
        "skipped": "cuda_ipc moves CUDA pools",
    }
    page_bytes = 30 * 2 * 16 * 3 * 64 * 2  # the default geometry in bfloat16
    for r in rows[:2]:
        assert (r["device"], r["decode_device"], r["dtype"], r["repeats"]) == ("cpu", "cpu", "bfloat16", 2)
        assert (r["pages"], r["bytes"]) == ((4 << 20) // page_bytes, (4 << 20) // page_bytes * page_bytes)
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["ratio_to_memcpy"] > 0


@pytest.mark.parametrize(
    ("engine", "device", "decode_device", "reason"),
    [
        ("torch", "cuda", "cuda:0", "NCCL pairs no two ranks on one GPU (cuda:0)"),
        ("torch", "cuda:0", "cuda:1", ""),
        ("torch", "cuda:0", "cpu", ""),
        ("cuda_ipc", "cuda:0", "cuda:0", ""),
        ("cuda_ipc", "cuda:0", "cpu", "cuda_ipc moves CUDA pools"),
        ("shm", "cpu", "cuda", "shm moves CPU pools"),
        ("grpc", "cuda", "cpu", ""),
    ],
)
def test_the_bench_says_which_engines_cannot_join_two_devices(engine, device, decode_device, reason):
    assert why_not(engine, BenchConfig(device=device, decode_device=decode_device)) == reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_the_bench_refuses_a_cuda_device_where_there_is_none(capsys):
    from kvbridge.bench import kv_transfer

    assert kv_transfer.main(["--device", "cuda", "--json"]) == 2
    assert capsys.readouterr().err == "bench kv_transfer: error: device 'cuda' asked for, but CUDA is not available\n"


def test_quick_refuses_cpu_and_the_stages_it_does_not_run():
    r = gpu_check("--quick", "--cpu", timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("gpu_check: --quick does not take --cpu (--quick --dry-run is its run on CPU)\n")
    r = gpu_check("--quick", "--stages", "tests,kv_bench", timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("gpu_check: unknown stage 'kv_bench'\nThe GPU path in one run")


def test_quick_where_no_gpu_is_its_dry_run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = os.environ | {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    r = gpu_check("--quick", "--stages", "env", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.match(r"gpu_check \[\d+s\] mode dry quick \(no GPU here\), python ", r.stderr), r.stderr
    assert json.loads((tmp_path / "out" / "env.json").read_text())["mode"] == "dry"


@functools.cache
def collect(marker: str) -> list[str]:
    """The ids of the tests/gpu cases `marker` selects, as pytest collects them here."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu", "-m", marker],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return [line for line in r.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """--quick --dry-run: the quick cases on CPU, the GPU machine's python emulated."""
    out = tmp_path_factory.mktemp("gpu_check_dry")
    return gpu_check("--quick", "--dry-run", env=os.environ | {"OUT": str(out)}), out


def test_the_dry_run_skips_every_quick_case_for_want_of_cuda_and_for_nothing_else(dry_run):
    r, out = dry_run
    assert r.returncode == 0, r.stderr
    assert [line.split()[:2] for line in (out / "summary.txt").read_text().splitlines()[:3]] == [
        ["setup", "PASS"],
        ["env", "PASS"],
        ["tests", "PASS"],
    ]
    quick = collect("gpu and quick")
    cases = {
        f"{c.get('classname').replace('.', '/')}.py::{c.get('name')}": [(e.tag, e.get("message", "")) for e in c]
        for c in ET.parse(out / "pytest_gpu.xml").getroot().iter("testcase")
    }
    assert sorted(cases) == sorted(quick)
    assert {case: why for case, why in cases.items() if why != [("skipped", "no CUDA device")]} == {}
    # pytest -rs: each skip with its reason, none other
    log = (out / "pytest_gpu.log").read_text()
    reasons = re.findall(r"^SKIPPED \[(\d+)\] [\w/.]+:\d+: (.*)$", log, re.M)
    assert {why for _, why in reasons} == {"no CUDA device"}
    assert sum(int(n) for n, _ in reasons) == len(quick)
    assert f"dry run: every one of the {len(quick)} quick cases collected and skipped for want of CUDA" in log


def test_every_gpu_test_has_a_quick_case_in_every_module():
    def functions(ids):
        return {i.split("[")[0] for i in ids}

    every, quick = collect("gpu"), collect("gpu and quick")
    paris = "tests/gpu/test_gpu_bf16_parity.py::test_the_first_answer_names_paris"  # (the default model's knowledge)
    assert functions(every) - functions(quick) == {paris}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert {i.split("::")[0] for i in quick} == modules


def test_the_carried_wheels_are_what_the_image_lacks_at_the_versions_here():
    lacks = image.requirement_closure(["kvbridge"]) - image.requirement_closure(image.IMAGE)
    assert image.carried() == lacks - {"kvbridge", "ninja"}  # (quick mode builds no CPU kernels)
    pins = [line.split("#")[0].strip() for line in image.WHEELS.read_text().splitlines()]
    stale = {}
    for pin in filter(None, pins):
        name, version = pin.split("==")
        if importlib.metadata.version(name) != version:
            stale[name] = (version, importlib.metadata.version(name))
    assert stale == {}


def make_site(folder: Path, dists: dict[str, list[str]]) -> Path:
    """A site-packages folder: each distribution's dist-info (its RECORD listing `files`) and files."""
    for name, files in dists.items():
        info = folder / f"{name}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        record = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in record))
        for f in files:
            (folder / f).parent.mkdir(parents=True, exist_ok=True)
            (folder / f).write_text("")
    return folder


def test_the_emulated_image_links_all_but_what_only_hidden_distributions_own(tmp_path):
    site = make_site(
        tmp_path / "site",
        {
            "kept": ["kept/__init__.py", "shared/a.py"],
            "hidden": ["hidden/__init__.py", "hidden_module.py", "shared/b.py"],
        },
    )
    (site / "loose.pth").write_text("")
    into = tmp_path / "into"
    into.mkdir()
    left_out = image.link_what_is_kept(site, {"kept"}, into)
    assert left_out == ["hidden", "hidden-1.0.dist-info", "hidden_module.py"]
    assert sorted(p.name for p in into.iterdir()) == ["kept", "kept-1.0.dist-info", "loose.pth", "shared"]


def test_the_emulated_image_hides_test_extras_and_keeps_the_image_and_the_wheels():
    code = (
        "import importlib.util as u\n"
        "from tests.gpu import image\n"
        "image.emulate_the_image()\n"
        "print([u.find_spec(n) is not None for n in ('hypothesis', 'openai', 'accelerate', 'kvbridge.common')])\n"
        "print([u.find_spec(n) is not None for n in ('torch', 'transformers', 'grpc_health', 'llguidance')])\n"
    )
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert r.stdout.splitlines() == [str([False] * 4), str([True] * 4)], r.stderr
