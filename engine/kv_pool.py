"""One rank's physical KV pool, page-major so that a page of a rank is one contiguous block.

Shape: [num_pages, num_layers, 2, page_size, kv_heads, head_dim] (2 = K, V). `num_layers`
is the rank's own layer range [start, end); page ids are node-wide (engine/pages.py).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_pages: int,
        layer_range: tuple[int, int],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        buffer: torch.Tensor | None = None,
    ):
        """buffer: memory to lay the pool over (e.g. a shared-memory segment), of the pool's
        exact shape and dtype; None = fresh zeroed memory."""
        self.layer_start, self.layer_end = layer_range
        self.page_size = page_size
        shape = (num_pages, self.layer_end - self.layer_start, 2, page_size, num_kv_heads, head_dim)
        if buffer is None:
            buffer = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(buffer.shape) != shape or buffer.dtype != dtype or not buffer.is_contiguous():
            raise ValueError(
                f"pool buffer is {tuple(buffer.shape)} {buffer.dtype}; expected contiguous {shape} {dtype}"
            )
        self.buffer = buffer

        # [num_pages * num_layers, page block]: row p * num_layers + l is page p of layer l, contiguous
        self._rows = self.buffer.view(num_pages * (self.layer_end - self.layer_start), -1)
        # [num_pages * num_layers * 2 * page_size, kv_heads * head_dim]: one token's K (or V) per row
        self._tokens = self.buffer.view(-1, num_kv_heads * head_dim)

    @property
    def num_pages(self) -> int:
        return self.buffer.shape[0]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of this rank: all its layers, K and V."""
        return self.buffer[0].numel() * self.buffer.element_size()

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. pages, offsets: [N]; k, v: [N, kv_heads, head_dim]."""
        self.write_rows(layer, self.token_rows(pages, offsets), k, v)

    def token_rows(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """[N] the token rows of (page, offset) pairs for K of the pool's first layer: row
        ((page * layers + layer) * 2 + kv) * page_size + offset of the pool seen as
        [.., kv_heads * head_dim]."""
        return pages * (self.buffer.shape[1] * 2 * self.page_size) + offsets

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """write() with the token rows of token_rows() (computed once per step, not per layer)."""
        ps = self.page_size
        rows = rows + (layer - self.layer_start) * 2 * ps
        self._tokens.index_copy_(0, rows, k.reshape(k.shape[0], -1))
        self._tokens.index_copy_(0, rows + ps, v.reshape(v.shape[0], -1))

    def gather(self, layer: int, page_idx: torch.Tensor) -> torch.Tensor:
        """K/V of the given pages: page_idx [..., P] -> [..., P, 2, page_size, kv_heads, head_dim]."""
        rows = page_idx * (self.layer_end - self.layer_start) + (layer - self.layer_start)
        return self._rows.index_select(0, rows.flatten()).view(*page_idx.shape, *self.buffer.shape[2:])
