"""KVBRIDGE_ISA=avx2 forces the AVX2 path on any x86 host: AVX-512 and AMX flags ignored, the
kernels built for AVX2 + FMA + F16C (a build of their own, what an AVX2 host builds), `--dtype
auto` as on an AVX2-only CPU (bfloat16: the kernels run there too). And the AVX2 build computes
what the AVX-512 one does, bit for bit: every kernel on the same inputs, and greedy bf16
generation on the default model (run in a child process with the switch; skipped by name where
the host has no AVX-512 to compare with)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine import kernels
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM, resolve_dtype
from kvbridge.engine.weights import TINY_CONFIG, load_model, tiny_random
from tests.conftest import make_llm

ROOT = Path(__file__).resolve().parents[2]

XEON = "flags\t\t: fpu sse2 f16c avx avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16"


@pytest.fixture
def xeon(monkeypatch):
    """/proc/cpuinfo as an AMX Xeon reports it."""
    monkeypatch.setattr(kernels.Path, "read_text", lambda self: f"processor\t: 0\n{XEON}\n")


def test_native_names_the_hosts_best_level(xeon, monkeypatch):
    monkeypatch.delenv("KVBRIDGE_ISA", raising=False)
    assert kernels.isa() == "amx"
    assert kernels._cflags()[-2:] == ["-march=native", "-ffp-contract=off"]


def test_avx2_forced_drops_avx512_and_amx_and_builds_apart(xeon, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_ISA", "native")
    native = kernels._build_name()
    monkeypatch.setenv("KVBRIDGE_ISA", "avx2")
    assert kernels._cpu_flags().split() == ["flags", ":", "fpu", "sse2", "f16c", "avx", "avx2", "fma"]
    assert kernels.isa() == "avx2"
    # what an AVX2 host builds: those extensions named, nothing of this CPU's own (-march=native)
    assert kernels._cflags()[-4:] == ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
    assert "-march=native" not in kernels._cflags()
    assert kernels._build_name() != native  # (the AVX-512 build is never loaded under the switch)


def test_the_bf16_kernels_run_at_both_x86_levels_and_not_below(xeon, monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: True)
    for level, want in (("native", "amx"), ("avx2", "avx2")):
        monkeypatch.setenv("KVBRIDGE_ISA", level)
        assert kernels.isa() == want and kernels.bf16_linear()
    old = "flags\t\t: fpu sse2 avx f16c"  # (Ivy Bridge: AVX without AVX2 and FMA)
    monkeypatch.setattr(kernels.Path, "read_text", lambda self: f"processor\t: 0\n{old}\n")
    assert kernels.isa() == "generic" and not kernels.bf16_linear()
    assert "-fassociative-math" in kernels._cflags()  # (plain loops only: no other level to agree with)


def test_auto_is_bfloat16_where_the_bf16_kernels_run_avx2_forced_too(xeon, monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: True)
    for level in ("native", "avx2"):
        monkeypatch.setenv("KVBRIDGE_ISA", level)
        assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(kernels, "available", lambda: False)  # (no compiler: torch's ops, float32)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_a_bad_level_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_ISA", "avx9000")
    with pytest.raises(ValueError, match="KVBRIDGE_ISA must be one of native, avx2, got 'avx9000'"):
        kernels.forced_isa()


def kernel_outputs() -> dict[str, torch.Tensor]:
    """Every kernel on fixed inputs (seeded; specials among them), by name: what the bit-for-bit
    test compares between the native build and the AVX2 one."""
    assert kernels.available(), kernels.error()  # (loads the ops)
    g = torch.Generator().manual_seed(11)
    out = {}
    # attention: each dtype; head dims 16 to 128 (64 and 128 compiled apart, 80 the general path);
    # pages not a multiple of 16 keys; decodes, one per table, and a prompt's rows, all together
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim, page_size in ((64, 16), (128, 16), (80, 5), (16, 32)):
            pool = torch.randn(24, 2, 2, page_size, 2, head_dim, generator=g).to(dtype)
            lens = torch.tensor([1, 7, 16, 17, 3 * page_size + 5])
            tables = torch.stack([torch.randperm(24, generator=g)[:10] for _ in lens])
            q = (torch.randn(len(lens), 6, head_dim, generator=g) * 3).to(dtype)
            key = f"attention {dtype} {head_dim}"
            out[f"{key} decode"] = kernels.paged_attention(q, pool, tables, torch.arange(5), lens, 1, 0.125)
            rows, ctx = torch.tensor([4] * 40), torch.arange(1, 41) + 10
            prompt = (torch.randn(40, 6, head_dim, generator=g) * 3).to(dtype)
            out[f"{key} prompt"] = kernels.paged_attention(prompt, pool, tables, rows, ctx, 0, 0.125)
    # bf16 matmuls: 1 to 3 rows (several tiles at once), more rows (a tile of rows at a time), n
    # not a multiple of the tile
    for n, k in ((96, 64), (100, 576), (1000, 40)):
        w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        x = torch.randn(37, k, generator=g).bfloat16()
        packed = kernels.pack_bf16(w)
        for rows in (1, 2, 3, 8, 37):
            out[f"linear {n}x{k} {rows} rows"] = kernels.linear_bf16(x[:rows], packed, n, out_float=True)
            out[f"linear {n}x{k} {rows} rows bf16"] = kernels.linear_bf16(x[:rows], packed, n)
    # silu over every bf16 value (NaNs, infinities, subnormals: e^x over all of them)
    gate = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(64, 1024)
    up = torch.randn(64, 1024, generator=g).bfloat16()
    out["silu_mul"] = kernels.silu_mul_bf16(torch.cat([gate, up], dim=1))
    x, w = (torch.randn(40, 576, generator=g) * 3).bfloat16(), torch.randn(576, generator=g).bfloat16()
    x[0, :3] = torch.tensor([float("nan"), float("inf"), 1e30])
    out["rms_norm"] = kernels.rms_norm_bf16(x, w, 1e-5)
    qkv = (torch.randn(37, 15 * 64, generator=g) * 2).bfloat16()
    cos, sin = torch.randn(37, 64, generator=g).bfloat16(), torch.randn(37, 64, generator=g).bfloat16()
    out["rope"] = kernels.rope_bf16(qkv, cos, sin, 12)
    # the one-call decoder through the engine: tokens and logprobs of prompts chunked beside decodes
    model = tiny_random(config=dataclasses.replace(TINY_CONFIG, head_dim=32))
    llm = make_llm(model, dtype="bfloat16", page_size=8, chunked_prefill_size=24)
    assert llm.stages[0].fused
    prompts = [[5 + (i * 13 + j) % 70 for j in range(6 + 11 * i)] for i in range(5)]
    done = llm.generate(prompts, SamplingParams(max_new_tokens=9, ignore_eos=True, logprobs=0))
    out["decoder tokens"] = torch.tensor([c.output_ids for c in done])
    out["decoder logprobs"] = torch.tensor([[lp.logprob for lp in c.logprobs] for c in done])
    return out


def default_greedy(model=None) -> dict[str, torch.Tensor]:
    """16 greedy tokens of a short chat prompt and their logprobs, the default model in bf16."""
    model = model or load_model("smollm2-135m-instruct", progress=False)
    llm = LLM(EngineConfig(dtype="bfloat16"), model=model, progress=False)
    assert llm.stages[0].fused  # (every op through the kernels)
    tok = llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    (c,) = llm.generate([prompt], SamplingParams(max_new_tokens=16, logprobs=0))
    return {"tokens": torch.tensor(c.output_ids), "logprobs": torch.tensor([lp.logprob for lp in c.logprobs])}


def under_avx2(tmp_path, call: str) -> dict[str, torch.Tensor]:
    """`call` (an expression of this module's names) in a child process with KVBRIDGE_ISA=avx2."""
    path = tmp_path / "avx2.pt"
    script = f"import sys, torch\nfrom tests.engine.test_isa import *\ntorch.save(({call}, kernels.isa()), sys.argv[1])"
    env = {**os.environ, "KVBRIDGE_ISA": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out, level = torch.load(path)
    assert level == "avx2"
    return out


needs_avx512 = pytest.mark.skipif(
    kernels.isa() not in ("avx512", "amx") or not kernels.available(),
    reason="this host has no AVX-512 kernels: its native build is the AVX2 one, nothing to compare with",
)


@pytest.mark.long
@needs_avx512
def test_the_avx2_build_computes_every_kernels_bits_as_the_avx512_build(tmp_path):
    native, avx2 = kernel_outputs(), under_avx2(tmp_path, "kernel_outputs()")
    assert native.keys() == avx2.keys()
    for name, want in native.items():
        got = avx2[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        # the same bits, NaNs included (equal and isnan-equal would pass a -0 for a 0)
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name


@pytest.mark.long
@needs_avx512
def test_greedy_bf16_generation_is_the_same_under_avx2(tmp_path, default_model):
    native = default_greedy(default_model)
    avx2 = under_avx2(tmp_path, "default_greedy()")
    assert avx2["tokens"].tolist() == native["tokens"].tolist()
    assert torch.equal(avx2["logprobs"], native["logprobs"])
