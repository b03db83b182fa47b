"""grpc: anywhere. Pages travel as bytes on a WritePages client stream to the decode rank's
KVReceiver, in PageChunks of at most SenderConfig.grpc_chunk_bytes; the receiver checks each
chunk and copies it into its pool (kv_transfer/service.py). The chunks are gathered as they go,
each well within the receiver's idle limit of the last (--kv-stream-idle-s). The slow,
universal fallback. Its receiving half is the KVReceiver service every decode rank runs for the
notices anyway, so it opens nothing and publishes no data."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvbridge.kv_transfer.backends.base import Backend, Receiving
from kvbridge.kv_transfer.blocks import gather
from kvbridge.kv_transfer.layers import plan_chunks
from kvbridge.kv_transfer.layout import NodeLayout, RankInfo
from kvbridge.kv_transfer.sender import Sender, SenderRoom, Target
from kvbridge.v1 import kv_transfer_pb2


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class GrpcSender(Sender):
    name = "grpc"

    def _open(self, info: RankInfo, decode: NodeLayout) -> str:
        return info.receiver_addr

    def _write(self, addr: str, r: SenderRoom, target: Target, src: Sequence[int], dst: Sequence[int]) -> int:
        ack = self._stub(addr).WritePages(self._chunks(r, target, src, dst), timeout=self.config.deadline_s)
        return ack.bytes

    def _chunks(self, r: SenderRoom, t: Target, src: Sequence[int], dst: Sequence[int]) -> Iterator:
        """PageChunks, gathered one at a time so that at most one chunk of copies is alive."""
        plan = plan_chunks(len(src), t.lo, t.hi, self.geometry.layer_block_bytes, self.config.grpc_chunk_bytes)
        for c in plan:
            block = gather(self.pool.buffer, self.layers, src[c.page_start : c.page_end], c.layer_start, c.layer_end)
            yield kv_transfer_pb2.PageChunk(
                room=r.room,
                secret=r.secret,
                src_rank=self.rank,
                layer_start=c.layer_start,
                layer_end=c.layer_end,
                page_ids=dst[c.page_start : c.page_end],
                data=tensor_bytes(block),
            )


BACKEND = Backend("grpc", frozenset({"cpu", "cuda"}), GrpcSender, Receiving)
