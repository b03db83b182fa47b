"""Layer maps between pipeline ranks, and the plans that cut page ranges into chunks. Pure Python.

A layer range is [start, end) of the model's layers. A prefill rank sends a decode rank
exactly the layers both own: their overlap. Prefill and decode PP sizes are independent
(P pp 2 over 6 layers = [(0,3),(3,6)]; D pp 3 = [(0,2),(2,4),(4,6)]; P rank 0 feeds D
ranks 0 and 1 (layers [0,2) and [2,3)); P rank 1 feeds D ranks 1 and 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LayerRange = tuple[int, int]  # [start, end)


def overlap(a: LayerRange, b: LayerRange) -> LayerRange | None:
    """The layers in both ranges, or None."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def overlaps(prefill: Sequence[LayerRange], decode: Sequence[LayerRange]) -> list[tuple[int, int, LayerRange]]:
    """Every (prefill rank, decode rank, [lo, hi)) whose layer ranges overlap, by prefill rank then decode rank."""
    pairs = []
    for p, pr in enumerate(prefill):
        for d, dr in enumerate(decode):
            both = overlap(pr, dr)
            if both is not None:
                pairs.append((p, d, both))
    return pairs


def check_ranges(ranges: Sequence[LayerRange], num_layers: int) -> None:
    """Raise ValueError unless the ranges tile [0, num_layers) in order."""
    start = 0
    for lo, hi in ranges:
        if lo != start or hi <= lo:
            raise ValueError(f"layer ranges {list(ranges)} do not tile [0, {num_layers}) in order")
        start = hi
    if start != num_layers:
        raise ValueError(f"layer ranges {list(ranges)} do not tile [0, {num_layers}) in order")


def local_slice(rank_range: LayerRange, lo: int, hi: int) -> slice:
    """The rank-local layer indices of model layers [lo, hi) (which must lie inside rank_range)."""
    start, end = rank_range
    assert start <= lo < hi <= end, f"layers [{lo}, {hi}) outside the rank's [{start}, {end})"
    return slice(lo - start, hi - start)


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Cut a page mapping src[i] -> dst[i] into runs (src0, dst0, n) where both sides are consecutive:
    each run is one block copy of n pages."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@dataclass(frozen=True)
class Chunk:
    """One bounded piece of a push: pages [page_start, page_end) of the push's page lists, model
    layers [layer_start, layer_end)."""

    page_start: int  # index into the push's page lists
    page_end: int
    layer_start: int  # model layer
    layer_end: int


def plan_chunks(num_pages: int, lo: int, hi: int, layer_block_bytes: int, max_bytes: int) -> list[Chunk]:
    """Cut num_pages pages of layers [lo, hi) into chunks of at most max_bytes: whole pages when a
    page fits, else single pages cut by layers (a single layer of a page must fit)."""
    if layer_block_bytes > max_bytes:
        raise ValueError(f"one layer of a page is {layer_block_bytes} bytes, over the chunk limit {max_bytes}")
    page_bytes = (hi - lo) * layer_block_bytes
    if page_bytes <= max_bytes:
        per = max_bytes // page_bytes
        return [Chunk(i, min(i + per, num_pages), lo, hi) for i in range(0, num_pages, per)]
    per_layers = max_bytes // layer_block_bytes
    return [
        Chunk(i, i + 1, layer, min(layer + per_layers, hi))
        for i in range(num_pages)
        for layer in range(lo, hi, per_layers)
    ]
