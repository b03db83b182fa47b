"""The KV hand-off's records inside a node: frozen dataclasses, built and checked once where they
enter the node (its gRPC services), carried as they are through rank 0 and down the pipeline log
(pipeline/codec.py serializes them), read by each rank's KV agent.

    Registration   prefill node: a decode node's Bootstrap.Register of a room (where its KV goes);
                   Register message -> rank 0 -> the ROUTE entry every prefill rank pushes by
    Destination    decode node: where a request's KV lands (its pages, its sources, the room's
                   write key); the ADMIT entry every decode rank expects the pushes by
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.kv_transfer.layout import NodeLayout
from kvbridge.kv_transfer.rooms import Source


@dataclass(frozen=True)
class Registration:
    """A decode node's registration of a room, checked by the prefill node's Bootstrap service."""

    room: int
    secret: bytes  # the room's write key, minted by the decode node: every KV write carries it
    backend: str  # the transfer backend the pair uses
    page_ids: tuple[int, ...]  # the decode node's pages for the prompt, past those it holds
    held_pages: int  # prompt pages the decode node's prefix cache holds (not moved)
    decode: NodeLayout  # the decode node's layout (checked: kv_transfer/adapters.py layout_from_proto)
    decode_addr: str = ""  # its address, for operators (Admin shows the peer)


@dataclass(frozen=True)
class Destination:
    """Where a disaggregated request's KV lands on a decode node's ranks."""

    room: int
    page_ids: tuple[int, ...]  # this node's pages for the prompt, past those it holds
    held_pages: int  # prompt pages its prefix cache holds (not moved)
    sources: tuple[Source, ...]  # the prefill node's ranks (each writes the layers it overlaps)
    backend: str
    secret: bytes  # the room's write key
