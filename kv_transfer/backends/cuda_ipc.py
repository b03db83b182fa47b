"""cuda_ipc: same host, GPU. The decode rank exports its pool's CUDA allocation as an IPC handle
(UntypedStorage._share_cuda_, what torch.multiprocessing's reductions use); the handle travels
as explicit bytes (no pickle) as the rank's cuda_ipc endpoint; the prefill rank opens it
(UntypedStorage._new_shared_cuda) and copies its pages device to device straight into the pool.

A process cannot open its own IPC handle, so the two sides must be different processes. Every
importer of one export shares one torch IPC ref-counter slot; the pool outlives them all (it is
freed when the decode rank exits), so the count only matters at shutdown.

Written for GPU machines; tests skip where CUDA is absent.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from kvbridge.kv_transfer.backends.base import Backend, Receiving
from kvbridge.kv_transfer.blocks import copy_pages
from kvbridge.kv_transfer.layout import NodeLayout, RankInfo, dtype_from_name
from kvbridge.kv_transfer.sender import Sender, SenderRoom, Target

_FIXED = struct.Struct("<iQQQq?")  # device, storage bytes, offset bytes, ref-counter offset, tensor offset, event sync


def _pack_bytes(*parts: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def _unpack_bytes(blob: bytes, count: int) -> list[bytes]:
    parts, at = [], 0
    for _ in range(count):
        (n,) = struct.unpack_from("<I", blob, at)
        parts.append(blob[at + 4 : at + 4 + n])
        at += 4 + n
    if at != len(blob):
        raise ValueError(f"CUDA IPC handle has {len(blob) - at} trailing bytes")
    return parts


def export_pool(buffer: torch.Tensor) -> bytes:
    """The IPC handle of a CUDA pool buffer, as bytes. The buffer must outlive every importer's use."""
    storage = buffer.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
    fixed = _FIXED.pack(device, size, offset, ref_offset, buffer.storage_offset(), bool(event_sync))
    return _pack_bytes(fixed, handle, ref_handle, event_handle)


def import_pool(blob: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Open a pool exported by export_pool, as a tensor of the given shape and dtype."""
    fixed, handle, ref_handle, event_handle = _unpack_bytes(blob, 4)
    device, size, offset, ref_offset, tensor_offset, event_sync = _FIXED.unpack(fixed)
    need = (tensor_offset + torch.Size(shape).numel()) * dtype.itemsize
    if need > size:
        raise ValueError(f"CUDA IPC storage holds {size} bytes; the decode layout needs {need}")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync
    )
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    return torch._utils._rebuild_tensor(typed, tensor_offset, shape, torch.empty(shape, device="meta").stride())


def check(data: bytes) -> str:
    """Why a peer's cuda_ipc endpoint (an export_pool handle) is unusable ("" when fine)."""
    try:
        fixed, *_ = _unpack_bytes(data, 4)
        _FIXED.unpack(fixed)
    except (ValueError, struct.error) as e:
        return f"not a CUDA IPC handle: {e}"
    return ""


class CudaIpcReceiving(Receiving):
    """The pool stays where the engine allocates it, on the GPU; the endpoint is its IPC handle."""

    def start(self, pool, rooms) -> bytes:
        return export_pool(pool.buffer)


class _IpcConn:
    def __init__(self, info: RankInfo, decode: NodeLayout):
        g = decode.geometry
        self.pool = import_pool(
            info.endpoint("cuda_ipc"), g.pool_shape(decode.num_pages, info.layers), dtype_from_name(g.dtype)
        )
        self.layers = info.layers  # the decode rank's [start, end)


class CudaIpcSender(Sender):
    name = "cuda_ipc"

    def _key(self, info: RankInfo) -> str:
        return info.endpoint("cuda_ipc").hex()

    def _open(self, info: RankInfo, decode: NodeLayout) -> _IpcConn:
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc backend needs CUDA")
        if not info.endpoint("cuda_ipc"):
            raise ValueError(f"decode rank {info.rank} exports no CUDA IPC handle")
        if self.pool.buffer.device.type != "cuda":
            raise ValueError("the cuda_ipc backend moves CUDA pools; use shm for CPU pools")
        return _IpcConn(info, decode)

    def _write(self, conn: _IpcConn, r: SenderRoom, target: Target, src: Sequence[int], dst: Sequence[int]) -> int:
        args = (self.pool.buffer, self.layers, src, conn.pool, conn.layers, dst, target.lo, target.hi)
        return copy_pages(*args, scratch=self._scratch)

    def _sync(self, conn: _IpcConn) -> None:
        torch.cuda.synchronize(self.pool.buffer.device)
        torch.cuda.synchronize(conn.pool.device)

    def _settle(self) -> None:
        for device in range(torch.cuda.device_count()):  # (a copy between two GPUs may run on either)
            torch.cuda.synchronize(device)

    def _close(self, conn: _IpcConn) -> None:
        conn.pool = None


BACKEND = Backend(
    "cuda_ipc", frozenset({"cuda"}), CudaIpcSender, CudaIpcReceiving, same_host=True, direct=True, check=check
)
