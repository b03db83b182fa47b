"""Layer maps between heterogeneous PP ranks, chunk plans, and page-block copies."""

from __future__ import annotations

import random

import pytest
import torch

from kvbridge.engine.model import stage_ranges
from kvbridge.kv_transfer import blocks
from kvbridge.kv_transfer.blocks import copy_pages, gather, scatter
from kvbridge.kv_transfer.layers import Chunk, check_ranges, local_slice, overlap, overlaps, page_runs, plan_chunks


def test_overlaps_p2_by_d3_over_six_layers():
    assert overlaps([(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]) == [
        (0, 0, (0, 2)),
        (0, 1, (2, 3)),
        (1, 1, (3, 4)),
        (1, 2, (4, 6)),
    ]


def test_overlaps_p3_by_d2_and_identical_ranges():
    assert overlaps([(0, 2), (2, 4), (4, 6)], [(0, 3), (3, 6)]) == [
        (0, 0, (0, 2)),
        (1, 0, (2, 3)),
        (1, 1, (3, 4)),
        (2, 1, (4, 6)),
    ]
    assert overlaps([(0, 3), (3, 6)], [(0, 3), (3, 6)]) == [(0, 0, (0, 3)), (1, 1, (3, 6))]


@pytest.mark.parametrize("num_layers,p,d", [(1, 1, 1), (7, 2, 3), (7, 3, 2), (7, 4, 1), (30, 1, 5), (30, 4, 3)])
def test_overlaps_cover_every_layer_exactly_once(num_layers, p, d):
    pairs = overlaps(stage_ranges(num_layers, p), stage_ranges(num_layers, d))
    covered = sorted(layer for _, _, (lo, hi) in pairs for layer in range(lo, hi))
    assert covered == list(range(num_layers))


def test_overlap_of_touching_ranges_is_none():
    assert overlap((0, 3), (3, 6)) is None
    assert overlap((0, 3), (2, 6)) == (2, 3)


def test_check_ranges_rejects_gaps_and_short_tilings():
    check_ranges([(0, 2), (2, 5)], 5)
    with pytest.raises(ValueError, match="do not tile"):
        check_ranges([(0, 2), (3, 5)], 5)
    with pytest.raises(ValueError, match="do not tile"):
        check_ranges([(0, 2), (2, 4)], 5)


def test_local_slice_is_rank_relative():
    assert local_slice((3, 6), 4, 6) == slice(1, 3)


def test_page_runs_join_consecutive_pairs_only():
    assert page_runs([3, 4, 5, 9, 10], [7, 8, 9, 1, 3]) == [(3, 7, 3), (9, 1, 1), (10, 3, 1)]
    assert page_runs([], []) == []


def test_plan_chunks_whole_pages_when_they_fit():
    # 5 pages x 2 layers x 100 bytes; 450 bytes per chunk -> 2 pages per chunk
    assert plan_chunks(5, 4, 6, 100, 450) == [Chunk(0, 2, 4, 6), Chunk(2, 4, 4, 6), Chunk(4, 5, 4, 6)]


def test_plan_chunks_cut_pages_by_layers_when_a_page_is_too_big():
    # one page of 5 layers x 100 bytes = 500 > 250: two layers per chunk
    assert plan_chunks(2, 0, 5, 100, 250) == [
        Chunk(0, 1, 0, 2),
        Chunk(0, 1, 2, 4),
        Chunk(0, 1, 4, 5),
        Chunk(1, 2, 0, 2),
        Chunk(1, 2, 2, 4),
        Chunk(1, 2, 4, 5),
    ]
    with pytest.raises(ValueError, match="over the chunk limit"):
        plan_chunks(1, 0, 1, 100, 99)


def make_buffer(num_pages: int, layers: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, layers, 2, 4, 2, 3, generator=g)


@pytest.mark.parametrize("by_runs", [True, False])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("lo,hi", [(3, 6), (4, 5)])
def test_gather_scatter_copy_match_per_page_reference(monkeypatch, by_runs, consecutive, lo, hi):
    monkeypatch.setattr(blocks, "RUN_BYTES", 0 if by_runs else 1 << 40)  # force either copy strategy
    src_range, dst_range = (3, 6), (2, 7)
    src, dst = make_buffer(40, 3, 0), torch.zeros(40, 5, 2, 4, 2, 3)
    rng = random.Random(1)
    src_ids = list(range(5, 25)) if consecutive else rng.sample(range(40), 20)
    dst_ids = list(range(12, 32)) if consecutive else rng.sample(range(40), 20)

    scratch = torch.full((1 << 16,), 7, dtype=torch.uint8)
    for out in (None, scratch):
        block = gather(src, src_range, src_ids, lo, hi, out)
        assert block.shape == (20, hi - lo, 2, 4, 2, 3) and block.is_contiguous()
        for i, p in enumerate(src_ids):
            assert torch.equal(block[i], src[p, lo - 3 : hi - 3])

    scatter(dst, dst_range, dst_ids, lo, hi, block)
    expected = torch.zeros_like(dst)
    for p, q in zip(src_ids, dst_ids):
        expected[q, lo - 2 : hi - 2] = src[p, lo - 3 : hi - 3]
    assert torch.equal(dst, expected)

    direct = torch.zeros_like(dst)
    n = copy_pages(src, src_range, src_ids, direct, dst_range, dst_ids, lo, hi, scratch=lambda n: scratch)
    assert torch.equal(direct, expected)
    assert n == 20 * (hi - lo) * 2 * 4 * 2 * 3 * 4
