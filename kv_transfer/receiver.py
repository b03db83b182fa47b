"""The decode rank's side: its KV pool, laid out so every backend can reach it, and its KVReceiver.

CPU pools live in a shared-memory segment (shm backend); CUDA pools export an IPC handle
(cuda_ipc backend); the torch backend dials the rank's TCPStore; the grpc backend and every
TransferDone / FirstToken notice go to its KVReceiver gRPC service (grpc.aio, on an event loop
thread of its own; kv_transfer/service.py bounds its streams).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.rpc import KV_MESSAGE_BYTES, AioServer
from engine.kv_pool import KVPool
from kv_transfer.backends import cuda_ipc
from kv_transfer.backends.shm import Segment
from kv_transfer.backends.torch_p2p import TorchReceiverPort
from kv_transfer.blocks import scatter
from kv_transfer.layers import local_slice, page_runs
from kv_transfer.layout import PageGeometry, RankInfo, dtype_from_name
from kv_transfer.poll import KVPoll, StatusBoard, StatusChange
from kv_transfer.rooms import RoomTable, Source
from kv_transfer.service import STREAM_IDLE_S, KVReceiverServicer
from kvbridge.v1 import kv_transfer_pb2_grpc

SERVICE_NAME = "kvbridge.v1.KVReceiver"


@dataclass(frozen=True)
class ReceiverConfig:
    rank: int  # this decode rank's index in its node
    layer_start: int  # the rank owns model layers [layer_start, layer_end)
    layer_end: int
    num_pages: int  # pool size: page ids are [0, num_pages), node-wide
    page_size: int  # tokens per page
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"  # "float32" | "float16" | "bfloat16"
    device: str = "cpu"  # "cpu": the pool lives in /dev/shm; "cuda[:i]": on the GPU, exported by IPC handle
    host: str = "127.0.0.1"  # where the gRPC service and the torch store listen (port 0: any free port)
    shared_memory: bool = True  # CPU only: put the pool in a /dev/shm segment (the shm backend needs it)
    torch_store: bool = True  # host a TCPStore so prefill ranks can open torch pairs
    awaits_first_token: bool = False  # rank 0: SUCCESS also needs the FirstToken notice
    max_chunk_bytes: int = 64 << 20  # largest torch message accepted (bounds the staging buffer)
    torch_timeout_s: float = 120.0  # torch pair receive timeout (senders ping well within it)
    stream_idle_s: float = STREAM_IDLE_S  # a WritePages stream whose next chunk is this late ends (DEADLINE_EXCEEDED)

    @property
    def layers(self) -> tuple[int, int]:
        return (self.layer_start, self.layer_end)

    @property
    def geometry(self) -> PageGeometry:
        return PageGeometry(self.page_size, self.num_kv_heads, self.head_dim, self.dtype)


class KVReceiverEndpoint:
    """One decode rank's pool and KVReceiver service. Use as a context manager, or close()."""

    def __init__(self, config: ReceiverConfig, on_change: Callable[[StatusChange], None] | None = None):
        self.config = config
        self.board = StatusBoard(on_change)
        self._segment: Segment | None = None
        self._server: AioServer | None = None
        self._torch: TorchReceiverPort | None = None
        try:
            self.pool, ipc_handle = self._make_pool()
            g = config.geometry
            self.rooms = RoomTable(
                config.rank, config.layers, config.num_pages, config.page_size,
                g.layer_block_bytes, config.awaits_first_token, self.board,
            )  # fmt: skip
            self.servicer = KVReceiverServicer(self, config.stream_idle_s)
            self._server = AioServer(
                config.host,
                0,
                [(kv_transfer_pb2_grpc.add_KVReceiverServicer_to_server, self.servicer)],
                [SERVICE_NAME],
                name=f"kv-receiver-{config.rank}",
                max_message_bytes=KV_MESSAGE_BYTES,
            )
            if config.torch_store:
                self._torch = TorchReceiverPort(
                    config.host, self.rooms, self.pool.buffer, config.layers, g.layer_block_bytes,
                    config.max_chunk_bytes, config.torch_timeout_s,
                )  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.endpoint = RankInfo(
            rank=config.rank,
            layer_start=config.layer_start,
            layer_end=config.layer_end,
            receiver_addr=f"{config.host}:{self._server.port}",
            shm_name=self._segment.name if self._segment else "",
            torch_addr=self._torch.addr if self._torch else "",
            torch_key=self._torch.key if self._torch else "",
            cuda_ipc_handle=ipc_handle,
        )  # what the daemon publishes in its KVLayout (kv_transfer.adapters.rank_to_proto)

    def _make_pool(self) -> tuple[KVPool, bytes]:
        c = self.config
        shape, dtype = c.geometry.pool_shape(c.num_pages, c.layers), dtype_from_name(c.dtype)
        buffer, handle = None, b""
        if torch.device(c.device).type == "cuda":
            buffer = torch.zeros(shape, dtype=dtype, device=c.device)
            handle = cuda_ipc.export_pool(buffer)
        elif c.shared_memory:
            self._segment = Segment(c.geometry.pool_bytes(c.num_pages, c.layers), tag=f"r{c.rank}")
            buffer = self._segment.tensor(shape, dtype)
        pool = KVPool(c.num_pages, c.layers, c.page_size, c.num_kv_heads, c.head_dim, dtype, c.device, buffer=buffer)
        return pool, handle

    # ---- the daemon ----

    def expect(
        self,
        room: int,
        rid: str,
        page_ids: Sequence[int],
        sources: Sequence[Source],
        backend: str,
        secret: bytes,
        held_pages: int = 0,
    ) -> None:
        """Before registering `room` with the prefill node: its destination pages here, the prefill
        ranks (with their layer ranges; non-overlapping ones are ignored), the chosen backend and the
        room's write key (what the prefill node gets in the registration)."""
        self.rooms.expect(room, rid, page_ids, sources, backend, secret, held_pages)

    def forget(self, room: int) -> None:
        """Done with the room (terminal, or aborted): waits for copies into its pages in flight."""
        self.rooms.forget(room)

    def fail(self, room: int, reason: str) -> bool:
        """Fail a room from outside (timeout, abort); False when unknown or already terminal."""
        return self.rooms.fail(room, reason)

    def poll(self, room: int) -> KVPoll:
        return self.board.poll(room)

    def reason(self, room: int) -> str:
        return self.board.reason(room)

    def first_token(self, room: int) -> tuple[int, int] | None:
        """(token, prompt_tokens) from the prefill node's last rank; rank 0 only."""
        return self.rooms.first_token(room)

    def first_logprob(self, room: int):
        """The first token's kvbridge.v1.TokenLogprob (None when the request asked for none); rank 0 only."""
        return self.rooms.first_logprob(room)

    def pop_changes(self) -> list[StatusChange]:
        return self.board.pop_changes()

    def close(self) -> None:
        """Stop serving and unlink the pool's segment (idempotent). Drop your own views of
        `pool` first: the memory goes with its last view, the segment's name goes now."""
        if self._torch is not None:
            self._torch.close()
            self._torch = None
        if self._server is not None:
            self._server.stop(grace_s=1.0)
            self._server = None
        self.pool = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the grpc backend's data path ----

    def write_bytes(
        self, room: int, secret: bytes, src: int, lo: int, hi: int, page_ids: list[int], data: bytes
    ) -> int:
        """Check, then copy a PageChunk's bytes into layers [lo, hi) of pages page_ids; returns len(data).
        Blocking (a worker thread of the service calls it)."""
        ticket = self.rooms.begin_write(room, secret, src, lo, hi, page_ids, len(data))
        error = ""
        try:
            _copy_bytes(self.pool.buffer, self.config.layers, page_ids, lo, hi, data)
        except Exception as e:
            error = f"landing page bytes: {type(e).__name__}: {e}"
        self.rooms.end_write(ticket, error)
        return len(data)


def _copy_bytes(buffer: torch.Tensor, layers, page_ids: list[int], lo: int, hi: int, data: bytes) -> None:
    """One copy from the message into a CPU pool (through numpy, which reads immutable bytes as is)."""
    src = np.frombuffer(data, dtype=np.uint8).reshape(len(page_ids), hi - lo, -1)
    if buffer.device.type != "cpu":
        block = torch.tensor(src).to(buffer.device).view(buffer.dtype).view(len(page_ids), hi - lo, *buffer.shape[2:])
        scatter(buffer, layers, page_ids, lo, hi, block)
        return
    rows = buffer.view(buffer.shape[0], buffer.shape[1], -1).view(torch.uint8).numpy()  # [pages, layers, bytes]
    sl = local_slice(layers, lo, hi)
    for i, q0, n in page_runs(range(len(page_ids)), page_ids):
        rows[q0 : q0 + n, sl] = src[i : i + n]
