"""KVBRIDGE_ISA=avx2 forces the AVX2 path on any x86 host: AVX-512 and AMX flags ignored, the
kernels built without them (a build of their own), `--dtype auto` as on an AVX2-only CPU."""

from __future__ import annotations

import pytest
import torch

from kvbridge.engine import kernels
from kvbridge.engine.llm import resolve_dtype

XEON = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16"


@pytest.fixture
def xeon(monkeypatch):
    """/proc/cpuinfo as an AMX Xeon reports it."""
    monkeypatch.setattr(kernels.Path, "read_text", lambda self: f"processor\t: 0\n{XEON}\n")


def test_native_names_the_hosts_best_level(xeon, monkeypatch):
    monkeypatch.delenv("KVBRIDGE_ISA", raising=False)
    assert kernels.isa() == "amx"
    assert "-mno-avx512f" not in kernels._cflags()


def test_avx2_forced_drops_avx512_and_amx_and_builds_apart(xeon, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_ISA", "native")
    native = kernels._build_name()
    monkeypatch.setenv("KVBRIDGE_ISA", "avx2")
    assert kernels._cpu_flags().split() == ["flags", ":", "fpu", "sse2", "avx", "avx2", "fma"]
    assert kernels.isa() == "avx2"
    assert kernels._cflags()[-2:] == ["-mno-avx512f", "-mno-amx-tile"]
    assert kernels._build_name() != native  # (the AVX-512 build is never loaded under the switch)


def test_auto_is_float32_on_a_cpu_when_avx2_is_forced(xeon, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_ISA", "avx2")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_a_bad_level_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_ISA", "avx9000")
    with pytest.raises(ValueError, match="KVBRIDGE_ISA must be one of native, avx2, got 'avx9000'"):
        kernels.forced_isa()
