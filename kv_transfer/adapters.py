"""Thin adapters between kv_transfer's dataclasses and kvbridge.v1 protobuf messages.

RankEndpoint has no field for a CUDA IPC handle: a rank whose pool is on a GPU puts
"cuda-ipc:" + the handle in hex in shm_name (the field for "the rank's shared pool").
"""

from __future__ import annotations

from kv_transfer.layout import NodeLayout, PageGeometry, RankInfo
from kv_transfer.rooms import Source
from kvbridge.v1 import prefill_pb2

CUDA_IPC_PREFIX = "cuda-ipc:"


def rank_to_proto(info: RankInfo) -> prefill_pb2.RankEndpoint:
    shm = CUDA_IPC_PREFIX + info.cuda_ipc_handle.hex() if info.cuda_ipc_handle else info.shm_name
    return prefill_pb2.RankEndpoint(
        rank=info.rank,
        layer_start=info.layer_start,
        layer_end=info.layer_end,
        receiver_addr=info.receiver_addr,
        shm_name=shm,
        torch_addr=info.torch_addr,
        torch_key=info.torch_key,
    )


def rank_from_proto(m: prefill_pb2.RankEndpoint) -> RankInfo:
    shm, handle = m.shm_name, b""
    if shm.startswith(CUDA_IPC_PREFIX):
        shm, handle = "", bytes.fromhex(shm[len(CUDA_IPC_PREFIX) :])
    return RankInfo(m.rank, m.layer_start, m.layer_end, m.receiver_addr, shm, m.torch_addr, handle, m.torch_key)


def layout_to_proto(layout: NodeLayout) -> prefill_pb2.KVLayout:
    g = layout.geometry
    return prefill_pb2.KVLayout(
        model_fingerprint=layout.model_fingerprint,
        num_layers=layout.num_layers,
        page_size=g.page_size,
        dtype=g.dtype,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        num_pages=layout.num_pages,
        ranks=[rank_to_proto(r) for r in layout.ranks],
        backends=list(layout.backends),
        host_id=layout.host_id,
    )


def layout_from_proto(m: prefill_pb2.KVLayout) -> NodeLayout:
    return NodeLayout(
        geometry=PageGeometry(m.page_size, m.num_kv_heads, m.head_dim, m.dtype),
        num_layers=m.num_layers,
        num_pages=m.num_pages,
        ranks=tuple(rank_from_proto(r) for r in m.ranks),
        model_fingerprint=m.model_fingerprint,
        backends=tuple(m.backends),
        host_id=m.host_id,
    )


def sources_of(prefill: NodeLayout) -> list[Source]:
    """The prefill node's ranks as sources for KVReceiverEndpoint.expect (it keeps the overlapping ones)."""
    return [Source(r.rank, r.layer_start, r.layer_end) for r in prefill.ranks]
