"""The cuda_ipc handle's explicit byte format (no pickle), checked without a GPU; the engine
itself runs in tests/kv_transfer/test_kv_transfer_engines.py where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from kvbridge.kv_transfer.backends.cuda_ipc import _FIXED, _pack_bytes, _unpack_bytes, import_pool


def make_blob(storage_bytes: int, tensor_offset: int = 0) -> bytes:
    fixed = _FIXED.pack(0, storage_bytes, 512, 3, tensor_offset, True)
    return _pack_bytes(fixed, b"h" * 64, b"/torch_1_2", b"e" * 64)


def test_handle_parts_round_trip():
    parts = [b"", b"\0\1\2", b"x" * 300]
    assert _unpack_bytes(_pack_bytes(*parts), 3) == parts


def test_trailing_bytes_are_rejected():
    with pytest.raises(ValueError, match="2 trailing bytes"):
        _unpack_bytes(_pack_bytes(b"ab") + b"zz", 1)


def test_a_storage_smaller_than_the_layout_is_refused_before_touching_cuda():
    shape = (4, 2, 2, 4, 2, 16)  # 2048 float32 = 8192 bytes
    with pytest.raises(ValueError, match="holds 8188 bytes; the decode layout needs 8192"):
        import_pool(make_blob(8188), shape, torch.float32)
    with pytest.raises(ValueError, match="holds 8192 bytes; the decode layout needs 8196"):
        import_pool(make_blob(8192, tensor_offset=1), shape, torch.float32)
