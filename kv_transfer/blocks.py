"""Page blocks of a pool buffer [num_pages, layers_of_rank, 2, page_size, kv_heads, head_dim].

A page of a rank is one contiguous block, and so is a layer sub-range of a page. Copies go
run by run where page ids are consecutive (one block copy per run); scattered ids fall back
to one indexed copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_transfer.layers import LayerRange, local_slice, page_runs


def _ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.int64, device=device)


def _few_runs(runs: list, n: int) -> bool:
    """Run-by-run copies pay a Python call each; worth it while runs are long on average."""
    return len(runs) <= max(4, n // 8)


def gather(buffer: torch.Tensor, rank_range: LayerRange, ids: Sequence[int], lo: int, hi: int) -> torch.Tensor:
    """Layers [lo, hi) of pages `ids` as one contiguous tensor [n, hi - lo, 2, page_size, kv_heads, head_dim].
    A single run of whole pages is a view of the pool (no copy)."""
    layers = local_slice(rank_range, lo, hi)
    runs = page_runs(ids, ids)
    if len(runs) == 1:
        p0, _, n = runs[0]
        return buffer[p0 : p0 + n, layers].contiguous()
    if layers == slice(0, buffer.shape[1]):
        return buffer.index_select(0, _ids(ids, buffer.device))
    return buffer[_ids(ids, buffer.device), layers].contiguous()


def scatter(buffer: torch.Tensor, rank_range: LayerRange, ids: Sequence[int], lo: int, hi: int, src: torch.Tensor):
    """Write src [n, hi - lo, 2, page_size, kv_heads, head_dim] into layers [lo, hi) of pages `ids`."""
    layers = local_slice(rank_range, lo, hi)
    runs = page_runs(range(len(ids)), ids)
    if _few_runs(runs, len(ids)):
        for i, q0, n in runs:
            buffer[q0 : q0 + n, layers].copy_(src[i : i + n])
    elif layers == slice(0, buffer.shape[1]):
        buffer.index_copy_(0, _ids(ids, buffer.device), src.to(buffer.device))
    else:
        buffer[_ids(ids, buffer.device), layers] = src.to(buffer.device)


def copy_pages(
    src: torch.Tensor,
    src_range: LayerRange,
    src_ids: Sequence[int],
    dst: torch.Tensor,
    dst_range: LayerRange,
    dst_ids: Sequence[int],
    lo: int,
    hi: int,
) -> int:
    """Copy layers [lo, hi) of pages src_ids of one pool straight into pages dst_ids of another
    (one copy per run of consecutive ids); returns the bytes copied."""
    s_layers, d_layers = local_slice(src_range, lo, hi), local_slice(dst_range, lo, hi)
    runs = page_runs(src_ids, dst_ids)
    if _few_runs(runs, len(src_ids)):
        for p0, q0, n in runs:
            dst[q0 : q0 + n, d_layers].copy_(src[p0 : p0 + n, s_layers])
    else:
        scatter(dst, dst_range, dst_ids, lo, hi, gather(src, src_range, src_ids, lo, hi))
    return len(src_ids) * (hi - lo) * src[0, 0].numel() * src.element_size()
