"""The decode rank's side: its KV pool, the receiving half of each backend it opens
(backends/base.py Receiving: a shared segment for shm, an IPC handle for cuda_ipc, a TCPStore for
torch), and its KVReceiver gRPC service, where the grpc backend's pages and every TransferDone /
FirstToken notice arrive (grpc.aio, on an event loop thread of its own; kv_transfer/service.py
bounds its streams).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.common.rpc import KV_MESSAGE_BYTES, AioServer
from kvbridge.engine.kv_pool import KVPool
from kvbridge.kv_transfer.backends.base import Receiving
from kvbridge.kv_transfer.blocks import scatter
from kvbridge.kv_transfer.factory import FALLBACK, REGISTRY, backend, drivable
from kvbridge.kv_transfer.layers import local_slice, page_runs
from kvbridge.kv_transfer.layout import Endpoint, PageGeometry, RankInfo, dtype_from_name
from kvbridge.kv_transfer.poll import KVPoll, StatusBoard, StatusChange
from kvbridge.kv_transfer.rooms import RoomTable, Source
from kvbridge.kv_transfer.service import STREAM_IDLE_S, KVReceiverServicer
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
    device: str = "cpu"  # where the pool lives: "cpu" or "cuda[:i]"
    host: str = "127.0.0.1"  # where the gRPC service and the torch store listen (port 0: any free port)
    backends: tuple[str, ...] | None = None  # whose receiving halves to open (the fallback, grpc, always: its data
    #                                          path is the KVReceiver); None: every one that moves pools on `device`
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

    @property
    def opened(self) -> tuple[str, ...]:
        """The backends whose receiving halves this rank opens."""
        names = drivable(self.device) if self.backends is None else self.backends
        for name in names:
            if not backend(name).moves(self.device):
                raise ValueError(f"the {name} backend does not move pools on {self.device}")
        return tuple(dict.fromkeys((*names, FALLBACK)))


class KVReceiverEndpoint:
    """One decode rank's pool and KVReceiver service. Use as a context manager, or close()."""

    def __init__(self, config: ReceiverConfig, on_change: Callable[[StatusChange], None] | None = None):
        self.config = config
        self.board = StatusBoard(on_change)
        self._halves: dict[str, Receiving] = {}
        self._server: AioServer | None = None
        try:
            self._halves = {name: backend(name).receiving(config) for name in config.opened}
            self.pool = self._make_pool()
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
            endpoints = tuple(Endpoint(name, half.start(self.pool, self.rooms)) for name, half in self._halves.items())
        except BaseException:
            self.close()
            raise
        self.endpoint = RankInfo(
            rank=config.rank,
            layer_start=config.layer_start,
            layer_end=config.layer_end,
            receiver_addr=f"{config.host}:{self._server.port}",
            endpoints=endpoints,
        )  # what the daemon publishes in its KVLayout (kv_transfer.adapters.rank_to_proto)

    def _make_pool(self) -> KVPool:
        """The pool, in the memory a backend asks for (shm: a shared segment), else where the engine puts it."""
        c = self.config
        shape, dtype = c.geometry.pool_shape(c.num_pages, c.layers), dtype_from_name(c.dtype)
        buffer = None
        for half in self._halves.values():
            if buffer is None:
                buffer = half.buffer(shape, dtype)
        return KVPool(c.num_pages, c.layers, c.page_size, c.num_kv_heads, c.head_dim, dtype, c.device, buffer=buffer)

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
        if backend not in self._halves:
            raise ValueError(
                f"room {room}: backend {backend!r} is not open on this rank (open: {', '.join(self._halves)})"
            )
        self.rooms.expect(room, rid, page_ids, sources, REGISTRY[backend].direct, secret, held_pages)

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
        """Stop serving, close every backend's half and unlink the pool's segment (idempotent). Drop
        your own views of `pool` first: the memory goes with its last view, the segment's name goes now."""
        if self._server is not None:
            self._server.stop(grace_s=1.0)
            self._server = None
        self.pool = None
        halves, self._halves = self._halves, {}
        for half in halves.values():
            half.close()

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
