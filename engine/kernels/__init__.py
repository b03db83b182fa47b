"""CPU kernels of our own, built from source with the machine's C++ compiler on first use.

`paged_attention(q, pool, tables, rows, ctx_lens, layer, scale)`: each query row (a decode or a
prompt token) attending over its request's pages of the KV pool, read in place, computed alike
however the prompt was chunked (paged_attention.cpp); `pack_bf16` and
`linear_bf16`: bfloat16 matmuls with packed weights, and `silu_mul_bf16`, `rms_norm_bf16` and `rope_bf16`
(linear_bf16.cpp, `bf16_linear()`); `decoder_bf16`: a rank's decoder layers in one call, those ops
in the order engine/model.py runs them (decoder_bf16.cpp; kernels.h declares what it calls); vec.h:
their vector layer, 16 float32 lanes on AVX-512 or AVX2 + FMA (one source, the same bits at
either level; plain loops elsewhere, where the bf16 ops are not built); `stream_copy`, large copies
with streaming stores (stream_copy.cpp: KV hand-offs into another process's pool). The build takes
~30 s once per machine (torch's extension cache, ~/.cache/torch_extensions, keyed by the
source, the flags and this CPU); later starts load it in well under a second. Where it cannot
be built (no compiler) or KVBRIDGE_KERNELS=0, `available()` is False and the engine uses torch's
ops (slower, same results within float rounding).

One build per x86 level the host runs: `-march=native` on AVX-512 and AMX hosts, `-mavx2 -mfma
-mf16c` on AVX2 ones. KVBRIDGE_ISA=avx2 forces the AVX2 level on any x86 host: the CPU's AVX-512
and AMX flags are ignored (so `--dtype auto` means what it means on an AVX2-only CPU) and the
kernels are the AVX2 build (a build of their own), so an AVX-512 host runs and measures what an
AVX2 host runs. `isa()` names the level in use.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(n)
    for n in ("paged_attention.cpp", "linear_bf16.cpp", "decoder_bf16.cpp", "stream_copy.cpp")
]
HEADERS = [Path(__file__).with_name(n) for n in ("vec.h", "kernels.h")]
# The build is keyed by this CPU's flags below, so a cache copied to another CPU builds again.
# OpenMP: ATen's parallel_for is inline and runs on one thread without it (the runtime is torch's
# own libgomp).
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
LDFLAGS = ["-fopenmp"]
# Per level: AVX-512 and AMX hosts build for the CPU itself; the AVX2 level for AVX2 + FMA + F16C
# exactly (what any AVX2 host runs, forced or not). At both x86 levels the float operations are the
# ones the source writes, in its order (no contraction, no reassociation), so the two levels give
# the same bits (vec.h). Elsewhere the plain loops may be reassociated: the compiler vectorizes
# their float sums, and there is no other level to agree with.
LEVEL_CFLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"],
    "avx512": ["-march=native", "-ffp-contract=off"],
    "generic": ["-march=native", "-fassociative-math", "-fno-signed-zeros"],
}
LEVEL_CFLAGS["amx"] = LEVEL_CFLAGS["avx512"]
ISA_LEVELS = ("native", "avx2")  # KVBRIDGE_ISA: this CPU's own level, or AVX2 forced

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once tried, "error": why not


def forced_isa() -> str:
    """KVBRIDGE_ISA: "native" (the default) or "avx2"; ValueError naming anything else."""
    level = os.environ.get("KVBRIDGE_ISA", "native").strip().lower() or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"KVBRIDGE_ISA must be one of {', '.join(ISA_LEVELS)}, got {level[:32]!r}")
    return level


def _cpu_flags() -> str:
    """/proc/cpuinfo's flags line (without the AVX-512 and AMX flags when KVBRIDGE_ISA=avx2)."""
    line = platform.processor()
    try:
        for row in Path("/proc/cpuinfo").read_text().splitlines():
            if row.startswith("flags"):
                line = row
                break
    except OSError:
        pass
    if forced_isa() == "avx2":
        line = " ".join(f for f in line.split() if not f.startswith(("avx512", "amx")))
    return line


def _cflags() -> list[str]:
    return CFLAGS + LEVEL_CFLAGS[isa()]


def isa() -> str:
    """The x86 level the kernels and `--dtype auto` use here: "amx", "avx512", "avx2" or "generic"."""
    flags = set(_cpu_flags().split())
    if "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "generic"


def _build_name() -> str:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(_cflags() + LDFLAGS).encode())
    key.update(_cpu_flags().encode())
    key.update(torch.__version__.encode())
    return f"kvbridge_kernels_{key.hexdigest()[:16]}"


def available() -> bool:
    """Whether the kernels are loaded (building them now if needed); False where they cannot be."""
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return bool(_state["ok"])


def _load() -> bool:
    if os.environ.get("KVBRIDGE_KERNELS", "1") == "0":
        _state["error"] = "KVBRIDGE_KERNELS=0"
        return False
    from torch.utils import cpp_extension

    name = _build_name()
    built = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
    t0 = time.perf_counter()
    try:
        if not built.exists():  # (a built one is loaded as it is: no compiler, no build lock)
            log.warning("building the CPU kernels (engine/kernels, once per machine, ~30 s)")
            flags = {"extra_cflags": _cflags(), "extra_ldflags": LDFLAGS}
            cpp_extension.load(name, [str(p) for p in SOURCES], **flags, is_python_module=False)
        torch.ops.load_library(str(built))
    except Exception as e:  # (no compiler, no ninja, headers missing): torch's ops serve instead
        _state["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
        log.warning("the CPU kernels are not available (%s); using torch's ops", _state["error"])
        return False
    log.info("CPU kernels loaded in %.1f s", time.perf_counter() - t0)
    return True


def error() -> str:
    """Why the kernels are not available ("" when they are or were not tried)."""
    return str(_state.get("error", ""))


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the attention kernel takes these head shapes (else the engine uses torch's ops)."""
    return head_dim % 16 == 0 and heads % kv_heads == 0


def bf16_dot_instruction() -> bool:
    """Whether the bf16 matmuls sum pairs with AVX512-BF16's vdpbf16ps (the native build on a CPU
    that has it; not under KVBRIDGE_ISA=avx2) rather than two FMAs computing the same bits."""
    return isa() in ("avx512", "amx") and "avx512_bf16" in _cpu_flags().split()


def bf16_linear() -> bool:
    """Whether bfloat16 matmuls (and the other bf16 ops) go through linear_bf16.cpp: the kernels
    are loaded and were built for an x86 level they are written for (AVX2 or AVX-512, vec.h)."""
    return isa() != "generic" and available()


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> its packed form for linear_bf16."""
    return torch.ops.kvbridge.pack_bf16(w.to(torch.bfloat16))


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, out_float: bool = False) -> torch.Tensor:
    """x [..., K] bf16 -> x W^T [..., n], float32 if `out_float` else bf16."""
    y = torch.ops.kvbridge.linear_bf16(x.reshape(-1, x.shape[-1]), packed, n, out_float)
    return y.view(*x.shape[:-1], n)


def stream_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for contiguous CPU tensors of equal byte size, with streaming stores."""
    torch.ops.kvbridge.stream_copy(dst, src)


def rope_bf16(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated_heads: int) -> torch.Tensor:
    """The first `rotated_heads` heads of qkv [N, W] bf16 rotated (cos, sin [N, head_dim] bf16) ->
    [N, rotated_heads, head_dim] bf16, rounded as model.apply_rope rounds in bf16."""
    return torch.ops.kvbridge.rope_bf16(qkv, cos, sin, rotated_heads)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [M, H] bf16 in one pass, rounded where transformers' bf16 RMSNorm rounds."""
    return torch.ops.kvbridge.rms_norm_bf16(x, weight, eps)


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] bf16 -> silu(gate) * up [M, I] bf16, rounded as torch's two bf16 ops."""
    return torch.ops.kvbridge.silu_mul_bf16(gate_up)


def decoder_bf16(
    hidden: torch.Tensor,
    weights: list[torch.Tensor],
    shape: tuple[int, int, int],
    eps: float,
    scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: torch.Tensor,
    attention: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    first_layer: int,
) -> torch.Tensor:
    """hidden [N, H] bf16 through decoder layers (weights: six a layer, see decoder_bf16.cpp);
    shape: (heads, kv_heads, intermediate); attention: (tables, rows, ctx_lens) as for
    paged_attention; slots [N] int64: each new token's K row in the pool's first layer
    (KVPool.token_rows); first_layer: the pool's index of the first of these layers."""
    heads, kv_heads, inter = shape
    tables, rows, ctx = attention
    return torch.ops.kvbridge.decoder_bf16(
        hidden, weights, heads, kv_heads, inter, eps, scale, cos, sin, pool, tables, rows, ctx, slots, first_layer
    )


def paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """q [N, heads, head_dim] -> [N, heads, head_dim]; pool [pages, layers, 2, page_size, kv_heads,
    head_dim]; tables [R, max_pages] int64 (padded page ids); rows [N] int64: each query row's
    table; ctx_lens [N] int64: the keys each row sees (a token at position t: t + 1); layer: index
    into the pool."""
    return torch.ops.kvbridge.paged_attention(q, pool, tables, rows, ctx_lens, layer, scale)
