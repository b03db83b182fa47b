"""What one forward step computes: the batch description rank 0 sends down the pipeline.

`ForwardBatch` is plain Python data (ids and lengths), identical on every rank;
`AttentionMetadata` is the tensors a rank derives from it once per step, on its device.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    decode_rows: int  # requests 0..decode_rows-1 have q_len == 1 and are batched together
    decode_pages: torch.Tensor | None  # [B, P] page ids (padded with 0) of the batched requests
    decode_mask: torch.Tensor | None  # [B, 1, 1, P * page_size] True where the key is in context
    decode_ctx: torch.Tensor | None  # [B] keys in context of each batched request
    prefill: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (first row, q_len, page ids, [q_len, ctx] mask)
    sample_rows: torch.Tensor  # [S] rows whose hidden state is projected to logits (`logit_rows`)

    @staticmethod
    def build(batch: ForwardBatch, page_size: int, device: torch.device) -> AttentionMetadata:
        positions, pages, offsets = [], [], []
        for start, q_len, table in zip(batch.starts, batch.q_lens, batch.page_tables):
            for t in range(start, start + q_len):
                positions.append(t)
                pages.append(table[t // page_size])
                offsets.append(t % page_size)
        row = len(positions)

        def as_tensor(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        # Requests with one new token (decodes, or a prompt's last token) share one batched
        # attention call; they must come first in the batch so their rows are 0..B-1.
        num_decode = 0
        while num_decode < len(batch.q_lens) and batch.q_lens[num_decode] == 1:
            num_decode += 1
        decode_pages = decode_mask = decode_ctx = None
        if num_decode:
            ctx = [batch.starts[i] + 1 for i in range(num_decode)]
            max_pages = max(-(-c // page_size) for c in ctx)
            padded = [
                list(batch.page_tables[i][:max_pages]) + [0] * (max_pages - len(batch.page_tables[i][:max_pages]))
                for i in range(num_decode)
            ]
            decode_pages, decode_ctx = as_tensor(padded), as_tensor(ctx)
            key_pos = torch.arange(max_pages * page_size, device=device)
            decode_mask = (key_pos[None, :] < decode_ctx[:, None])[:, None, None, :]

        prefill = []
        row = num_decode
        for i in range(num_decode, len(batch.q_lens)):
            start, q_len = batch.starts[i], batch.q_lens[i]
            ctx = start + q_len
            page_ids = as_tensor(list(batch.page_tables[i][: -(-ctx // page_size)]))
            mask = None  # None: plain causal (the chunk starts at position 0)
            if start > 0:
                # key j is visible to the query at position t iff j <= t
                q_pos = torch.arange(start, ctx, device=device)
                mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
            prefill.append((row, q_len, page_ids, mask))
            row += q_len
        return AttentionMetadata(
            positions=as_tensor(positions),
            slot_pages=as_tensor(pages),
            slot_offsets=as_tensor(offsets),
            decode_rows=num_decode,
            decode_pages=decode_pages,
            decode_mask=decode_mask,
            decode_ctx=decode_ctx,
            prefill=prefill,
            sample_rows=torch.arange(row, device=device) if batch.all_logits else as_tensor(logit_rows(batch)[0]),
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
