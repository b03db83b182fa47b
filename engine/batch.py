"""What one forward step computes: the batch description rank 0 sends down the pipeline.

`ForwardBatch` is plain Python data (ids and lengths), identical on every rank;
`AttentionMetadata` is the tensors a rank derives from it once per step, on its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class ForwardBatch:
    rids: tuple[str, ...]  # one entry per request in the step
    starts: tuple[int, ...]  # tokens of the request already in the KV cache (= position of its first new token)
    q_lens: tuple[int, ...]  # new tokens of the request in this step (>= 1)
    page_tables: tuple[tuple[int, ...], ...]  # node-wide page ids covering starts[i] + q_lens[i] tokens
    input_ids: tuple[int, ...]  # the new tokens, concatenated in request order (first stage only)
    sample: tuple[bool, ...]  # whether the request's last new token yields logits (last stage)
    all_logits: bool = False  # project every row, not only sampled ones (scoring a sequence)
    # per request, or () for none: project every row of its chunk too (its prompt logprobs)
    scored: tuple[bool, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def num_sampled(self) -> int:
        return sum(self.sample)


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer of a stage. Rows are the batch's new tokens, [N]."""

    positions: torch.Tensor  # [N] absolute position of each new token
    slot_pages: torch.Tensor  # [N] page id each new token's K/V is written to
    slot_offsets: torch.Tensor  # [N] offset inside that page
    tables: torch.Tensor  # [R, P] each request's page ids covering its context (padded with 0)
    row_table: torch.Tensor  # [N] the request (row of `tables`) of each new token
    decode_rows: int  # requests 0..decode_rows-1 have q_len == 1 (decodes, or a prompt's last token)
    prefill: list[tuple[int, int, int, int]]  # the other requests: (first row, q_len, request, start)
    sample_rows: torch.Tensor  # [S] rows whose hidden state is projected to logits (`logit_rows`)
    page_size: int
    _slot_rows: dict = field(default_factory=dict, repr=False)  # slot_rows() by pool

    @cached_property
    def row_ctx(self) -> torch.Tensor:
        """[N] keys each row attends over: a token at position t sees t + 1."""
        return self.positions + 1

    def slot_rows(self, kv) -> torch.Tensor:
        """[N] each new token's row in the pool `kv` (KVPool.token_rows), computed once per step."""
        rows = self._slot_rows.get(id(kv))
        if rows is None:
            rows = self._slot_rows[id(kv)] = kv.token_rows(self.slot_pages, self.slot_offsets)
        return rows

    # For torch's attention ops (where engine/kernels does not serve): the decodes batched with a
    # key mask, and each prompt chunk's page ids and causal mask. Built on first use.
    @cached_property
    def decode_ctx(self) -> torch.Tensor:  # [B] keys in context of each batched request
        return self.positions[: self.decode_rows] + 1

    @cached_property
    def decode_pages(self) -> torch.Tensor:  # [B, P'] their page ids
        return self.tables[: self.decode_rows, : -(-int(self.decode_ctx.max()) // self.page_size)]

    @cached_property
    def decode_mask(self) -> torch.Tensor:  # [B, 1, 1, P' * page_size] True where the key is in context
        key_pos = torch.arange(self.decode_pages.shape[1] * self.page_size, device=self.positions.device)
        return (key_pos[None, :] < self.decode_ctx[:, None])[:, None, None, :]

    @cached_property
    def prefill_chunks(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        """(first row, q_len, page ids, [q_len, ctx] mask, None for plain causal) per prompt chunk."""
        chunks, device = [], self.positions.device
        for row, q_len, request, start in self.prefill:
            ctx = start + q_len
            mask = None  # the chunk starts at position 0
            if start > 0:  # key j is visible to the query at position t iff j <= t
                mask = torch.arange(ctx, device=device)[None, :] <= torch.arange(start, ctx, device=device)[:, None]
            chunks.append((row, q_len, self.tables[request, : -(-ctx // self.page_size)], mask))
        return chunks

    @staticmethod
    def build(batch: ForwardBatch, page_size: int, device: torch.device) -> AttentionMetadata:
        positions, pages, offsets, row_table = [], [], [], []
        for i, (start, q_len, table) in enumerate(zip(batch.starts, batch.q_lens, batch.page_tables)):
            for t in range(start, start + q_len):
                positions.append(t)
                pages.append(table[t // page_size])
                offsets.append(t % page_size)
            row_table += [i] * q_len
        num_rows = len(positions)

        def as_tensor(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        # Requests with one new token must come first in the batch (rows 0..B-1): torch's ops
        # batch them into one call.
        num_decode = 0
        while num_decode < len(batch.q_lens) and batch.q_lens[num_decode] == 1:
            num_decode += 1
        used = [-(-(s + n) // page_size) for s, n in zip(batch.starts, batch.q_lens)]
        width = max(used)
        tables = [list(t[:u]) + [0] * (width - u) for t, u in zip(batch.page_tables, used)]
        prefill, row = [], num_decode
        for i in range(num_decode, len(batch.q_lens)):
            prefill.append((row, batch.q_lens[i], i, batch.starts[i]))
            row += batch.q_lens[i]
        return AttentionMetadata(
            positions=as_tensor(positions),
            slot_pages=as_tensor(pages),
            slot_offsets=as_tensor(offsets),
            tables=as_tensor(tables),
            row_table=as_tensor(row_table),
            decode_rows=num_decode,
            prefill=prefill,
            sample_rows=torch.arange(num_rows, device=device) if batch.all_logits else as_tensor(logit_rows(batch)[0]),
            page_size=page_size,
        )


def logit_rows(batch: ForwardBatch) -> tuple[list[int], list[int] | None, list[tuple[int, int, int]]]:
    """The rows projected to logits: each sampled request's last row and every row of each scored
    request (batch.scored), in batch order. Also where each sampled request's row is among them
    (None when no request is scored: then they are exactly the sampled rows) and, for each scored
    request, (its index in the batch, its first projected row, its row count)."""
    rows, sampled_at, scored_at = [], [], []
    scored = batch.scored or (False,) * len(batch.q_lens)
    row = 0
    for i, (q_len, sample) in enumerate(zip(batch.q_lens, batch.sample)):
        if scored[i]:
            scored_at.append((i, len(rows), q_len))
            rows += range(row, row + q_len)
        elif sample:
            rows.append(row + q_len - 1)
        if sample:
            sampled_at.append(len(rows) - 1)
        row += q_len
    return rows, (sampled_at if scored_at else None), scored_at
