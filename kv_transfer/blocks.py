"""Page blocks of a pool buffer [num_pages, layers_of_rank, 2, page_size, kv_heads, head_dim].

A page of a rank is one contiguous block, and so is a layer sub-range of a page. Copies go
run by run where page ids are consecutive (one block copy per run); scattered ids fall back
to one indexed copy. A large contiguous run between CPU pools is copied with streaming stores
(engine/kernels stream_copy): the destination is a pool that a later step (or another process)
reads, not this copy, so its lines need not be read first nor kept in this core's cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvbridge.engine import kernels
from kvbridge.kv_transfer.layers import LayerRange, local_slice, page_runs

RUN_BYTES = 64 << 10  # a run copy this large pays for its Python call; smaller runs go by index ops
STREAM_BYTES = 256 << 10  # a CPU run copy this large goes by streaming stores


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src); by streaming stores for a large contiguous CPU run of the same dtype."""
    if (
        dst.device.type == src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.nbytes >= STREAM_BYTES
        and dst.is_contiguous()
        and src.is_contiguous()
        and kernels.available()
    ):
        kernels.stream_copy(dst, src)
    else:
        dst.copy_(src)


def _ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.int64, device=device)


def _by_runs(runs: list, nbytes: int) -> bool:
    """Copy run by run (one block copy each) when runs are few or long, else by one indexed copy."""
    return len(runs) <= 4 or nbytes // len(runs) >= RUN_BYTES


def _block_bytes(buffer: torch.Tensor, n: int, lo: int, hi: int) -> int:
    return n * (hi - lo) * buffer[0, 0].numel() * buffer.element_size()


def gather(
    buffer: torch.Tensor,
    rank_range: LayerRange,
    ids: Sequence[int],
    lo: int,
    hi: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Layers [lo, hi) of pages `ids` as one contiguous tensor [n, hi - lo, 2, page_size, kv_heads, head_dim],
    written into `out` (a flat uint8 scratch tensor on the pool's device, large enough) when given. A single
    run of whole pages is a view of the pool (no copy)."""
    layers = local_slice(rank_range, lo, hi)
    runs = page_runs(ids, ids)
    whole = layers == slice(0, buffer.shape[1])
    if len(runs) == 1 and whole:
        p0, _, n = runs[0]
        return buffer[p0 : p0 + n]
    shape = (len(ids), hi - lo, *buffer.shape[2:])
    if out is None:
        dst = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
    else:
        dst = out[: _block_bytes(buffer, len(ids), lo, hi)].view(buffer.dtype).view(shape)
    if _by_runs(runs, _block_bytes(buffer, len(ids), lo, hi)):
        i = 0
        for p0, _, n in runs:
            dst[i : i + n].copy_(buffer[p0 : p0 + n, layers])
            i += n
    elif whole:
        torch.index_select(buffer, 0, _ids(ids, buffer.device), out=dst)
    else:
        dst.copy_(buffer[_ids(ids, buffer.device), layers])
    return dst


def scatter(buffer: torch.Tensor, rank_range: LayerRange, ids: Sequence[int], lo: int, hi: int, src: torch.Tensor):
    """Write src [n, hi - lo, 2, page_size, kv_heads, head_dim] into layers [lo, hi) of pages `ids`."""
    layers = local_slice(rank_range, lo, hi)
    runs = page_runs(range(len(ids)), ids)
    if _by_runs(runs, _block_bytes(buffer, len(ids), lo, hi)):
        for i, q0, n in runs:
            _copy(buffer[q0 : q0 + n, layers], src[i : i + n])
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
    scratch: Callable[[int], torch.Tensor] | None = None,
) -> int:
    """Copy layers [lo, hi) of pages src_ids of one pool straight into pages dst_ids of another
    (one copy per run of consecutive ids; short scattered runs go through scratch(nbytes), a reusable
    uint8 buffer); returns the bytes."""
    s_layers, d_layers = local_slice(src_range, lo, hi), local_slice(dst_range, lo, hi)
    runs = page_runs(src_ids, dst_ids)
    nbytes = _block_bytes(src, len(src_ids), lo, hi)
    if _by_runs(runs, nbytes):
        for p0, q0, n in runs:
            _copy(dst[q0 : q0 + n, d_layers], src[p0 : p0 + n, s_layers])
    else:
        out = scratch(nbytes) if scratch else None
        scatter(dst, dst_range, dst_ids, lo, hi, gather(src, src_range, src_ids, lo, hi, out))
    return nbytes
