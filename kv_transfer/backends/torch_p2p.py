"""torch: across hosts. torch.distributed point-to-point over a pair group per (prefill rank,
decode rank): the two live in different torch worlds, so no init_process_group. The decode
rank hosts a TCPStore whose keys all sit under a random prefix (the store itself takes any
writer, so only holders of the decode node's layout can pair); the rank's torch endpoint is
"host:port key" (TorchReceiving); each prefill rank that connects takes a pair number n from it and both build a
ProcessGroupGloo of size 2 (decode = 0, prefill = 1) on PrefixStore("kvpair/{n}/gloo/"). With
CUDA pools on both sides the page bytes go over a ProcessGroupNCCL on "kvpair/{n}/nccl/"
instead; headers always go over gloo.

Per message: a header int64[10] (below), then the destination page ids int64[n], then the page
bytes uint8[nbytes]. The decode rank checks the header's sizes before it receives anything
else, receives into a staging buffer, checks the ids against the room, and scatters into its
pool. A header whose sizes do not add up cannot be skipped safely: its room fails and the pair
closes (the prefill side reopens one for its next room).
"""

from __future__ import annotations

import logging
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvbridge.common.net import gloo_options, listening_store, local_address
from kvbridge.kv_transfer.backends.base import Backend, Receiving
from kvbridge.kv_transfer.blocks import gather, scatter
from kvbridge.kv_transfer.layers import LayerRange, plan_chunks
from kvbridge.kv_transfer.layout import NodeLayout, RankInfo
from kvbridge.kv_transfer.rooms import RoomTable, TransferError
from kvbridge.kv_transfer.sender import Sender, SenderRoom, Target

log = logging.getLogger(__name__)

MAGIC = 0x6B76_6272_6964_6765  # "kvbridge"
DATA, PING, CLOSE = 1, 2, 3
HEADER_LEN = 10
HELLO = struct.Struct("<II8s")  # version, prefill rank, proposed data backend ("gloo" | "nccl")
VERSION = 1
HELLO_WAIT_S = 10.0  # a pair number whose hello never came (its prefill died) is skipped after this


@dataclass(frozen=True)
class Header:
    """int64[10]: MAGIC, kind, room (as int64), prefill rank, layer_lo, layer_hi, num pages, num bytes,
    and the room's 16-byte write key as two int64."""

    kind: int  # DATA | PING | CLOSE
    room: int = 0  # uint64 pairing key
    src_rank: int = 0  # prefill rank
    lo: int = 0  # model layers [lo, hi)
    hi: int = 0
    num_pages: int = 0  # page ids that follow
    nbytes: int = 0  # page bytes that follow
    secret: bytes = bytes(16)  # DATA: the room's write key (RegisterRequest.secret)

    def tensor(self) -> torch.Tensor:
        room = self.room - (1 << 64) if self.room >= 1 << 63 else self.room
        key = [int.from_bytes(self.secret[i : i + 8], "little", signed=True) for i in (0, 8)]
        fields = [MAGIC, self.kind, room, self.src_rank, self.lo, self.hi, self.num_pages, self.nbytes, *key]
        return torch.tensor(fields, dtype=torch.int64)

    @classmethod
    def of(cls, t: torch.Tensor) -> Header:
        magic, kind, room, *rest, key0, key1 = t.tolist()
        if magic != MAGIC:
            raise ValueError(f"bad magic {magic:#x} in a torch pair header")
        secret = key0.to_bytes(8, "little", signed=True) + key1.to_bytes(8, "little", signed=True)
        return cls(kind, room & ((1 << 64) - 1), *rest, secret)


def _nccl_possible(device: torch.device) -> bool:
    return device.type == "cuda" and dist.is_nccl_available()


def _groups(store, n: int, rank: int, backend: str, timeout: timedelta, device: torch.device, host: str):
    """(control gloo group, data group) of pair n; this side's gloo transport listens on `host`."""
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore(f"kvpair/{n}/gloo/", store), rank, 2, gloo_options(host, timeout))
    if backend != "nccl":
        return ctrl, ctrl
    torch.cuda.set_device(device)  # this thread's current device: where NCCL puts the pair's communicator
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ctrl, dist.ProcessGroupNCCL(dist.PrefixStore(f"kvpair/{n}/nccl/", store), rank, 2, opts)


# ---- prefill side ----


class PairClient:
    """A prefill rank's pair with one decode rank."""

    def __init__(self, addr: str, key: str, src_rank: int, device: torch.device, timeout_s: float):
        host, port = addr.rsplit(":", 1)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        self._store = dist.PrefixStore(f"kvbridge/{key}/", store)
        self.n = self._store.add("kvpair/count", 1)
        proposed = "nccl" if _nccl_possible(device) else "gloo"
        self._store.set(f"kvpair/{self.n}/hello", HELLO.pack(VERSION, src_rank, proposed.encode()))
        answer = self._store.get(f"kvpair/{self.n}/accept").decode()
        if answer.startswith("error:"):
            raise ConnectionError(f"torch pair with {addr} refused: {answer[6:]}")
        self.backend = answer  # "gloo" | "nccl"
        self.device = device
        # this side listens where the decode rank reaches it: the local address that routes to it
        self._ctrl, self._data = _groups(self._store, self.n, 1, answer, timeout, device, local_address(host))
        self._in_flight: list[torch.Tensor] = []  # NCCL sources kept alive until sync()

    def send(
        self, room: int, secret: bytes, src_rank: int, lo: int, hi: int, dst: Sequence[int], block: torch.Tensor
    ) -> int:
        data = block.contiguous().view(-1).view(torch.uint8)
        data = data if self.backend == "nccl" else data.cpu()
        header = Header(DATA, room, src_rank, lo, hi, len(dst), data.numel(), secret)
        self._ctrl.send([header.tensor()], 0, 0).wait()
        self._ctrl.send([torch.tensor(list(dst), dtype=torch.int64)], 0, 0).wait()
        self._data.send([data], 0, 0).wait()
        if self.backend == "nccl":
            self._in_flight.append(data)
        return data.numel()

    def send_header(self, header: Header) -> None:
        self._ctrl.send([header.tensor()], 0, 0).wait()

    def sync(self) -> None:
        if self.backend == "nccl":
            torch.cuda.synchronize(self.device)
        self._in_flight.clear()

    def close(self) -> None:
        try:
            self.send_header(Header(CLOSE))
        finally:
            self._ctrl = self._data = self._store = None


class TorchSender(Sender):
    name = "torch"

    def _key(self, info: RankInfo) -> str:
        return info.endpoint("torch").decode()

    def _open(self, info: RankInfo, decode: NodeLayout) -> PairClient:
        if not info.endpoint("torch"):
            raise ValueError(f"decode rank {info.rank} hosts no torch store")
        addr, key = info.endpoint("torch").decode().split(" ")
        device, timeout_s = self.pool.buffer.device, self.config.torch_timeout_s
        return PairClient(addr, key, self.rank, device, timeout_s)

    def _write(self, pair: PairClient, r: SenderRoom, t: Target, src: Sequence[int], dst: Sequence[int]) -> int:
        total = 0
        for c in plan_chunks(len(src), t.lo, t.hi, self.geometry.layer_block_bytes, self.config.torch_chunk_bytes):
            pages = src[c.page_start : c.page_end]
            out = self._scratch(len(pages) * (c.layer_end - c.layer_start) * self.geometry.layer_block_bytes)
            block = gather(self.pool.buffer, self.layers, pages, c.layer_start, c.layer_end, out)
            total += pair.send(
                r.room, r.secret, self.rank, c.layer_start, c.layer_end, dst[c.page_start : c.page_end], block
            )
        return total

    def _sync(self, pair: PairClient) -> None:
        pair.sync()

    def _ping(self, pair: PairClient) -> None:
        pair.send_header(Header(PING))

    def _close(self, pair: PairClient) -> None:
        pair.close()


# ---- decode side ----


def check(data: bytes) -> str:
    """Why a peer's torch endpoint ("host:port key") is unusable ("" when fine)."""
    parts = data.decode("ascii", "replace").split(" ")
    host, _, port = parts[0].rpartition(":")
    if len(parts) != 2 or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"not 'host:port key': {data[:64]!r}"
    if len(parts[1]) != 32 or any(c not in "0123456789abcdef" for c in parts[1]):
        return "its store key is not 32 hex digits"
    return ""


class TorchReceiving(Receiving):
    """A TCPStore and a pair thread per prefill rank that connects (TorchReceiverPort)."""

    port: TorchReceiverPort | None = None

    def start(self, pool, rooms) -> bytes:
        c = self.config
        self.port = TorchReceiverPort(
            c.host, rooms, pool.buffer, c.layers, c.geometry.layer_block_bytes, c.max_chunk_bytes, c.torch_timeout_s
        )
        return f"{self.port.addr} {self.port.key}".encode()

    def close(self) -> None:
        if self.port is not None:
            self.port.close()
            self.port = None


class TorchReceiverPort:
    """A decode rank's TCPStore, and a thread per pair that lands pages in the pool."""

    def __init__(
        self,
        host: str,
        table: RoomTable,
        pool: torch.Tensor,
        layers: LayerRange,
        layer_block_bytes: int,
        max_chunk_bytes: int,
        timeout_s: float,
    ):
        self._table = table  # checks every write and counts it
        self._pool = pool  # [num_pages, layers_of_rank, 2, page_size, kv_heads, head_dim]
        self._layers = layers  # the rank's model layers [start, end)
        self._block = layer_block_bytes  # bytes of one layer of one page
        self._max_bytes = max_chunk_bytes  # largest message accepted (bounds the staging buffer)
        self._timeout = timedelta(seconds=timeout_s)
        self._host = host  # where the store and this side of every pair listen
        store = listening_store(host, 0, self._timeout)  # on `host` only, not every interface
        self.addr = f"{host}:{store.port}"
        self.key = secrets.token_hex(16)  # (published in the layout, which only registered peers get)
        self._store = dist.PrefixStore(f"kvbridge/{self.key}/", store)
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-torch-accept", daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        """Stop accepting. Pair threads end when their prefill side closes (or dies); a thread blocked
        in a receive cannot be interrupted, so they are daemons."""
        self._stop.set()
        self._acceptor.join()

    def _accept_loop(self) -> None:
        n, waiting_since = 1, None  # the next pair number; since when its hello is overdue
        try:
            while not self._stop.wait(0.02):
                count = self._store.add("kvpair/count", 0)
                while n <= count:
                    if self._store.check([f"kvpair/{n}/hello"]):
                        self._accept(n, self._store.get(f"kvpair/{n}/hello"))
                    else:
                        waiting_since = waiting_since or time.monotonic()
                        if time.monotonic() - waiting_since < HELLO_WAIT_S:
                            break
                        log.warning("torch pair %d never said hello; skipped", n)  # its prefill rank died
                    n, waiting_since = n + 1, None
        except Exception:
            log.exception("torch pair acceptor at %s stopped", self.addr)

    def _accept(self, n: int, hello: bytes) -> None:
        try:
            version, src_rank, proposed = HELLO.unpack(hello)
            if version != VERSION:
                raise ValueError(f"pair protocol version {version}, expected {VERSION}")
        except (struct.error, ValueError) as e:
            self._store.set(f"kvpair/{n}/accept", f"error:{e}".encode())
            return
        nccl = proposed.rstrip(b"\0") == b"nccl" and _nccl_possible(self._pool.device)
        backend = "nccl" if nccl else "gloo"
        self._store.set(f"kvpair/{n}/accept", backend.encode())
        args = (n, src_rank, backend)
        threading.Thread(target=self._serve_pair, args=args, name=f"kv-torch-pair-{n}", daemon=True).start()

    def _serve_pair(self, n: int, src_rank: int, backend: str) -> None:
        staging = torch.empty(0, dtype=torch.uint8, device=self._pool.device if backend == "nccl" else "cpu")
        try:
            ctrl, data = _groups(self._store, n, 0, backend, self._timeout, self._pool.device, self._host)
            while True:
                raw = torch.empty(HEADER_LEN, dtype=torch.int64)
                ctrl.recv([raw], 1, 0).wait()
                h = Header.of(raw)
                if h.kind == CLOSE:
                    return
                if h.kind == PING:
                    continue
                problem = self._frame_problem(h, src_rank)
                if problem:
                    if self._table.authentic(h.room, h.secret):  # (a stranger's bad frame fails no room)
                        self._table.fail(h.room, problem)
                    log.warning("torch pair %d from prefill rank %d closed: %s", n, src_rank, problem)
                    return
                ids = torch.empty(h.num_pages, dtype=torch.int64)
                ctrl.recv([ids], 1, 0).wait()
                if staging.numel() < h.nbytes:
                    staging = torch.empty(h.nbytes, dtype=torch.uint8, device=staging.device)
                data.recv([staging[: h.nbytes]], 1, 0).wait()
                self._land(h, ids.tolist(), staging[: h.nbytes])
        except Exception as e:
            log.info("torch pair %d from prefill rank %d ended: %s", n, src_rank, e)

    def _frame_problem(self, h: Header, src_rank: int) -> str:
        """Sizes that must add up before anything else is received."""
        if h.kind != DATA:
            return f"unknown message kind {h.kind}"
        if h.src_rank != src_rank:
            return f"header names prefill rank {h.src_rank} on the pair of prefill rank {src_rank}"
        if not 1 <= h.num_pages <= self._pool.shape[0] or h.hi <= h.lo:
            return f"header with {h.num_pages} pages, layers [{h.lo}, {h.hi})"
        expected = h.num_pages * (h.hi - h.lo) * self._block
        if h.nbytes != expected:
            return f"{h.nbytes} bytes for {h.num_pages} pages x {h.hi - h.lo} layers; expected {expected}"
        if h.nbytes > self._max_bytes:
            return f"message of {h.nbytes} bytes over this rank's limit {self._max_bytes}"
        return ""

    def _land(self, h: Header, ids: list[int], data: torch.Tensor) -> None:
        try:
            ticket = self._table.begin_write(h.room, h.secret, h.src_rank, h.lo, h.hi, ids, h.nbytes)
        except TransferError as e:
            log.warning("torch pages for room %d dropped: %s", h.room, e)
            return
        error = ""
        try:
            block = data.view(self._pool.dtype).view(len(ids), h.hi - h.lo, *self._pool.shape[2:])
            scatter(self._pool, self._layers, ids, h.lo, h.hi, block)
            if self._pool.device.type == "cuda":
                torch.cuda.current_stream(self._pool.device).synchronize()
        except Exception as e:
            error = f"landing torch pages: {type(e).__name__}: {e}"
        self._table.end_write(ticket, error)


BACKEND = Backend("torch", frozenset({"cpu", "cuda"}), TorchSender, TorchReceiving, check=check)
