"""shm: same host, CPU. The decode rank's pool lives in a POSIX shared-memory segment
(/dev/shm, mode 0600: only its owner's processes can map it); the prefill rank maps it by name
and copies its pages straight into it: one copy, whole blocks where page ids run consecutively.

Decode side: ShmReceiving puts the pool in a Segment (created, owned, unlinked at close) and
publishes its name. Prefill side: ShmSender maps it by that name.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from collections.abc import Sequence
from multiprocessing import shared_memory
from pathlib import Path

import torch

from kvbridge.common.pids import alive, parse_pid
from kvbridge.kv_transfer.backends.base import Backend, Receiving
from kvbridge.kv_transfer.blocks import copy_pages
from kvbridge.kv_transfer.layout import NodeLayout, RankInfo, dtype_from_name
from kvbridge.kv_transfer.sender import Sender, SenderRoom, Target

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "kvbridge-"
_NAME = re.compile(r"^kvbridge-[A-Za-z0-9_.-]{1,200}$")  # segment names we create and agree to map


def map_segment(name: str, nbytes: int) -> torch.Tensor:
    """Map a segment by name as a uint8 tensor of nbytes. The tensor holds the only reference to
    the mapping, so the memory stays mapped exactly as long as some view of it is alive."""
    if not _NAME.match(name):
        raise ValueError(f"not a kvbridge shared-memory segment name: {name!r}")
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"segment {name} holds {size} bytes; {nbytes} expected")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # map every page in now, not on first copy
        return torch.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=torch.uint8)
    finally:
        os.close(fd)


class Segment:
    """A decode rank's pool segment, created here with mode 0600. close() unlinks it: the name is
    gone at once; the memory goes when the last view of it does."""

    def __init__(self, nbytes: int, tag: str):
        # 128 random bits: a name no one guesses, given only to the prefill nodes the rank registers with
        name = f"{NAME_PREFIX}{os.getpid()}-{tag}-{secrets.token_hex(16)}"
        # SharedMemory creates it exclusively and registers it with the resource tracker, which
        # unlinks it should this process die without close().
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        self.name = self._shm.name  # without the leading "/"
        try:
            self._shm.close()  # its own mapping; ours (map_segment) is owned by the tensors
            os.chmod(SHM_DIR / self.name, 0o600)  # shared_memory's default, made explicit
            self.bytes = map_segment(self.name, nbytes)  # uint8 [nbytes]
        except BaseException:
            self.close()
            raise

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.bytes.view(dtype).view(shape).zero_()  # zero_ maps every page in now

    def close(self) -> None:
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        self.bytes = None
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


def remove_segments_of(pid: int) -> list[str]:
    """Unlink the segments a dead process created (its name prefix carries its pid); for a daemon
    whose rank process died without close(). Returns the names removed."""
    removed = []
    for path in SHM_DIR.glob(f"{NAME_PREFIX}{pid}-*"):
        with contextlib.suppress(OSError):  # gone already, or another user's (/dev/shm is sticky)
            path.unlink()
            removed.append(path.name)
    return removed


def remove_stale_segments() -> list[str]:
    """Unlink every kvbridge segment whose creating process is gone (killed before it could clean
    up); run by a starting decode node. Returns the names removed. Any local user can create
    /dev/shm/kvbridge-*: a name without a pid in the kernel's range is left alone."""
    removed = []
    for path in SHM_DIR.glob(f"{NAME_PREFIX}*"):
        pid = parse_pid(path.name.removeprefix(NAME_PREFIX).split("-", 1)[0])
        if pid is not None and not alive(pid):
            removed += remove_segments_of(pid)
    return removed


def check(data: bytes) -> str:
    """Why a peer's shm endpoint (a segment name) is unusable ("" when fine)."""
    return "" if _NAME.match(data.decode("ascii", "replace")) else f"not a kvbridge segment name: {data[:64]!r}"


class ShmReceiving(Receiving):
    """The decode rank's pool in a segment of its own; the endpoint is the segment's name."""

    segment: Segment | None = None

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.segment = Segment(torch.Size(shape).numel() * dtype.itemsize, tag=f"r{self.config.rank}")
        return self.segment.tensor(shape, dtype)

    def start(self, pool, rooms) -> bytes:
        return self.segment.name.encode()

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class _ShmConn:
    def __init__(self, info: RankInfo, decode: NodeLayout):
        g = decode.geometry
        raw = map_segment(info.endpoint("shm").decode(), g.pool_bytes(decode.num_pages, info.layers))
        self.pool = raw.view(dtype_from_name(g.dtype)).view(g.pool_shape(decode.num_pages, info.layers))
        self.layers = info.layers  # the decode rank's [start, end)


class ShmSender(Sender):
    name = "shm"

    def _key(self, info: RankInfo) -> str:
        return info.endpoint("shm").decode()

    def _open(self, info: RankInfo, decode: NodeLayout) -> _ShmConn:
        if not info.endpoint("shm"):
            raise ValueError(f"decode rank {info.rank} shares no pool segment")
        if self.pool.buffer.device.type != "cpu":
            raise ValueError("the shm backend moves CPU pools; use cuda_ipc for GPU pools")
        return _ShmConn(info, decode)

    def _write(self, conn: _ShmConn, r: SenderRoom, target: Target, src: Sequence[int], dst: Sequence[int]) -> int:
        args = (self.pool.buffer, self.layers, src, conn.pool, conn.layers, dst, target.lo, target.hi)
        return copy_pages(*args, scratch=self._scratch)

    def _close(self, conn: _ShmConn) -> None:
        conn.pool = None  # unmapped with its last view


BACKEND = Backend("shm", frozenset({"cpu"}), ShmSender, ShmReceiving, same_host=True, direct=True, check=check)
