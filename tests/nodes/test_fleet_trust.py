"""The KV hand-off trusts only holders of the fleet key (SECURITY.md): a decode node takes routes
signed with it and registers only with a prefill node that proves it over a fresh nonce; a prefill
node writes only into pages that a registration signed with it names; and no hand-off's
destination is a page of the decode node's prefix cache. Nodes are reached directly, as a local
user without the key (but knowing every address and layout) could."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from kvbridge.cli import build_parser
from kvbridge.common import rpc, security
from kvbridge.common.security import Security, message_proof
from kvbridge.decode_node.role import destination_problem
from kvbridge.engine.pages import PageAllocator
from kvbridge.engine.prefix_cache import PrefixCache
from kvbridge.kv_transfer import adapters as kv_wire
from kvbridge.kv_transfer.backends.shm import map_segment
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.pd import TINY, fleet_signed, pd_generate, signed_route, start_nodes, stop_nodes, token_prompt, wait_idle

ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(5, 69))  # 64 tokens: 16 pages of 4
MAX_NEW = 8
BOOTSTRAP_S = 5.0  # the prefill node's --bootstrap-timeout-s: a Prefill nobody registered fails this soon
# (and a routed one's registration, a moment after its Prefill, comes well within it on a loaded host)
OTHER_KEY = b"k" * 64  # a key that is not this fleet's


@pytest.fixture(scope="module")
def fleet():
    """P pp 1 and a fresh D pp 1 on shm: the first request D serves takes its pages from 0 up."""
    nodes = start_nodes(
        {"p": ("prefill", 1, replace(TINY, bootstrap_timeout_s=BOOTSTRAP_S)), "d": ("decode", 1, "shm")}
    )
    yield nodes["p"], nodes["d"]
    stop_nodes(nodes)


class Impostor(prefill_pb2_grpc.BootstrapServicer):
    """A Bootstrap service without the fleet key: it answers GetLayout with the real prefill
    node's layout, signed with a key of its own, and records every call it gets."""

    def __init__(self, layout):
        self.layout, self.calls = layout, []
        add = prefill_pb2_grpc.add_BootstrapServicer_to_server
        self.server, port, _ = rpc.make_server("127.0.0.1", 0, [(add, self)], ["kvbridge.v1.Bootstrap"])
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def GetLayout(self, request, context):
        self.calls.append(("GetLayout", request))
        answer = prefill_pb2.GetLayoutResponse(layout=kv_wire.layout_to_proto(self.layout))
        answer.proof = message_proof(OTHER_KEY, answer, request.nonce)
        return answer

    def Register(self, request, context):
        self.calls.append(("Register", request))
        return prefill_pb2.RegisterResponse()


@pytest.fixture
def impostor(fleet):
    fake = Impostor(fleet[0].node.layout)
    yield fake
    fake.server.stop(0).wait()


def generate(d_addr: str, route: generation_pb2.PrefillRoute) -> grpc.RpcError:
    req = generation_pb2.GenerateRequest(
        rid=secrets.token_hex(8), prompt=token_prompt(PROMPT), prefill=route,
        sampling=common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as e:
        list(generation_pb2_grpc.GenerationStub(rpc.make_channel(d_addr)).Generate(req, timeout=30))
    return e.value


def decode_pool(d) -> torch.Tensor:
    """Decode rank 0's whole pool, mapped from /dev/shm as its owner's processes can."""
    layout = d.node.layout
    rank = layout.ranks[0]
    return map_segment(rank.endpoint("shm").decode(), layout.geometry.pool_bytes(layout.num_pages, rank.layers))


def test_a_route_not_signed_by_the_fleet_is_permission_denied_before_any_prefill_node_is_called(fleet, impostor):
    _, d = fleet
    room = secrets.randbits(62) + 1
    for proof in (b"", message_proof(OTHER_KEY, generation_pb2.PrefillRoute(room=room, prefill_addr=impostor.address))):
        route = generation_pb2.PrefillRoute(room=room, prefill_addr=impostor.address, proof=proof)
        e = generate(d.address, route)
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.details() == (
            f"prefill route (room {room}) not signed by a fleet member (PrefillRoute.proof is not the fleet key's; "
            "SECURITY.md)"
        )
    assert impostor.calls == []
    assert [r.kv_pages_used for r in wait_idle(d.address).ranks] == [0]


def test_a_prefill_node_without_the_fleet_key_gets_no_registration(fleet, impostor):
    """Even on a route a fleet member signed (the router, its pool given a stranger's address by
    AddNode): the stranger's layout is refused, and it gets nothing: no Register, no write key, no
    segment names. It is not remembered either: each request asks again, with a fresh nonce."""
    _, d = fleet
    for _ in range(2):
        e = generate(d.address, signed_route(secrets.randbits(62) + 1, impostor.address))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.details() == (
            f"{impostor.address} is not a prefill node of this fleet (its layout is not signed with the fleet key)"
        )
    assert [kind for kind, _ in impostor.calls] == ["GetLayout", "GetLayout"]
    nonces = [req.nonce for _, req in impostor.calls]
    assert [len(n) for n in nonces] == [32, 32] and nonces[0] != nonces[1]
    assert [r.kv_pages_used for r in wait_idle(d.address).ranks] == [0]


def test_a_prefill_node_signs_its_layout_over_the_callers_nonce(fleet):
    p, _ = fleet
    stub = prefill_pb2_grpc.BootstrapStub(rpc.make_channel(p.address))
    nonce = secrets.token_bytes(16)
    got = stub.GetLayout(prefill_pb2.GetLayoutRequest(nonce=nonce), timeout=10)
    assert got.layout == kv_wire.layout_to_proto(p.node.layout)
    assert got.proof == fleet_signed(prefill_pb2.GetLayoutResponse(layout=got.layout), nonce).proof
    assert got.proof != fleet_signed(prefill_pb2.GetLayoutResponse(layout=got.layout), bytes(16)).proof
    for bad in (b"", bytes(15), bytes(65)):
        with pytest.raises(grpc.RpcError) as e:
            stub.GetLayout(prefill_pb2.GetLayoutRequest(nonce=bad), timeout=10)
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"nonce must be 16..64 bytes, got {len(bad)}",
        )


def test_a_registration_not_signed_by_the_decode_node_writes_no_page(fleet):
    """The attack of issue 25: a client registers a room of its own with the real prefill node,
    naming the real decode layout and the pages of another request's cached prefix, then sends the
    room's Prefill. Refused without the fleet key's proof; the Prefill times out unregistered, no
    byte of the decode pool changes, and the cached prefix still answers as before."""
    p, d = fleet
    victim = token_prompt(PROMPT)
    tokens, responses, first = pd_generate(p.address, d.address, victim, MAX_NEW)
    assert not isinstance(first, grpc.RpcError) and responses[0].transfer.pages_skipped == 0
    pool = decode_pool(d)
    page_bytes = pool.numel() // d.node.layout.num_pages
    cached = pool[: 16 * page_bytes].view(16, page_bytes)  # a fresh decode node's first pages: the victim's
    assert all(bool(page.any()) for page in cached)
    before = pool.clone()

    bootstrap = prefill_pb2_grpc.BootstrapStub(rpc.make_channel(p.address))
    room = secrets.randbits(62) + 1
    forged = prefill_pb2.RegisterRequest(
        rid="attacker", room=room, backend="shm", decode_layout=kv_wire.layout_to_proto(d.node.layout),
        page_ids=list(range(16)), decode_addr=d.address, secret=secrets.token_bytes(16),
    )  # fmt: skip
    for proof in (b"", message_proof(OTHER_KEY, forged)):
        forged.proof = proof
        with pytest.raises(grpc.RpcError) as e:
            bootstrap.Register(forged, timeout=10)
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.PERMISSION_DENIED,
            f"room {room}: registration not signed by a fleet member (RegisterRequest.proof is not the fleet key's; "
            "SECURITY.md)",
        )
    attack = [t + 100 for t in PROMPT]  # as long as the victim's: the registration's 16 pages would fit it
    with pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillStub(rpc.make_channel(p.address)).Prefill(
            prefill_pb2.PrefillRequest(rid="attacker", room=room, prompt=token_prompt(attack)), timeout=30
        )
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"the decode node did not register room {room} within {BOOTSTRAP_S:g} s",
    )
    assert torch.equal(pool, before)
    again, responses, _ = pd_generate(p.address, d.address, victim, MAX_NEW)
    assert again == tokens and responses[0].transfer.pages_skipped == 16  # (from the cached pages)
    # nothing was kept of the refused registrations (a kept one would be ALREADY_EXISTS): signed, the
    # room's registration is told how its request ended
    forged.proof = b""
    with pytest.raises(grpc.RpcError) as e:
        bootstrap.Register(fleet_signed(forged), timeout=10)
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"room {room}: its request ended on the prefill node before the registration (the decode node did "
        f"not register room {room} within {BOOTSTRAP_S:g} s)",
    )


def test_cached_or_shared_pages_are_never_a_handoff_destination():
    cache = PrefixCache()
    alloc = PageAllocator(8, cache)
    a = alloc.allocate("a", 3)  # [0, 1, 2]
    cache.insert([11, 12], a[:2])  # a's first two pages are indexed: a cached prefix
    alloc.share("b", a[:1])  # and b holds page 0 too
    fresh = alloc.allocate("c", 2)
    assert destination_problem(alloc, "c", fresh) == ""
    assert destination_problem(alloc, "a", a[2:]) == ""
    assert destination_problem(alloc, "a", a) == "a: destination pages held by others [0] or cached [0, 1]"
    alloc.free("a", a)
    alloc.free("b", a[:1])  # pages 0 and 1 are idle now: cached, held by nobody
    assert destination_problem(alloc, "c", [1, *fresh]) == "c: destination pages held by others [1] or cached [1]"


# ---------------------------------------------------------------------- the fleet key


def key_of(cache: Path) -> subprocess.Popen:
    """A fresh process that prints its default fleet key (KVBRIDGE_CACHE=cache)."""
    code = "from kvbridge.common.security import default_fleet_key; print(default_fleet_key().decode())"
    env = {**os.environ, "KVBRIDGE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def test_the_default_fleet_key_is_made_once_mode_0600_and_racing_processes_agree(tmp_path):
    cache = tmp_path / "kvbridge"
    procs = [key_of(cache) for _ in range(4)]
    keys = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert [p.returncode for p in procs] == [0] * 4
    (key,) = keys
    path = cache / security.FLEET_KEY_FILE
    assert path.read_text() == key + "\n" and len(key) == 64 and int(key, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in cache.iterdir()) == ["fleet.key"]  # (no temporary file left)
    assert key_of(cache).communicate(timeout=60)[0].strip() == key  # a later process reads the same


def test_a_default_fleet_key_other_users_may_read_is_refused(tmp_path):
    path = tmp_path / "fleet.key"
    path.write_text("a" * 64 + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError) as e:
        security._fleet_key_at(path)
    assert str(e.value) == (
        f"the default fleet key {str(path)!r} must belong to this user with mode 0600, not uid {os.getuid()} mode 644"
    )


def test_the_fleet_key_flag_reads_a_file_of_at_least_32_characters_and_never_shows_it(tmp_path):
    good, short = tmp_path / "good.key", tmp_path / "short.key"
    good.write_text("f" * 40 + "\n")
    short.write_text("f" * 31)
    args = build_parser().parse_args(["decode", "--fleet-key-file", str(good)])
    sec = security.from_flags(args)
    assert sec.fleet_key == b"f" * 40 and sec.fleet() == b"f" * 40
    assert "f" * 40 not in repr(sec) and "fleet" not in sec.as_dict()
    with pytest.raises(ValueError) as e:
        security.from_flags(build_parser().parse_args(["prefill", "--fleet-key-file", str(short)]))
    assert str(e.value) == (
        f"--fleet-key-file: {str(short)!r} holds 31 characters; a fleet key has at least 32"
        " (e.g. `openssl rand -hex 32`)"
    )
    for command in ("router", "demo", "serve"):
        assert build_parser().parse_args([command, "--fleet-key-file", str(good)]).fleet_key_file == str(good)
    assert Security().fleet() == security.default_fleet_key()
