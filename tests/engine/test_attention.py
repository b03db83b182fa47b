"""Paged attention (K/V read through scattered page tables) equals dense causal attention."""

from __future__ import annotations

import math
import random

import torch

from kvbridge.engine.batch import AttentionMetadata, ForwardBatch
from kvbridge.engine.config import ModelConfig
from kvbridge.engine.kv_pool import KVPool
from kvbridge.engine.model import paged_attention

CONFIG = ModelConfig(
    vocab_size=16,
    hidden_size=48,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q: [n, heads, d] at positions start..start+n-1; k, v: [start+n, kv_heads, d]. Plain math."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def test_paged_attention_equals_dense_for_mixed_decode_and_prefill_batch():
    torch.manual_seed(0)
    rng = random.Random(0)
    page_size, layer = 4, 1
    pool = KVPool(64, (0, 2), page_size, CONFIG.num_key_value_heads, CONFIG.head_dim, torch.float32)
    free = list(range(64))
    rng.shuffle(free)  # scattered, non-monotonic page ids
    # (tokens already cached, new tokens): three decodes first, then prefill chunks
    shapes = [(0, 1), (9, 1), (30, 1), (0, 13), (7, 5), (16, 16)]
    rids, tables, qs, ks, vs = [], [], [], [], []
    for i, (start, n) in enumerate(shapes):
        ctx = start + n
        table = [free.pop() for _ in range(-(-ctx // page_size))]
        k = torch.randn(ctx, CONFIG.num_key_value_heads, CONFIG.head_dim)
        v = torch.randn(ctx, CONFIG.num_key_value_heads, CONFIG.head_dim)
        for t in range(start):  # the cached prefix, written as earlier steps would have
            pool.write(
                layer, torch.tensor([table[t // page_size]]), torch.tensor([t % page_size]), k[t : t + 1], v[t : t + 1]
            )
        rids.append(f"r{i}")
        tables.append(tuple(table))
        qs.append(torch.randn(n, CONFIG.num_attention_heads, CONFIG.head_dim))
        ks.append(k)
        vs.append(v)
    batch = ForwardBatch(
        rids=tuple(rids),
        starts=tuple(s for s, _ in shapes),
        q_lens=tuple(n for _, n in shapes),
        page_tables=tuple(tables),
        input_ids=(0,) * sum(n for _, n in shapes),
        sample=(True,) * len(shapes),
    )
    meta = AttentionMetadata.build(batch, page_size, torch.device("cpu"))
    assert meta.decode_rows == 3 and len(meta.prefill) == 3
    new_k = torch.cat([k[s:] for k, (s, _) in zip(ks, shapes)])
    new_v = torch.cat([v[s:] for v, (s, _) in zip(vs, shapes)])
    pool.write(layer, meta.slot_pages, meta.slot_offsets, new_k, new_v)

    out = paged_attention(torch.cat(qs), layer, meta, pool, CONFIG)

    expected = torch.cat([dense_attention(q, k, v, s) for q, k, v, (s, _) in zip(qs, ks, vs, shapes)])
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_writes_land_in_their_page_and_offset_only():
    pool = KVPool(5, (2, 4), 4, 1, 2, torch.float32)
    k, v = torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0)
    pool.write(3, torch.tensor([4, 1]), torch.tensor([3, 0]), k, v)
    assert pool.buffer.sum().item() == 12.0  # 2 tokens x 2 dims x (1 + 2)
    assert pool.buffer[4, 1, 0, 3].tolist() == [[1.0, 1.0]] and pool.buffer[1, 1, 1, 0].tolist() == [[2.0, 2.0]]
    assert pool.page_bytes == 1 * 2 * 2 * 4 * 1 * 2 * 4  # one page: its layers, K and V, page_size tokens
