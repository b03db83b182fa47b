"""Hosts for real: every process of the fleet on a host of its own, a Linux network namespace joined
to the others by a bridge (tests/netns.py), so that "across hosts" crosses network stacks and
nothing meets on 127.0.0.1. Each process is the `kvbridge` CLI (`ip netns exec NS kvbridge ROLE
--host ADDR --port 0`); clients run inside a namespace too. Shown, each exactly:

- a router, a prefill node and a decode node on three hosts give the tokens of a colocated node on
  a fourth (greedy and seeded), over the torch engine and over gRPC; with `auto` the decode node
  picks torch, the cross-host engine (shm only within one network stack);
- a prefill pipeline split over two hosts (--num-hosts 2) with its decode node on a third gives
  the colocated tokens;
- every listener of every process is on its host's address (a one-host pipeline's own rendezvous
  on loopback, which no other host reaches);
- a prefill host whose cable is pulled while its KV moves fails its request within the decode
  node's transfer timeout (DEADLINE_EXCEEDED); with the cable back, every node holds no page and no
  request, and serves again.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_load import process_tree
from tests.netns import SUBNET, Network, ip
from tests.nodes.test_listeners import listening_sockets

KVBRIDGE = str(Path(sys.executable).with_name("kvbridge"))
HARD_TIMEOUT_S = 300  # the whole module (the hard_timeout fixture, tests/conftest.py)
NODE = ("--model", "tiny-random", "--port", "0", "--page-size", "4", "--chunked-prefill-size", "16",
        "--kv-cache-tokens", "4096", "--metrics-port", "0", "--quiet", "--log-level", "warning")  # fmt: skip
# (local prefill off: every prompt crosses the hosts, the hand-off under test)
ROUTER = ("--port", "0", "--http-port", "0", "--metrics-port", "0", "--log-level", "warning", "--startup-wait-s", "30",
          "--local-prefill-max-tokens", "0")  # fmt: skip
HOSTS = ["router", "colocated", "prefill", "decode-torch", "decode-grpc", "decode-auto", "pp0", "pp1",
         "slow-prefill", "cut-decode"]  # fmt: skip
ENGINE_USED = {"torch": "torch", "grpc": "grpc", "auto": "torch"}  # a decode node's --transfer-backend -> engine
DIST_PORT = 29500  # the split pipeline's rendezvous, on pp0 (a namespace of its own: the port is free)
MAX_NEW_TOKENS = 8
NETWORKS: list[Network] = []  # closed by the hard timeout
pytestmark = pytest.mark.usefixtures("hard_timeout")


def before_hard_exit() -> None:
    for net in NETWORKS:
        net.close()


def make_requests(seed: int, n: int = 4) -> list[dict]:
    """n prompts of 17.. tokens (two or three chunks of 16), each greedy and seeded."""
    prompts = [[(seed * 31 + 11 * i + 5 * j) % 250 + 3 for j in range(17 + 6 * i)] for i in range(n)]
    greedy = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    seeded = [{**greedy, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": seed * 100 + i} for i in range(n)]
    return [{"prompt": p, "sampling": s} for i, p in enumerate(prompts) for s in (greedy, seeded[i])]


REQUESTS = make_requests(1)  # over each engine
PP_REQUESTS = make_requests(2)  # over the split pipeline (prompts no decode node holds yet)


@pytest.fixture(scope="module")
def net():
    network = Network(HOSTS)
    NETWORKS.append(network)
    try:
        yield network
    finally:
        network.close()


def test_the_network_lives_in_its_namespaces_and_goes_with_them():
    network = Network(["x", "y"])
    NETWORKS.append(network)
    try:
        sleeper = network["x"].start("sleep", "300")
        names = {network.switch, network["x"].ns, network["y"].ns}
        assert names <= set(ip("netns", "list").split())
        assert SUBNET not in ip("addr") + ip("route")  # (the root namespace: no address, no route)
        assert network["y"].client("status", timeout=30) == []  # (a client runs inside)
    finally:
        network.close()
    assert sleeper.proc.returncode == -signal.SIGTERM
    assert names & set(ip("netns", "list").split()) == set()


def node(net: Network, host: str, role: str, *flags: str):
    return net[host].start(KVBRIDGE, role, "--host", net[host].address, *NODE, *flags, name=host)


def router(net: Network, name: str, *flags: str):
    return net["router"].start(KVBRIDGE, "router", "--host", net["router"].address, *ROUTER, *flags, name=name)


def generate(net: Network, target: str, requests: list[dict]) -> list[dict]:
    return net["router"].client("generate", target, json.dumps(requests), timeout=120)


@pytest.fixture(scope="module")
def fleet(net):
    """name -> process: the colocated reference, a prefill node, a decode node per engine, the split
    pipeline (pp0 + pp1), and a router per pair, all on their own hosts (the routers share one)."""
    split = ("--pp-size", "2", "--num-hosts", "2", "--dist-init-addr", f"{net['pp0'].address}:{DIST_PORT}")
    procs = {
        "colocated": node(net, "colocated", "serve"),
        "prefill": node(net, "prefill", "prefill"),
        **{f"decode-{e}": node(net, f"decode-{e}", "decode", "--transfer-backend", e) for e in ENGINE_USED},
        "pp0": node(net, "pp0", "prefill", *split, "--host-rank", "0"),
        "pp1": node(net, "pp1", "prefill", *split, "--host-rank", "1"),
    }
    for p in procs.values():
        p.wait_ready()
    pairs = {f"router-{e}": ("prefill", f"decode-{e}") for e in ENGINE_USED} | {"router-pp": ("pp0", "decode-torch")}
    routers = {
        name: router(net, name, "--prefill", procs[p].address, "--decode", procs[d].address)
        for name, (p, d) in pairs.items()
    }
    for r in routers.values():
        r.wait_ready()
    return procs | routers


@pytest.fixture(scope="module")
def reference(net, fleet):
    """The colocated node's tokens for REQUESTS + PP_REQUESTS."""
    results = generate(net, fleet["colocated"].address, REQUESTS + PP_REQUESTS)
    assert [r["code"] for r in results] == ["OK"] * len(results)
    assert all(len(r["tokens"]) == MAX_NEW_TOKENS for r in results)
    return [r["tokens"] for r in results]


@pytest.mark.parametrize("engine", ["torch", "grpc"])
def test_disaggregated_across_hosts_gives_the_colocated_tokens(net, fleet, reference, engine):
    results = generate(net, fleet[f"router-{engine}"].address, REQUESTS)
    assert [(r["code"], r["backend"]) for r in results] == [("OK", engine)] * len(REQUESTS)
    assert [r["tokens"] for r in results] == reference[: len(REQUESTS)]


def test_auto_picks_the_torch_engine_between_hosts_not_shm(net, fleet, reference):
    results = generate(net, fleet["router-auto"].address, REQUESTS)
    assert [(r["code"], r["backend"]) for r in results] == [("OK", "torch")] * len(REQUESTS)
    assert [r["tokens"] for r in results] == reference[: len(REQUESTS)]


def test_a_prefill_pipeline_split_over_two_hosts_gives_the_colocated_tokens(net, fleet, reference):
    results = generate(net, fleet["router-pp"].address, PP_REQUESTS)
    assert [(r["code"], r["backend"]) for r in results] == [("OK", "torch")] * len(PP_REQUESTS)
    assert [r["tokens"] for r in results] == reference[len(REQUESTS) :]
    [status] = net["router"].client("status", fleet["pp0"].address)
    assert status["pages_used"] == [0, 0]  # (its two ranks, one per host)


# ---------------------------------------------------------------------- listeners


def test_every_listener_is_on_its_hosts_address(net, fleet):
    for name in ("router-torch", "router-grpc", "router-auto", "router-pp"):  # every engine's pairs open
        assert [r["code"] for r in generate(net, fleet[name].address, REQUESTS[:1])] == ["OK"]
    tree = process_tree({p.name: p.pid for p in net.processes()})
    found = {label: {a for _, a, _ in listening_sockets({label: pid})} for label, pid in tree.items()}
    found = {label: addresses for label, addresses in found.items() if addresses}
    own = {p.name: {host.address} for host in net.hosts.values() for p in host.procs}  # (the routers share one)
    lo = "127.0.0.1"  # a one-host pipeline's rendezvous (pipeline/group.py), reached by no other host
    assert found == own | {
        "colocated/rank": {lo},  # (no KV plane)
        "prefill/rank": own["prefill"] | {lo},  # its side of each torch pair
        **{f"decode-{e}/rank": own[f"decode-{e}"] | {lo} for e in ENGINE_USED},  # KVReceiver, torch store
        "pp0/rank": own["pp0"],  # the split pipeline's store and gloo pairs, and its torch pairs
        "pp1/rank": own["pp1"],
    }


# ---------------------------------------------------------------------- a cable pulled mid-transfer

SLOW_STEP_MS = 300  # every forward step of the cut prefill node: LONG_PROMPT prefills in 6 chunks, ~2 s
TRANSFER_TIMEOUT_S = 3.0  # the cut decode node's --transfer-timeout-s (and the prefill node's)
FIRST_TOKEN_TIMEOUT_S = 10.0  # the cut router's: a backstop the transfer timeout comes well before
# The bound, from the cable pulled to the client's failure. The prefill host is silent, not gone (no
# reset): the decode node's health stream to it notices only by keepalive, after ~15 s (common/rpc.py),
# and the router's first-token timeout is 10 s. What ends the request is the decode node's transfer
# timeout, counted from its pages being reserved, before the cut: rank 0 checks deadlines every 0.1 s,
# then the failure takes one consensus round and two gRPC hops on links that stay up (decode, router,
# client). 2 s of slack for those on 2 shared cores.
CUT_BOUND_S = TRANSFER_TIMEOUT_S + 2.0
LONG_PROMPT = [(13 * j) % 250 + 3 for j in range(96)]


@pytest.fixture(scope="module")
def cut_fleet(net):
    timeouts = ("--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--bootstrap-timeout-s", str(TRANSFER_TIMEOUT_S))
    procs = {
        "slow-prefill": node(net, "slow-prefill", "prefill", "--fault-inject", f"step_delay_ms={SLOW_STEP_MS}",
                             *timeouts),
        "cut-decode": node(net, "cut-decode", "decode", "--transfer-backend", "auto", *timeouts),
    }  # fmt: skip
    for p in procs.values():
        p.wait_ready()
    pair = ("--prefill", procs["slow-prefill"].address, "--decode", procs["cut-decode"].address)
    limits = ("--max-attempts", "1", "--first-token-timeout-s", str(FIRST_TOKEN_TIMEOUT_S), "--health-retry-s", "0.2")
    procs["router-cut"] = router(net, "router-cut", *pair, *limits).wait_ready()
    return procs


@pytest.mark.long
def test_a_cable_pulled_mid_transfer_fails_the_request_in_bounded_time_and_leaks_nothing(net, cut_fleet, reference):
    p, d, r = (cut_fleet[name].address for name in ("slow-prefill", "cut-decode", "router-cut"))
    client, rid = net["router"], "cut-1"
    # caught: the decode node holds its pages and waits, the prefill node, routed, pushes each chunk
    caught = client.client_async("wait_phase", "60", d, rid, "transferring", p, p, rid, "prefilling", d)
    request = {"rid": rid, "prompt": LONG_PROMPT, "sampling": {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}}
    call = client.client_async("generate", r, json.dumps([request]))
    seen = caught.result()
    cut = time.monotonic()
    net.link_down(net["slow-prefill"])
    try:
        [failed] = call.result()
    finally:
        net.link_up(net["slow-prefill"])
    assert [(s["phase"], s["peer"]) for s in seen] == [("transferring", p), ("prefilling", d)]
    why = f"the KV cache did not arrive within {TRANSFER_TIMEOUT_S:g} s (from decode/{d})"  # the decode node's
    assert (failed["code"], failed["details"], failed["tokens"]) == ("DEADLINE_EXCEEDED", why, [])
    took = failed["ended"] - cut
    print(f"cut: the request failed {took:.2f} s after the cable was pulled: {failed['details']}")
    assert took < CUT_BOUND_S

    start = time.monotonic()
    statuses = client.client("wait_idle", "60", p, d, r, timeout=90)
    print(f"cut: every node idle {time.monotonic() - start:.2f} s after the cable was back")
    held = [(s["role"], s["pages_used"], {q: n for q, n in s["queues"].items() if n}, s["requests_in_flight"])
            for s in statuses]  # fmt: skip
    assert held == [("prefill", [0], {}, 0), ("decode", [0], {}, 0), ("router", [], {}, 0)]
    again = generate(net, r, REQUESTS[:2])
    assert [(x["code"], x["backend"], x["tokens"]) for x in again] == [
        ("OK", "torch", tokens) for tokens in reference[:2]
    ]
