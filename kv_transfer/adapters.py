"""Thin adapters between kv_transfer's dataclasses and kvbridge.v1 protobuf messages: the one
checked conversion of a peer's layout (`layout_from_proto`). (Inside a node, the dataclasses
travel as themselves: pipeline/codec.py.)

A rank's backend endpoints travel in RankEndpoint.endpoints, by backend name, as each backend's
own bytes; each registered backend checks its own (backends/base.py Backend.check), and one this
node does not know is dropped.
"""

from __future__ import annotations

from kvbridge.common.rpc import shown
from kvbridge.kv_transfer.factory import REGISTRY
from kvbridge.kv_transfer.layout import DTYPES, Endpoint, NodeLayout, PageGeometry, RankInfo
from kvbridge.kv_transfer.rooms import Source
from kvbridge.v1 import prefill_pb2


def rank_to_proto(info: RankInfo) -> prefill_pb2.RankEndpoint:
    return prefill_pb2.RankEndpoint(
        rank=info.rank,
        layer_start=info.layer_start,
        layer_end=info.layer_end,
        receiver_addr=info.receiver_addr,
        endpoints={e.backend: e.data for e in info.endpoints},
    )


def rank_from_proto(m: prefill_pb2.RankEndpoint) -> RankInfo:
    """A peer's rank, its endpoints checked by their backends (ValueError); unknown backends dropped."""
    endpoints = []
    for name in sorted(m.endpoints):
        if name in REGISTRY:
            problem = REGISTRY[name].check(m.endpoints[name])
            if problem:
                raise ValueError(f"layout rank {m.rank}: its {name} endpoint is unusable: {problem}")
            endpoints.append(Endpoint(name, m.endpoints[name]))
    return RankInfo(m.rank, m.layer_start, m.layer_end, m.receiver_addr, tuple(endpoints))


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
        kvbridge_version=layout.kvbridge_version,
        model_revision=layout.model_revision,
    )


def layout_from_proto(msg: prefill_pb2.KVLayout) -> NodeLayout:
    """A peer's layout, checked: its ranks must tile the model's layers. ValueError otherwise."""
    expected = 0
    for i, r in enumerate(msg.ranks):
        if r.rank != i:
            raise ValueError(f"layout rank {i} says it is rank {r.rank}: ranks must be listed in order from 0")
        if r.layer_start != expected or r.layer_end <= r.layer_start:
            raise ValueError(
                f"layout rank {i} has layers [{r.layer_start}, {r.layer_end}), expected to start at {expected}"
            )
        expected = r.layer_end
    if not msg.ranks or expected != msg.num_layers:
        raise ValueError(f"layout ranks cover {expected} layers of {msg.num_layers}")
    if not msg.page_size or not msg.num_pages:
        raise ValueError(f"layout page_size {msg.page_size} and num_pages {msg.num_pages} must be > 0")
    if not msg.num_kv_heads or not msg.head_dim:
        raise ValueError(f"layout num_kv_heads {msg.num_kv_heads} and head_dim {msg.head_dim} must be > 0")
    if msg.dtype not in DTYPES:
        raise ValueError(f"layout dtype must be one of {', '.join(DTYPES)}, got {shown(msg.dtype)}")
    return NodeLayout(
        geometry=PageGeometry(msg.page_size, msg.num_kv_heads, msg.head_dim, msg.dtype),
        num_layers=msg.num_layers,
        num_pages=msg.num_pages,
        ranks=tuple(rank_from_proto(r) for r in msg.ranks),
        model_fingerprint=msg.model_fingerprint,
        backends=tuple(msg.backends),
        host_id=msg.host_id,
        kvbridge_version=msg.kvbridge_version,
        model_revision=msg.model_revision,
    )


def sources_of(prefill: NodeLayout) -> list[Source]:
    """The prefill node's ranks as sources for KVReceiverEndpoint.expect (it keeps the overlapping ones)."""
    return [Source(r.rank, r.layer_start, r.layer_end) for r in prefill.ranks]
