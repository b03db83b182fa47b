"""Engine choice, the one factory, layout compatibility, and the protobuf adapters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbridge.engine.kv_pool import KVPool
from kvbridge.kv_transfer import (
    BACKENDS,
    NodeLayout,
    PageGeometry,
    RankInfo,
    choose_backend,
    incompatibility,
    make_sender,
)
from kvbridge.kv_transfer.adapters import layout_from_proto, layout_to_proto, sources_of
from kvbridge.kv_transfer.backends import cuda_ipc
from kvbridge.kv_transfer.backends.cuda_ipc import CudaIpcSender
from kvbridge.kv_transfer.backends.grpc_stream import GrpcSender
from kvbridge.kv_transfer.backends.shm import ShmSender
from kvbridge.kv_transfer.backends.torch_p2p import TorchSender
from kvbridge.kv_transfer.factory import REGISTRY, drivable
from kvbridge.kv_transfer.layout import Endpoint, model_revision
from kvbridge.v1 import prefill_pb2

GEOMETRY = PageGeometry(page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def ipc_handle(rank: int) -> bytes:
    """Bytes in export_pool's form (a handle no process could open)."""
    fixed = cuda_ipc._FIXED.pack(rank, 1 << 20, 0, 0, 0, False)
    return cuda_ipc._pack_bytes(fixed, bytes([rank, 0, 255]), b"ref", b"event")


def make_rank(rank, lo, hi, shm=True, torch_addr=True, ipc=False) -> RankInfo:
    endpoints = [Endpoint("shm", f"kvbridge-1-r{rank}-ab".encode())] if shm else []
    endpoints += [Endpoint("cuda_ipc", ipc_handle(rank))] if ipc else []
    endpoints += [Endpoint("torch", f"127.0.0.1:{6000 + rank} {'ab' * 16}".encode())] if torch_addr else []
    endpoints += [Endpoint("grpc")]
    return RankInfo(rank, lo, hi, receiver_addr=f"127.0.0.1:{5000 + rank}", endpoints=tuple(endpoints))


def make_layout(host="h1", backends=BACKENDS, **rank_kw) -> NodeLayout:
    ranks = (make_rank(0, 0, 3, **rank_kw), make_rank(1, 3, 6, **rank_kw))
    return NodeLayout(GEOMETRY, 6, 32, ranks, "fp", tuple(backends), host)


def test_same_host_cpu_picks_shm():
    assert choose_backend(make_layout(), make_layout(), "cpu") == "shm"


def test_same_host_cuda_picks_cuda_ipc_when_every_rank_exports_a_handle():
    assert choose_backend(make_layout(), make_layout(ipc=True), "cuda:0") == "cuda_ipc"
    assert choose_backend(make_layout(), make_layout(ipc=False), "cuda") == "torch"


def test_other_host_picks_torch_then_grpc():
    assert choose_backend(make_layout("h1"), make_layout("h2"), "cpu") == "torch"
    assert choose_backend(make_layout("h1"), make_layout("h2", torch_addr=False), "cpu") == "grpc"
    assert choose_backend(make_layout("h1", backends=("grpc",)), make_layout("h2"), "cpu") == "grpc"


def test_shm_needs_both_nodes_to_drive_it_and_a_known_host():
    assert choose_backend(make_layout(backends=("torch", "grpc")), make_layout(), "cpu") == "torch"
    assert choose_backend(make_layout(host=""), make_layout(host=""), "cpu") == "torch"


def test_a_rank_without_receiver_cannot_be_fed():
    bad = make_layout(torch_addr=False)
    bad = dataclasses.replace(bad, ranks=(dataclasses.replace(bad.ranks[0], receiver_addr=""), bad.ranks[1]))
    with pytest.raises(ValueError, match="without a receiver address"):
        choose_backend(make_layout("h1"), bad, "cpu")


@pytest.mark.parametrize(
    "name,cls", [("shm", ShmSender), ("torch", TorchSender), ("grpc", GrpcSender), ("cuda_ipc", CudaIpcSender)]
)
def test_make_sender_builds_the_named_engine(name, cls):
    pool = KVPool(4, (0, 3), 4, 2, 8, torch.float32)
    with make_sender(name, pool, rank=0) as sender:
        assert type(sender) is cls and sender.name == name and sender.layers == (0, 3)


def test_make_sender_rejects_unknown_names():
    with pytest.raises(ValueError, match="got 'auto'"):
        make_sender("auto", KVPool(4, (0, 3), 4, 2, 8, torch.float32), rank=0)


def test_incompatibility_names_both_values():
    p = make_layout()
    assert incompatibility(p, make_layout()) == ""
    d = dataclasses.replace(p, geometry=dataclasses.replace(GEOMETRY, page_size=16))
    assert incompatibility(p, d) == "page size differs: prefill 4, decode 16"
    d = dataclasses.replace(p, model_fingerprint="other")
    assert incompatibility(p, d) == "model fingerprint differs: prefill 'fp', decode 'other'"
    d = dataclasses.replace(p, kvbridge_version="0.0.9", model_fingerprint="other")  # (the version first)
    assert incompatibility(p, d) == "kvbridge version differs: prefill '', decode '0.0.9'"
    d = dataclasses.replace(p, model_revision="a" * 40)
    assert incompatibility(p, d) == f"model revision differs: prefill '', decode '{'a' * 40}'"
    d = dataclasses.replace(p, geometry=dataclasses.replace(GEOMETRY, dtype="bfloat16"))
    assert incompatibility(p, d) == "KV dtype differs: prefill 'float32', decode 'bfloat16'"


def test_a_models_revision_is_the_snapshot_its_source_names():
    sha = "0123456789abcdef0123456789abcdef01234567"
    hub = f"/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/{sha}"
    assert model_revision(hub) == sha and model_revision(hub + "/") == sha
    assert model_revision("/models/smollm2.gguf") == model_revision("tiny-random") == ""
    assert model_revision("/x/snapshots/main") == ""  # (a branch name is no revision)


@pytest.mark.parametrize("ipc", [False, True])
def test_layout_survives_the_proto_round_trip(ipc):
    layout = make_layout(shm=not ipc, ipc=ipc)
    back = layout_from_proto(layout_to_proto(layout))
    assert back.ranks[0].endpoint("shm") == (None if ipc else b"kvbridge-1-r0-ab")
    assert back.ranks[1].endpoint("cuda_ipc") == (ipc_handle(1) if ipc else None)
    assert back.ranks[1].endpoint("torch") == b"127.0.0.1:6001 " + b"ab" * 16 and back.ranks[1].endpoint("grpc") == b""
    by_name = lambda r: dataclasses.replace(r, endpoints=tuple(sorted(r.endpoints, key=lambda e: e.backend)))  # noqa: E731
    assert back == dataclasses.replace(layout, ranks=tuple(by_name(r) for r in layout.ranks))


@pytest.mark.parametrize(
    "backend,data,problem",
    [
        ("shm", b"/etc/passwd", "its shm endpoint is unusable: not a kvbridge segment name"),
        ("shm", b"", "its shm endpoint is unusable: not a kvbridge segment name"),
        ("torch", b"127.0.0.1:6001", "its torch endpoint is unusable: not 'host:port key'"),
        ("torch", b"127.0.0.1:0 " + b"ab" * 16, "its torch endpoint is unusable: not 'host:port key'"),
        ("torch", b"127.0.0.1:6001 key", "its torch endpoint is unusable: its store key is not 32 hex digits"),
        ("cuda_ipc", b"\x00\xff", "its cuda_ipc endpoint is unusable: not a CUDA IPC handle"),
        ("cuda_ipc", ipc_handle(1) + b"x", "its cuda_ipc endpoint is unusable: not a CUDA IPC handle"),
    ],
)
def test_a_peers_endpoint_is_checked_by_its_backend(backend, data, problem):
    msg = layout_to_proto(make_layout())
    msg.ranks[1].endpoints[backend] = data
    with pytest.raises(ValueError, match=f"^layout rank 1: {problem}"):
        layout_from_proto(msg)


def test_a_backend_this_node_does_not_know_is_dropped():
    msg = layout_to_proto(make_layout())
    msg.ranks[0].endpoints["nixl"] = b"anything"
    assert layout_from_proto(msg) == layout_from_proto(layout_to_proto(make_layout()))
    assert set(prefill_pb2.RankEndpoint.DESCRIPTOR.fields_by_name) == {
        "rank",
        "layer_start",
        "layer_end",
        "receiver_addr",
        "endpoints",
    }  # fmt: skip  (no backend has a field of its own, nor rides in another's)


def test_every_registered_backend_has_both_halves_and_a_preference_order():
    assert list(REGISTRY) == ["shm", "cuda_ipc", "torch", "grpc"] == list(BACKENDS)
    for name, b in REGISTRY.items():
        assert b.name == name and b.sender.name == name and callable(b.receiving)
    assert [n for n, b in REGISTRY.items() if b.direct] == ["shm", "cuda_ipc"]
    assert [n for n, b in REGISTRY.items() if b.same_host] == ["shm", "cuda_ipc"]


def test_sources_of_lists_every_prefill_rank():
    assert [(s.rank, s.layer_start, s.layer_end) for s in sources_of(make_layout())] == [(0, 0, 3), (1, 3, 6)]


def test_a_node_offers_the_backends_its_pools_device_can_drive():
    assert drivable("cpu") == ("shm", "torch", "grpc")  # shm: pools in host memory
    assert drivable("cuda:0") == drivable(torch.device("cuda", 1)) == ("cuda_ipc", "torch", "grpc")
