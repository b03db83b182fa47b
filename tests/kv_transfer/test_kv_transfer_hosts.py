"""Where a host ends, in processes of real network namespaces (tests/netns.py): its identity
(kv_transfer.layout.local_host_id, which decides whether `auto` may pick shm) and the address it
listens on for a peer (common.net.local_address)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.common.net import local_address
from kvbridge.kv_transfer import choose_backend, local_host_id
from tests.kv_transfer.test_kv_transfer_factory import make_layout
from tests.netns import Network


@pytest.fixture(scope="module")
def net():
    network = Network(["a", "b"])
    try:
        yield network
    finally:
        network.close()


def run(*argvs: list[str], code: str) -> list:
    """What `python -c CODE` printed, as JSON, run at once after each argv prefix (`ip netns exec NS`)."""
    procs = [subprocess.Popen([*a, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for a in argvs]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs)
    return [json.loads(out) for out in outs]


@pytest.fixture(scope="module")
def host_ids(net) -> dict[str, str]:
    """local_host_id() of two processes in host a, one in host b, and this process's (the root namespace)."""
    code = "import json; from kvbridge.kv_transfer.layout import local_host_id; print(json.dumps(local_host_id()))"
    a1, a2, b = run(net["a"].argv(), net["a"].argv(), net["b"].argv(), code=code)
    return {"a1": a1, "a2": a2, "b": b, "here": local_host_id()}


def test_a_host_is_a_network_namespace(host_ids):
    assert host_ids["a1"] == host_ids["a2"]
    assert len({host_ids["a1"], host_ids["b"], host_ids["here"]}) == 3
    assert {i.rpartition("/")[0] for i in host_ids.values()} == {host_ids["here"].rpartition("/")[0]}  # one name, boot


def test_auto_picks_a_cross_host_engine_between_namespaces(host_ids):
    a, b = host_ids["a1"], host_ids["b"]
    assert choose_backend(make_layout(a), make_layout(b), "cpu") == "torch"
    assert choose_backend(make_layout(a), make_layout(a), "cpu") == "shm"


def test_a_loopback_peer_is_reached_from_loopback():
    assert [local_address(p) for p in ("127.0.0.1", "localhost", "::1", "[::1]")] == [
        "127.0.0.1", "127.0.0.1", "::1", "::1"
    ]  # fmt: skip


def test_the_local_address_is_the_one_the_kernel_routes_to_the_peer(net):
    a, b = net["a"], net["b"]
    peers = [b.address, a.address, "127.0.0.1", "192.0.2.7"]  # the other host, itself, loopback, no route
    code = f"""if True:
        import json
        from kvbridge.common.net import local_address
        out = []
        for peer in {peers!r}:
            try:
                out.append(local_address(peer))
            except OSError as e:
                out.append(str(e))
        print(json.dumps(out))"""
    unreachable = "no local address reaches '192.0.2.7': [Errno 101] Network is unreachable"
    assert run(a.argv(), code=code) == [[a.address, a.address, "127.0.0.1", unreachable]]
