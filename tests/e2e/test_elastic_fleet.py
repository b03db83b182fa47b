"""Elastic P:D on real processes: a router over P, D1 (pp 2) and D2, every one a `kvbridge ... --elastic`
CLI process with an admin key. Nodes switch role with `kvbridge admin set-role` through the router
while twelve streams run: every stream completes equal to colocated serving (an in-process engine,
greedy), none fails, and requests after a switch are served by the new split. Odd and hostile
switches (no admin key, the last node of a role, a switch during a switch, a node killed while it
switches) get clear statuses and leave the fleet serving."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.common.sampling import SamplingParams
from kvbridge.common.security import auth_metadata
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from tests.conftest import make_llm
from tests.e2e.test_load import KVBRIDGE, Process
from tests.e2e.test_migration import Stream

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("hard_timeout")]
HARD_TIMEOUT_S = 900
ADMIN_KEY = "elastic-admin-key-0123456789abcdef"
MAX_TOKENS = 120
PROMPTS = [[(7 * i + 5 * j) % 250 + 3 for j in range(12 + 2 * i)] for i in range(12)]  # 12..34 tokens
NODE = ("--model", "tiny-random", "--port", "0", "--page-size", "4", "--chunked-prefill-size", "16",
        "--kv-cache-tokens", "8192", "--log-level", "warning", "--quiet", "--elastic")  # fmt: skip
DECODE_DELAY = ("--fault-inject", "step_delay_ms=15")  # 120 tokens: ~2 s a stream, so a switch meets them running


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "admin.key"
    path.write_text(ADMIN_KEY)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def fleet(key_file):
    keyed = ("--admin-key-file", key_file)
    nodes = {
        "p": Process("p", "prefill", *NODE, *keyed),
        "d1": Process("d1", "decode", *NODE, *keyed, "--pp-size", "2", *DECODE_DELAY),
        "d2": Process("d2", "decode", *NODE, *keyed, *DECODE_DELAY),
    }
    try:
        for node in nodes.values():
            node.wait_ready()
        decode = f"{nodes['d1'].address},{nodes['d2'].address}"
        nodes["router"] = Process(
            "router", "router", "--prefill", nodes["p"].address, "--decode", decode, "--port", "0", "--http-port",
            "0", "--health-retry-s", "0.2", "--routing", "least_loaded", "--log-level", "warning", *keyed,
        )  # fmt: skip
        nodes["router"].wait_ready()
        yield nodes
    finally:
        for node in sorted(nodes.values(), key=lambda n: n.role != "router"):
            node.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = make_llm(tiny_model, chunked_prefill_size=16)
    return [c.output_ids for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True))]


def admin(addr: str):
    return admin_pb2_grpc.AdminStub(rpc.make_channel(addr))


KEY = auth_metadata(ADMIN_KEY)


def roles(router: str) -> dict[str, str]:
    listed = admin(router).ListNodes(admin_pb2.ListNodesRequest(), timeout=10, metadata=KEY).nodes
    return {n.address: n.role for n in listed if n.healthy}


def served(addr: str) -> int:
    return admin(addr).GetStatus(admin_pb2.GetStatusRequest(), timeout=10, metadata=KEY).requests_served


def set_role(fleet, name: str, role: str, *flags: str, key_file: str = "") -> subprocess.CompletedProcess:
    """`kvbridge admin set-role ROLE --target ROUTER --node NAME's address --json` (with the key file)."""
    cmd = [KVBRIDGE, "admin", "set-role", role, "--target", fleet["router"].address, "--node", fleet[name].address]
    cmd += ["--json", *flags, *(("--key-file", key_file) if key_file else ())]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200)


def run_streams(fleet, tag: str, during) -> tuple[list[Stream], object]:
    """Twelve greedy streams through the router; `during()` runs once every stream has its first
    token; returns the ended streams and what `during` returned."""
    port = int(fleet["router"].address.rpartition(":")[2])
    streams = [GreedyStream(port, i, f"{tag}-{i}") for i in range(len(PROMPTS))]
    deadline = time.monotonic() + 60
    while not all(s.tokens for s in streams):
        assert time.monotonic() < deadline, "streams without a first token after 60 s"
        time.sleep(0.01)
    result = during()
    return [s.result() for s in streams], result


def GreedyStream(port: int, i: int, rid: str) -> Stream:
    """Prompt i of this module, greedy, MAX_TOKENS tokens, through the router."""
    return Stream(port, i, rid, PROMPTS[i], common_pb2.SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True))


def switched(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def check_streams(streams: list[Stream], reference: list[list[int]]) -> None:
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.tokens for s in streams] == reference
    assert {s.finish_reason for s in streams} == {"length"}


def split_of(fleet, router: str, count: int = 8, names=("p", "d1", "d2")) -> dict[str, int]:
    """Requests each node served of `count` more streams (each counts once on P and once on D)."""
    before = {name: served(fleet[name].address) for name in names}
    streams, _ = run_streams_n(fleet, "split", count)
    assert [s.error for s in streams] == [None] * count
    return {name: served(fleet[name].address) - before[name] for name in before}


def run_streams_n(fleet, tag: str, count: int):
    port = int(fleet["router"].address.rpartition(":")[2])
    streams = [GreedyStream(port, i, f"{tag}-{i}") for i in range(count)]
    return [s.result() for s in streams], None


def test_a_decode_node_switched_to_prefill_under_twelve_streams(fleet, reference, key_file):
    router, d1 = fleet["router"].address, fleet["d1"].address
    streams, done = run_streams(fleet, "d-to-p", lambda: set_role(fleet, "d1", "prefill", key_file=key_file))
    check_streams(streams, reference)
    answer = switched(done)
    assert (answer["old_role"], answer["role"], answer["node"]) == ("decode", "prefill", d1)
    print(f"\nswitch decode->prefill under 12 streams: {answer['switch_s']:.3f} s ({answer['drain_s']:.3f} s draining)")
    assert roles(router)[d1] == "prefill"
    split = split_of(fleet, router)
    # every decode half on d2 now; the prefill halves spread over p and d1
    assert split["d2"] == 8 and split["p"] + split["d1"] == 8 and split["d1"] > 0, split


def test_a_prefill_node_switched_to_decode_under_twelve_streams(fleet, reference, key_file):
    router, d1 = fleet["router"].address, fleet["d1"].address
    if roles(router)[d1] != "prefill":  # (the test before leaves it so; alone, this one sets it)
        switched(set_role(fleet, "d1", "prefill", key_file=key_file))
    streams, done = run_streams(fleet, "p-to-d", lambda: set_role(fleet, "d1", "decode", key_file=key_file))
    check_streams(streams, reference)
    answer = switched(done)
    assert (answer["old_role"], answer["role"]) == ("prefill", "decode")
    print(f"\nswitch prefill->decode under 12 streams: {answer['switch_s']:.3f} s ({answer['drain_s']:.3f} s draining)")
    assert roles(router) == {fleet["p"].address: "prefill", d1: "decode", fleet["d2"].address: "decode"}
    split = split_of(fleet, router)
    assert split["p"] == 8 and split["d1"] + split["d2"] == 8, split


def test_a_migrating_switch_moves_its_streams_and_they_complete(fleet, reference, key_file):
    d2 = fleet["d2"].address
    streams, done = run_streams(
        fleet, "migrate", lambda: set_role(fleet, "d2", "prefill", "--migrate", key_file=key_file)
    )
    check_streams(streams, reference)  # the streams on d2 were resumed on d1, equal
    answer = switched(done)
    assert answer["role"] == "prefill" and answer["drain_s"] < 2.5
    print(f"\nswitch decode->prefill, migrating: {answer['switch_s']:.3f} s ({answer['drain_s']:.3f} s draining)")
    assert roles(fleet["router"].address)[d2] == "prefill"
    assert switched(set_role(fleet, "d2", "decode", key_file=key_file))["role"] == "decode"


def test_odd_and_hostile_switches_are_refused_clearly(fleet, key_file):
    router, p, d1 = fleet["router"].address, fleet["p"].address, fleet["d1"].address
    # no admin key, at the router and at the node
    refused = set_role(fleet, "d1", "prefill")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    with pytest.raises(grpc.RpcError) as e:
        admin(d1).SetRole(admin_pb2.SetRoleRequest(role="prefill"), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the last prefill node
    last = set_role(fleet, "p", "decode", key_file=key_file)
    assert last.returncode == 1 and "FAILED_PRECONDITION" in last.stderr
    assert f"{p} is the last prefill node serving" in last.stderr
    # a bad role names the value
    bad = set_role(fleet, "d1", "router", key_file=key_file)
    assert bad.returncode == 2 and "ROLE must be one of colocated, prefill, decode, got 'router'" in bad.stderr
    # a switch during a switch: the second is ABORTED, the first completes
    streams = [GreedyStream(int(router.rpartition(":")[2]), i, f"busy-{i}") for i in range(4)]
    while not all(s.tokens for s in streams):
        time.sleep(0.01)
    first: list = []
    thread = threading.Thread(target=lambda: first.append(set_role(fleet, "d1", "colocated", key_file=key_file)))
    thread.start()
    while not any(n.switching_to for n in admin(router).ListNodes(admin_pb2.ListNodesRequest(), metadata=KEY).nodes):
        time.sleep(0.005)
    second = set_role(fleet, "d2", "colocated", key_file=key_file)
    second_node = set_role(fleet, "d1", "prefill", key_file=key_file)
    thread.join(200)
    assert "ABORTED" in second_node.stderr and "is in progress" in second_node.stderr
    # d2 is the last decode node while d1 switches away (d1 counts as gone)
    assert "FAILED_PRECONDITION" in second.stderr and f"{fleet['d2'].address} is the last decode node" in second.stderr
    assert switched(first[0])["role"] == "colocated"
    assert [s.result().error for s in streams] == [None] * 4
    for name in ("d1", "d2"):
        assert switched(set_role(fleet, name, "decode", key_file=key_file))["role"] == "decode"


def test_a_node_killed_while_it_switches_leaves_the_fleet_serving(fleet, reference, key_file):
    router = fleet["router"].address
    result: list = []
    streams, _ = run_streams(
        fleet,
        "killed",
        lambda: (
            threading.Thread(target=lambda: result.append(set_role(fleet, "d2", "prefill", key_file=key_file))).start(),
            time.sleep(0.3),
            fleet["d2"].proc.kill(),
        ),
    )
    check_streams(streams, reference)  # d2's streams migrated to d1 when it died
    deadline = time.monotonic() + 30
    while not result:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert result[0].returncode == 1 and "UNAVAILABLE" in result[0].stderr, result[0].stderr
    assert fleet["d2"].address not in roles(router)
    split = split_of(fleet, router, 4, names=("p", "d1"))
    assert split["p"] == 4 and split["d1"] == 4, split
