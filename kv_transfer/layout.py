"""The records both sides exchange (as dataclasses; kv_transfer/adapters.py converts to protobuf):
a rank's endpoint, a node's KV layout, and the geometry of a page."""

from __future__ import annotations

import functools
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbridge import __version__
from kvbridge.common.shown import shown
from kvbridge.kv_transfer.layers import LayerRange

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"KV dtype must be one of {sorted(DTYPES)}, got {shown(name)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


@functools.cache
def local_host_id() -> str:
    """Equal on two processes of one host, which may share /dev/shm and CUDA IPC: the host name, the
    boot id (one kernel) and the network namespace (the inode of /proc/self/ns/net). A host is a
    network stack: pods on one Kubernetes node share a kernel (one boot id), but each has its own
    network namespace and its own /dev/shm, so between them `auto` must pick an engine that crosses
    hosts, never shm; two network namespaces of one machine are two hosts the same way."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # no procfs namespaces (not Linux): one stack per host name and boot
        net = 0
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}/{net}"


@dataclass(frozen=True)
class PageGeometry:
    """What a page holds; both sides of a transfer must agree on every field."""

    page_size: int  # tokens per page
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one layer of one page: K and V, [2, page_size, kv_heads, head_dim]."""
        itemsize = dtype_from_name(self.dtype).itemsize
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * itemsize

    def pool_shape(self, num_pages: int, layer_range: LayerRange) -> tuple[int, ...]:
        """[num_pages, layers_of_rank, 2, page_size, kv_heads, head_dim] (engine/kv_pool.py)."""
        layers = layer_range[1] - layer_range[0]
        return (num_pages, layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    def pool_bytes(self, num_pages: int, layer_range: LayerRange) -> int:
        return num_pages * (layer_range[1] - layer_range[0]) * self.layer_block_bytes

    @classmethod
    def of_pool(cls, pool) -> PageGeometry:
        """The geometry of an engine.kv_pool.KVPool."""
        _, _, _, page_size, heads, head_dim = pool.buffer.shape
        return cls(page_size, heads, head_dim, dtype_name(pool.buffer.dtype))


@dataclass(frozen=True)
class Endpoint:
    """What one backend's receiving half on a decode rank published: how a sender reaches it
    through that backend (backends/base.py). The data is the backend's own: a segment name, an
    address and key, an IPC handle; b"" where the rank's KVReceiver address is all it takes."""

    backend: str
    data: bytes = b""


@dataclass(frozen=True)
class RankInfo:
    """One rank's share of the layers and where to reach it (proto RankEndpoint)."""

    rank: int  # index of the rank in its node, 0 = the node's front
    layer_start: int  # the rank owns model layers [layer_start, layer_end)
    layer_end: int
    receiver_addr: str = ""  # host:port of the rank's KVReceiver gRPC service (decode ranks): every notice goes there
    endpoints: tuple[Endpoint, ...] = ()  # one per backend whose receiving half the rank opened, by name

    @property
    def layers(self) -> LayerRange:
        return (self.layer_start, self.layer_end)

    def endpoint(self, backend: str) -> bytes | None:
        """The data `backend` published on this rank; None when the rank did not open it."""
        return next((e.data for e in self.endpoints if e.backend == backend), None)


@dataclass(frozen=True)
class NodeLayout:
    """A node's KV layout (proto KVLayout): what the other side needs to pair with it."""

    geometry: PageGeometry  # page contents; must match between P and D
    num_layers: int  # layers of the model
    num_pages: int  # pool size of each rank: page ids are [0, num_pages)
    ranks: tuple[RankInfo, ...]  # in rank order; their layer ranges tile [0, num_layers)
    model_fingerprint: str = ""  # digest of the weights; must match between P and D
    backends: tuple[str, ...] = ()  # transfer backends the node can drive
    host_id: str = ""  # equal ids = same machine (shared memory and CUDA IPC possible)
    kvbridge_version: str = ""  # the node's kvbridge (kvbridge.__version__); must match between P and D
    model_revision: str = ""  # the checkpoint's revision where its source names one; must match

    @property
    def layer_ranges(self) -> list[LayerRange]:
        return [r.layers for r in self.ranks]


def incompatibility(prefill: NodeLayout, decode: NodeLayout) -> str:
    """Why a prefill node cannot feed a decode node ("" when it can), naming both values: the two
    must run the same kvbridge on the same weights (their digest, and the revision where the source
    names one) with the same page geometry."""
    checks = [
        ("kvbridge version", prefill.kvbridge_version, decode.kvbridge_version),
        ("model fingerprint", prefill.model_fingerprint, decode.model_fingerprint),
        ("model revision", prefill.model_revision, decode.model_revision),
        ("number of layers", prefill.num_layers, decode.num_layers),
        ("page size", prefill.geometry.page_size, decode.geometry.page_size),
        ("KV dtype", prefill.geometry.dtype, decode.geometry.dtype),
        ("KV heads", prefill.geometry.num_kv_heads, decode.geometry.num_kv_heads),
        ("head dim", prefill.geometry.head_dim, decode.geometry.head_dim),
    ]
    for what, p, d in checks:
        if p != d:
            return f"{what} differs: prefill {shown(p)}, decode {shown(d)}"
    return ""


def node_layout(config, model, ranks: tuple[RankInfo, ...], backends: tuple[str, ...]) -> NodeLayout:
    """A node's layout from its EngineConfig and LoadedModel (engine/), its ranks and the backends it drives."""
    from kvbridge.engine.llm import resolve_device, resolve_dtype

    mc = model.config
    dtype = dtype_name(resolve_dtype(config.dtype, resolve_device(config.device)))
    return NodeLayout(
        geometry=PageGeometry(config.page_size, mc.num_key_value_heads, mc.head_dim, dtype),
        num_layers=mc.num_hidden_layers,
        num_pages=config.total_pages,
        ranks=ranks,
        model_fingerprint=model.fingerprint,
        backends=backends,
        host_id=local_host_id(),
        kvbridge_version=__version__,
        model_revision=model_revision(model.source),
    )


def model_revision(source: str) -> str:
    """The revision a model's source names: the commit of a Hugging Face cache snapshot
    (.../snapshots/<40 hex>/...), else "" (a GGUF file or a plain directory: its fingerprint,
    the digest of its bytes, is what identifies it)."""
    parts = Path(source).parts
    for i, part in enumerate(parts[:-1]):
        if part == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", parts[i + 1]):
            return parts[i + 1]
    return ""
