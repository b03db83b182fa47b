"""The CPU paged-attention kernel (engine/kernels) against attention computed by torch from the
gathered pages: fp32 to float rounding, bf16 and fp16 within one rounding of the output; GQA,
contexts of 1 token to many pages, pages in any order; bad tables refused with a message; a
prompt's rows bit for bit the same in one chunk, in several, or as decodes. And the engine
through it is the engine through torch's ops."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from kvbridge.common.sampling import SamplingParams
from kvbridge.engine import kernels
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm import LLM
from kvbridge.engine.model import apply_rope, rms_norm
from kvbridge.engine.weights import TINY_CONFIG, tiny_random
from tests.conftest import make_llm

PAGES, LAYERS, PS, KVH, HD, HEADS = 40, 3, 16, 3, 64, 9

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"no C++ compiler here: {kernels.error()}")


def reference(q, pool, tables, lens, layer, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    kvh, hd, groups = pool.shape[4], pool.shape[5], q.shape[1] // pool.shape[4]
    for b in range(q.shape[0]):
        ctx = int(lens[b])
        pages = pool[tables[b], layer].double()  # [P, 2, PS, KVH, HD]
        k = pages[:, 0].reshape(-1, kvh, hd)[:ctx].repeat_interleave(groups, dim=1)  # [T, heads, HD]
        v = pages[:, 1].reshape(-1, kvh, hd)[:ctx].repeat_interleave(groups, dim=1)
        weights = (torch.einsum("hd,thd->ht", q[b].double(), k) * scale).softmax(-1)
        out[b] = torch.einsum("ht,thd->hd", weights, v)
    return out


def decode(q, pool, tables, lens, layer, scale):
    """One query row per table."""
    return kernels.paged_attention(q, pool, tables, torch.arange(len(lens)), lens, layer, scale)


def case(dtype, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(PAGES, LAYERS, 2, PS, KVH, HD, generator=g).to(dtype)
    max_pages = max(-(-n // PS) for n in lens)
    tables = torch.stack([torch.randperm(PAGES, generator=g)[:max_pages] for _ in lens])
    q = torch.randn(len(lens), HEADS, HD, generator=g).to(dtype)
    return q, pool, tables, torch.tensor(lens)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_decode_attention_equals_attention_over_the_gathered_pages(dtype, tolerance):
    lens = [1, 15, 16, 17, 100, 16 * 12]
    q, pool, tables, ctx = case(dtype, lens)
    scale = 1 / math.sqrt(HD)
    for layer in range(LAYERS):
        got = decode(q, pool, tables, ctx, layer, scale)
        assert got.dtype == dtype and got.shape == q.shape
        want = reference(q, pool, tables, ctx, layer, scale)
        assert (got.double() - want).abs().max().item() <= tolerance
    # a one-token context is that token's V exactly, for every query head of its group
    one = decode(q, pool, tables, ctx, 0, scale)[0]
    v = pool[tables[0, 0], 0, 1, 0]  # [KVH, HD]
    assert torch.equal(one, v.repeat_interleave(HEADS // KVH, dim=0))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, pool, t, n: (q, pool, t, n.clone().fill_(0)), "context length out of range"),
        (lambda q, pool, t, n: (q, pool, t, n + PS * t.shape[1]), "context length out of range"),
        (lambda q, pool, t, n: (q, pool, t.clone().fill_(PAGES), n), "page id out of range"),
        (lambda q, pool, t, n: (q, pool, t.int(), n), "tables must be a contiguous int64"),
        (lambda q, pool, t, n: (q.float(), pool, t, n), "q and pool dtypes differ"),
        (lambda q, pool, t, n: (q[:, :4], pool, t, n), "q must be a contiguous"),
    ],
)
def test_bad_arguments_are_refused_before_any_read(change, message):
    args = change(*case(torch.bfloat16, [5, 40]))
    with pytest.raises(RuntimeError, match=message):
        decode(*args, 0, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_rows_are_causal_attention_and_the_same_bits_however_they_are_chunked(dtype):
    """70 prompt tokens over scattered pages, beside another request's rows: all in one call, in
    three chunks, and one row at a time (as decodes) give identical bits; each row is attention
    over the keys up to its own position."""
    q, pool, tables, _ = case(dtype, [70, 33], seed=3)
    q = torch.randn(70 + 33, HEADS, HD, generator=torch.Generator().manual_seed(4)).to(dtype)
    rows = torch.tensor([0] * 70 + [1] * 33)
    ctx = torch.cat([torch.arange(1, 71), torch.arange(1, 34)])
    scale = 1 / math.sqrt(HD)
    whole = kernels.paged_attention(q, pool, tables, rows, ctx, 2, scale)
    want = reference(q, pool, tables[rows], ctx, 2, scale)
    assert (whole.double() - want).abs().max().item() <= (2e-6 if dtype == torch.float32 else 2e-2)
    for cuts in ([0, 20, 50, 70, 103], [0, 103], list(range(104))):
        parts = [
            kernels.paged_attention(q[a:b].contiguous(), pool, tables, rows[a:b], ctx[a:b], 2, scale)
            for a, b in itertools.pairwise(cuts)
        ]
        assert torch.equal(torch.cat(parts), whole)
    alone = kernels.paged_attention(q[:70].contiguous(), pool, tables[:1], rows[:70], ctx[:70], 2, scale)
    assert torch.equal(alone, whole[:70])


@pytest.mark.parametrize(("head_dim", "page_size"), [(16, 16), (32, 5), (128, 16), (80, 32)])
def test_other_head_dims_and_page_sizes(head_dim, page_size):
    """The head dims compiled apart (64 and 128) and the generic path; pages not a multiple of 16."""
    g = torch.Generator().manual_seed(head_dim)
    pool = torch.randn(30, 2, 2, page_size, 2, head_dim, generator=g).bfloat16()
    lens = [1, 7, page_size * 4 + 3]
    tables = torch.stack([torch.randperm(30, generator=g)[: -(-max(lens) // page_size)] for _ in lens])
    q = torch.randn(3, 6, head_dim, generator=g).bfloat16()
    got = decode(q, pool, tables, torch.tensor(lens), 1, 0.3)
    assert (got.double() - reference(q, pool, tables, torch.tensor(lens), 1, 0.3)).abs().max().item() <= 2e-2
    rows, ctx = torch.tensor([2] * lens[2]), torch.arange(1, lens[2] + 1)  # the last one's prompt, whole
    whole = kernels.paged_attention(q[2:].expand(lens[2], -1, -1).contiguous(), pool, tables, rows, ctx, 1, 0.3)
    assert torch.equal(whole[-1], got[2])


def test_rows_that_name_no_table_are_refused():
    q, pool, tables, ctx = case(torch.float32, [5, 40])
    with pytest.raises(RuntimeError, match="row's table out of range"):
        kernels.paged_attention(q, pool, tables, torch.tensor([0, 2]), ctx, 0, 0.125)
    with pytest.raises(RuntimeError, match="rows must be a contiguous int64"):
        kernels.paged_attention(q, pool, tables, torch.tensor([0, 1], dtype=torch.int32), ctx, 0, 0.125)


def test_head_shapes_the_kernel_does_not_take_are_left_to_torch_and_refused_if_sent():
    assert kernels.supports(9, 3, 64) and kernels.supports(32, 8, 128) and kernels.supports(4, 2, 16)
    assert not kernels.supports(4, 2, 8) and not kernels.supports(9, 4, 64)
    pool = torch.zeros(4, 1, 2, 4, 2, 8)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16, got 8"):
        decode(torch.zeros(1, 4, 8), pool, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 0, 1.0)


def test_engine_decode_through_the_kernel_equals_torchs_ops(tiny_model, monkeypatch):
    """Greedy tokens and their logprobs, batched decodes at several lengths (fp32)."""
    prompts = [[5 + i * 7 % 50 for i in range(n)] for n in (3, 17, 40, 66)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0)

    def run():
        llm = LLM(EngineConfig(model="tiny-random", dtype="float32", page_size=8), model=tiny_model, progress=False)
        return [(c.output_ids, [lp.logprob for lp in c.logprobs]) for c in llm.generate(prompts, params)]

    fast = run()
    monkeypatch.setattr(kernels, "available", lambda: False)
    slow = run()
    for (ids_f, lp_f), (ids_s, lp_s) in zip(fast, slow):
        assert ids_f == ids_s
        assert lp_f == pytest.approx(lp_s, abs=1e-5)


needs_bf16 = pytest.mark.skipif(not kernels.bf16_linear(), reason="this CPU has neither AVX2 nor AVX-512")


@needs_bf16
@pytest.mark.parametrize(("n", "k"), [(96, 64), (100, 64), (7, 576), (33, 3), (1000, 40)])
def test_bf16_linear_is_the_exact_products_summed_in_float32_for_every_row(n, k):
    """Against float64 over the same bf16 values: float32 rounding of the sums only; a row's
    result is bit for bit the same alone and in any batch (n not a multiple of the tile too; 1 to
    3 rows walk several tiles at once, more rows one tile at a time)."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    x = torch.randn(37, k, generator=g).bfloat16()
    packed = kernels.pack_bf16(w)
    got = kernels.linear_bf16(x, packed, n, out_float=True)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (37, n)
    assert (got.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    for rows in (slice(0, 1), slice(1, 3), slice(20, 23), slice(5, 13), slice(30, 37)):
        assert torch.equal(kernels.linear_bf16(x[rows], packed, n, out_float=True), got[rows])
    rounded = kernels.linear_bf16(x, packed, n)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())
    for out_float in (True, False):  # no rows (a step whose rows are all mid-prompt samples none)
        assert kernels.linear_bf16(x[:0], packed, n, out_float=out_float).shape == (0, n)


def pair_dot_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T summed as vdpbf16ps sums (engine/kernels/vec.h): over pairs of k in order, the odd k's
    product added and rounded to float32, then the even k's (float64 holds each sum exactly here)."""
    x, w = x.double(), w.double()
    if x.shape[1] % 2:
        x, w = torch.nn.functional.pad(x, (0, 1)), torch.nn.functional.pad(w, (0, 1))
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(0, x.shape[1], 2):
        acc = (acc.double() + x[:, k + 1 : k + 2] * w[:, k + 1]).float()
        acc = (acc.double() + x[:, k : k + 1] * w[:, k]).float()
    return acc


@needs_bf16
@pytest.mark.parametrize(("n", "k"), [(96, 64), (7, 576), (33, 3), (40, 1)])
def test_bf16_linear_sums_each_pair_of_k_as_vdpbf16ps_does_on_every_x86_level(n, k):
    """The AVX512-BF16 instruction where the CPU has it, two FMAs elsewhere: the same bits."""
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    x = torch.randn(13, k, generator=g).bfloat16()
    got = kernels.linear_bf16(x, kernels.pack_bf16(w), n, out_float=True)
    assert torch.equal(got, pair_dot_reference(x, w))


@needs_bf16
def test_bf16_linear_reads_denormals_as_zero_and_flushes_them():
    """vdpbf16ps's rule on every level: a denormal x or w is 0, and so is a denormal sum."""
    tiny = torch.tensor([2.0**-130], dtype=torch.bfloat16)  # a bf16 denormal
    w = torch.tensor([[1.0, 1.0], [2.0**-70, 2.0**-70]], dtype=torch.bfloat16)
    x = torch.cat([torch.tensor([1.0], dtype=torch.bfloat16), tiny]).view(1, 2)
    got = kernels.linear_bf16(x, kernels.pack_bf16(w), 2, out_float=True)
    # row 0: 1 x 1 + denormal x 1 = 1 (the denormal read as 0); row 1: 2^-70 x 1 = 2^-70, normal
    assert got.tolist() == [[1.0, 2.0**-70]]
    x = torch.tensor([[2.0**-70, 2.0**-70]], dtype=torch.bfloat16)
    got = kernels.linear_bf16(x, kernels.pack_bf16(w), 2, out_float=True)
    assert got.tolist() == [[2.0**-69, 0.0]]  # 2^-140 twice: denormal sums, flushed to 0


@pytest.mark.parametrize(("offset", "n"), [(0, 1 << 20), (3, (1 << 20) + 77), (1, 63), (0, 0)])
def test_stream_copy_is_a_copy_at_any_alignment_and_size(offset, n):
    src = torch.randint(0, 256, (n + 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    dst = torch.zeros(n + 8, dtype=torch.uint8)
    kernels.stream_copy(dst[offset : offset + n], src[5 : 5 + n])
    assert torch.equal(dst[offset : offset + n], src[5 : 5 + n])
    assert not dst[:offset].any() and not dst[offset + n :].any()  # nothing written outside
    with pytest.raises(RuntimeError, match="stream_copy: 9 source bytes for 8 destination bytes"):
        kernels.stream_copy(torch.zeros(8, dtype=torch.uint8), torch.zeros(9, dtype=torch.uint8))


@needs_bf16
def test_silu_mul_is_torchs_silu_then_product_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 2 * 1536, generator=g) * 4).bfloat16()
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 0.0])
    gate, up = x.chunk(2, dim=-1)
    want, got = torch.nn.functional.silu(gate) * up, kernels.silu_mul_bf16(x)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 1536)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(RuntimeError, match="gate_up must be a contiguous bfloat16"):
        kernels.silu_mul_bf16(x[:, :40])


@needs_bf16
def test_rms_norm_is_torchs_bf16_rms_norm_and_the_same_for_a_row_in_any_batch():
    g = torch.Generator().manual_seed(6)
    x, w = (torch.randn(40, 576, generator=g) * 3).bfloat16(), torch.randn(576, generator=g).bfloat16()
    got = kernels.rms_norm_bf16(x, w, 1e-5)
    assert torch.equal(got, rms_norm(x, w, 1e-5))
    for rows in (slice(0, 1), slice(3, 9)):
        assert torch.equal(kernels.rms_norm_bf16(x[rows].contiguous(), w, 1e-5), got[rows])
    with pytest.raises(RuntimeError, match="weight must be a contiguous bfloat16"):
        kernels.rms_norm_bf16(x, w[:64], 1e-5)


@needs_bf16
def test_rope_is_torchs_bf16_rotary_embedding_bit_for_bit():
    g = torch.Generator().manual_seed(7)
    n, d = 37, 64
    qkv = (torch.randn(n, (9 + 3 + 3) * d, generator=g) * 2).bfloat16()
    cos, sin = torch.randn(n, d, generator=g).bfloat16(), torch.randn(n, d, generator=g).bfloat16()
    got = kernels.rope_bf16(qkv, cos, sin, 12)
    assert got.shape == (n, 12, d) and got.is_contiguous()
    assert torch.equal(got, apply_rope(qkv[:, : 12 * d].view(n, 12, d), cos[:, None], sin[:, None]))
    with pytest.raises(RuntimeError, match="the heads fit qkv"):
        kernels.rope_bf16(qkv, cos, sin, 16)


@needs_bf16
def test_bf16_linear_refuses_shapes_that_do_not_match_the_packed_weights():
    packed = kernels.pack_bf16(torch.ones(40, 8))
    with pytest.raises(RuntimeError, match="x has 6 columns; the weights 8"):
        kernels.linear_bf16(torch.ones(2, 6).bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match="n does not match the weights"):
        kernels.linear_bf16(torch.ones(2, 8).bfloat16(), packed, 70)
    with pytest.raises(RuntimeError, match="n does not match the weights"):
        kernels.linear_bf16(torch.ones(2, 8).bfloat16(), packed, 32)  # (a whole tile short)


@needs_bf16
def test_a_bf16_requests_tokens_do_not_depend_on_what_it_is_batched_with(tiny_model):
    """The packed matmuls and the decode kernel compute each row alone: one prompt run alone and
    beside seven others gives the same tokens and logprobs, bit for bit."""
    prompts = [[5 + (i * 11 + j) % 60 for j in range(9 + 5 * i)] for i in range(8)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=0)

    def run(batch):
        llm = LLM(EngineConfig(model="tiny-random", dtype="bfloat16", page_size=8), model=tiny_model, progress=False)
        assert llm.stages[0].packed
        return [(c.output_ids, [lp.logprob for lp in c.logprobs]) for c in llm.generate(batch, params)]

    together = run(prompts)
    for i in (0, 3, 7):
        assert run([prompts[i]]) == [together[i]]


@needs_bf16
@pytest.mark.parametrize("stages", [1, 2])
def test_the_one_call_decoder_is_the_layer_by_layer_forward_bit_for_bit(stages):
    """decoder_bf16.cpp runs a stage's layers in one call: the same tokens and logprobs, bit for
    bit, as DecoderLayer.forward op by op, over prompts chunked beside decodes, one stage or two
    (the second's pool starts at its own first layer)."""
    model = tiny_random(config=dataclasses.replace(TINY_CONFIG, head_dim=32))
    prompts = [[5 + (i * 13 + j) % 70 for j in range(6 + 11 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=9, ignore_eos=True, logprobs=0)

    def run(fused: bool):
        llm = make_llm(model, num_stages=stages, dtype="bfloat16", page_size=8, chunked_prefill_size=24)
        assert [s.fused for s in llm.stages] == [True] * stages
        for s in llm.stages:
            s.fused = fused
        return [(c.output_ids, [lp.logprob for lp in c.logprobs]) for c in llm.generate(prompts, params)]

    assert run(True) == run(False)


@needs_bf16
def test_the_one_call_decoder_refuses_a_slot_outside_the_pool_before_writing():
    model = tiny_random(config=dataclasses.replace(TINY_CONFIG, head_dim=32))
    llm = make_llm(model, dtype="bfloat16", page_size=8)
    stage, c = llm.stages[0], model.config
    pool = stage.new_kv_pool(4, 8)
    rows = pool.buffer.numel() // (c.num_key_value_heads * c.head_dim)
    h = torch.ones(1, c.hidden_size, dtype=torch.bfloat16)
    cos, sin = stage.cos[:1], stage.sin[:1]
    attention = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long))
    shape = (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)

    def call(slot: int, weights=stage.fused_weights):
        slots = torch.tensor([slot])
        return kernels.decoder_bf16(h, weights, shape, 1e-5, 0.1, cos, sin, pool.buffer, attention, slots, 0)

    for slot in (-1, rows - (2 * c.num_hidden_layers - 1) * 8):  # (the last layer's V row would be past the end)
        with pytest.raises(RuntimeError, match="slot row out of range"):
            call(slot)
    assert not pool.buffer.any()
    with pytest.raises(RuntimeError, match="six tensors a layer, got 5"):
        call(0, stage.fused_weights[:5])
    assert call(0).shape == (1, c.hidden_size)
    assert pool.buffer.any()  # (the first page's rows took the token's K and V)
