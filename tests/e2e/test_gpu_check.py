"""scripts/gpu_check.sh, checked without a GPU: it parses, every test path and bench flag it names
exists, it refuses to run where no GPU is, and its --cpu mode runs stages, records a failed one and
goes on, and writes the KV transfer bench's rows. (The stages themselves run on a GPU machine.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbridge.bench.kv_transfer import BenchConfig, why_not

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
