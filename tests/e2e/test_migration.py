"""Decode failover (migration), on real processes: a router over one prefill node and two decode
nodes (`kvbridge` CLI processes), eight streams of MAX_TOKENS tokens each (four greedy, four
seeded samples), and one second after every stream's first token the decode node holding more of
them is taken away: killed (`kill -9`), one of its ranks killed, or drained (SIGTERM with a short
grace). Every stream must complete, its tokens and text equal to the undisturbed run's; the streams
on that node are migrated (one `phase=migrate` line each, counted in kvbridge_router_migrations_total), and the
surviving nodes end with no page used and nothing queued.

The undisturbed run is the same eight requests on the same fleet just before; then every node's
prefix cache is emptied, so that the disturbed run starts from the same state."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.router.config import RouterConfig
from kvbridge.router.server import start_router
from kvbridge.v1 import admin_pb2, common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.test_load import process_tree
from tests.nodes.test_failover import NodeProcess, pages_used, poll, wait_for
from tests.pd import admin

HARD_TIMEOUT_S = 600  # the whole module (the hard_timeout fixture, tests/conftest.py)
MAX_TOKENS = 300
STEP_DELAY_MS = 15  # each decode step: 300 tokens take ~5 s, so one second in every stream is mid-way
PROMPTS = [[(11 * i + 3 * j) % 250 + 3 for j in range(10 + 3 * i)] for i in range(8)]  # 10..31 tokens
KILL_AFTER_S = 1.0
pytestmark = pytest.mark.usefixtures("hard_timeout")


def sampling(i: int) -> common_pb2.SamplingParams:
    """Streams 0-3 greedy, 4-7 sampled with a seed."""
    if i < 4:
        return common_pb2.SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)
    return common_pb2.SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i)


class Stream:
    """A Generate call through the router, read in a thread: token ids, text, usage, error."""

    def __init__(self, port: int, i: int, rid: str, ids: list[int] | None = None, params=None):
        """Prompt i and its sampling of this module, or `ids` and `params` (a SamplingParams message)."""
        stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{port}"))
        prompt = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=PROMPTS[i] if ids is None else ids))
        params = sampling(i) if params is None else params
        request = generation_pb2.GenerateRequest(rid=rid, prompt=prompt, sampling=params)
        self.call = stub.Generate(request, timeout=120)
        self.rid, self.tokens, self.text = rid, [], ""
        self.finish_reason, self.usage, self.error = "", None, None
        self.last, self.gaps = (
            time.monotonic(),
            [],
        )  # seconds before each response (printed: the stall a migration costs)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for resp in self.call:
                self.gaps.append(time.monotonic() - self.last)
                self.last = time.monotonic()
                self.tokens += resp.token_ids
                self.text += resp.text
                if resp.finish_reason:
                    self.finish_reason, self.usage = resp.finish_reason, resp.usage
        except grpc.RpcError as e:
            self.error = e

    def result(self) -> Stream:
        self.thread.join(120)
        assert not self.thread.is_alive(), f"{self.rid} did not end"
        return self

    def outcome(self) -> tuple:
        usage = (self.usage.prompt_tokens, self.usage.completion_tokens) if self.usage else None
        return self.error, self.finish_reason, usage, self.tokens, self.text


def run_all(port: int, tag: str) -> list[Stream]:
    return [Stream(port, i, f"{tag}-{i}") for i in range(len(PROMPTS))]


@contextlib.contextmanager
def make_fleet(*model: str):
    """router (in this process) + 1 P + 2 D (pp 2 each, so that a rank can be killed); `model`: flags
    naming another model than tiny-random (the decode steps then need no delay to be caught)."""
    delay = () if model else ("--fault-inject", f"step_delay_ms={STEP_DELAY_MS}")
    d_flags = ("--pp-size", "2", *delay, "--shutdown-grace-s", "1", *model)
    nodes = {"p": NodeProcess("prefill", "--pp-size", "2", *model), "d1": NodeProcess("decode", *d_flags)}
    nodes["d2"] = NodeProcess("decode", *d_flags)
    for node in nodes.values():
        node.wait_ready(timeout=300)
    config = RouterConfig(
        port=0,
        http_port=0,
        prefill=(nodes["p"].address,),
        decode=(nodes["d1"].address, nodes["d2"].address),
        health_retry_s=0.2,
        startup_wait_s=30,
        routing="least_loaded",  # four streams on each decode node
    )
    router = start_router(config)
    try:
        yield router, nodes
    finally:
        router.stop(grace_s=0)
        for node in nodes.values():
            node.stop()


@pytest.fixture
def fleet():
    with make_fleet() as made:
        yield made


def migrations(router) -> dict[str, float]:
    samples = router.dispatcher.metrics.migrations.collect()[0].samples
    return {s.labels["reason"]: s.value for s in samples if s.name.endswith("_total") and s.value}


def disturb(router, nodes, how) -> tuple[list[Stream], list[Stream], dict, dict]:
    """The undisturbed run, then the same streams with the busier decode node taken away by `how`
    one second in. Returns (undisturbed, disturbed, tokens out per rid on the victim, survivors)."""
    stub = admin(f"127.0.0.1:{router.port}")
    before = [s.result() for s in run_all(router.port, "calm")]
    assert [(s.error, s.finish_reason, len(s.tokens)) for s in before] == [(None, "length", MAX_TOKENS)] * 8
    stub.ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=10)

    streams = run_all(router.port, "hit")
    poll(lambda: all(r.output_tokens for r in router.dispatcher.in_flight()), 120, "every stream streaming")
    time.sleep(KILL_AFTER_S)
    listed = stub.ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests
    d_addrs = [nodes["d1"].address, nodes["d2"].address]
    on = {a: {r.rid: r.output_tokens for r in listed if r.peer.endswith(" -> " + a)} for a in d_addrs}
    victim_addr = max(d_addrs, key=lambda a: len(on[a]))
    victim = next(n for n in nodes.values() if n.address == victim_addr)
    how(victim)
    return before, [s.result() for s in streams], on[victim_addr], {k: n for k, n in nodes.items() if n is not victim}


def kill_node(node: NodeProcess) -> None:
    node.kill()


def kill_rank(node: NodeProcess) -> None:
    """kill -9 of the decode node's second rank: the node fails its streams (UNAVAILABLE) and exits 1."""
    ranks = [pid for label, pid in sorted(process_tree({"d": node.proc.pid}).items()) if label.startswith("d/rank")]
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGKILL)
    assert node.proc.wait(timeout=30) == 1


def drain(node: NodeProcess) -> None:
    """SIGTERM: the node stops taking requests, gives those in flight --shutdown-grace-s (1 s) and
    ends the rest with UNAVAILABLE, then exits 0."""
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=60) == 0


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(kill_node, id="kill-9"),
        pytest.param(kill_rank, id="rank-killed", marks=pytest.mark.long),
        pytest.param(drain, id="drained", marks=pytest.mark.long),
    ],
)
def test_every_stream_of_a_lost_decode_node_completes_equal_to_the_undisturbed_run(fleet, router_phases, how):
    check_failover(*fleet, router_phases, how)


@pytest.mark.slow
def test_the_default_model_streams_of_a_killed_decode_node_complete_equal_to_the_undisturbed_run(router_phases):
    """The same kill -9 with SmolLM2-135M-Instruct serving the 300-token streams."""
    with make_fleet("--model", "smollm2-135m-instruct") as (router, nodes):
        check_failover(router, nodes, router_phases, kill_node)


def check_failover(router, nodes, router_phases, how) -> None:
    before, after, on_victim, survivors = disturb(router, nodes, how)

    assert [s.outcome() for s in after] == [s.outcome() for s in before]
    migrated = {f["rid"] for _, f in router_phases if f["phase"] == "migrate"}
    retried = {f["rid"] for _, f in router_phases if f["phase"] == "retry"}
    assert [f for _, f in router_phases if f["phase"] == "not_migrated"] == []
    # every stream on the node had tokens out when it went: each is migrated, none retried
    assert len(on_victim) == 4 and all(on_victim.values()), on_victim
    assert (migrated, retried) == (set(on_victim), set())
    assert migrations(router) == {"unavailable": len(migrated)}
    assert all(f["tokens"] > 0 and f["migration"] == 1 for _, f in router_phases if f["phase"] == "migrate")
    # the prefill node found the prompt's full pages in its cache when it computed prompt + tokens sent
    cached = {s.rid: s.usage.cached_tokens for s in after if s.rid in migrated}
    assert cached == {rid: len(PROMPTS[int(rid[4:])]) // 4 * 4 for rid in migrated}
    stalls = sorted(round(max(s.gaps[1:]), 3) for s in after if s.rid in migrated)
    print(f"{how.__name__}: {len(migrated)} streams migrated {on_victim}; longest gap of each: {stalls} s")

    # nothing leaked on the surviving nodes, and the fleet still serves
    for node in survivors.values():
        wait_for(lambda n=node: pages_used(n.address) == [0, 0], 30, f"{node.role} pages back")
        status = admin(node.address).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
        assert status.requests_in_flight == 0 and not any(status.queues.values()), status
    wait_for(lambda: router.dispatcher.num_in_flight() == 0, 10, "the router idle")
    again = poll(lambda: [s.result() for s in run_all(router.port, "again")], 60, "a run after the loss")
    assert [s.outcome() for s in again] == [s.outcome() for s in before]


@pytest.mark.slow
def test_two_hundred_streams_survive_a_decode_node_kill_token_for_token(router_phases):
    """Load: 200 concurrent streams (128 tokens each, greedy and seeded) through router + P + 2 D;
    once 100 stream, the busier decode node is killed. All 200 complete as in the undisturbed run."""
    big = ("--kv-cache-tokens", "32768", "--max-pending-requests", "1000")  # (one decode node holds them all)
    d_flags = ("--pp-size", "2", "--fault-inject", f"step_delay_ms={STEP_DELAY_MS}", *big)
    nodes = {
        "p": NodeProcess("prefill", *big),
        "d1": NodeProcess("decode", *d_flags),
        "d2": NodeProcess("decode", *d_flags),
    }
    for node in nodes.values():
        node.wait_ready()
    d_addrs = (nodes["d1"].address, nodes["d2"].address)
    config = RouterConfig(
        port=0, http_port=0, prefill=(nodes["p"].address,), decode=d_addrs, health_retry_s=0.2, startup_wait_s=30
    )
    router = start_router(config)
    channel = rpc.make_channel(f"127.0.0.1:{router.port}")
    stub = generation_pb2_grpc.GenerationStub(channel)

    def run(tag: str) -> list[tuple]:
        out: list[tuple] = [()] * 200

        def one(i: int) -> None:
            params = common_pb2.SamplingParams()
            params.CopyFrom(sampling(i % 8))
            params.max_new_tokens = 128
            prompt = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=PROMPTS[i % 8] + [3 + i % 200]))
            req = generation_pb2.GenerateRequest(rid=f"{tag}-{i}", prompt=prompt, sampling=params)
            try:
                responses = list(stub.Generate(req, timeout=300))
                out[i] = ([t for r in responses for t in r.token_ids], "".join(r.text for r in responses))
            except grpc.RpcError as e:
                out[i] = (e.code(), e.details())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        if tag == "hit":  # once 100 streams have tokens out (the prefill node takes the prompts in turn)
            poll(lambda: sum(r.output_tokens > 0 for r in router.dispatcher.in_flight()) >= 100, 120, "100 streaming")
            on = {a: sum(r.peer.endswith(" -> " + a) for r in router.dispatcher.in_flight()) for a in d_addrs}
            victim = next(n for n in nodes.values() if n.address == max(d_addrs, key=on.get))
            victim.kill()
        for t in threads:
            t.join(300)
        return out

    try:
        before = run("calm")
        assert all(len(tokens) == 128 for tokens, _ in before), [b for b in before if len(b[0]) != 128][:3]
        admin(f"127.0.0.1:{router.port}").ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=10)
        after = run("hit")
        assert after == before
        migrated = {f["rid"] for _, f in router_phases if f["phase"] == "migrate"}
        print(f"200 streams: {len(migrated)} migrated, {migrations(router)}")
        assert len(migrated) > 20 and migrations(router) == {"unavailable": len(migrated)}
        survivors = [n for n in nodes.values() if n.proc.poll() is None]
        for node in survivors:
            wait_for(lambda n=node: set(pages_used(n.address)) == {0}, 60, f"{node.role} pages back")
    finally:
        channel.close()
        router.stop(grace_s=0)
        for node in nodes.values():
            node.stop()
