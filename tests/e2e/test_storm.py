"""A storm of cancelled streams: every request the router accepts ends, and the fleet is left as it
was (issue 25, must-show 4).

A router, a prefill node and a decode node of the tiny-random model, each an OS process started
with the `kvbridge` CLI (tests/e2e/test_load.py's Process). Each round sends streams at once (at
most CONCURRENCY open): streamed chats of one prompt, of n = 4 choices, streamed completions of a
list of 2 to 4 prompts (n 1 or 4), and gRPC Generate streams (n 1 or 4). Each client stops at a
random point: right after sending its request, or after reading a random number of events
(responses), then it closes its connection (half of the HTTP ones with a reset) or cancels its
call; a few read to the end. After each round, exactly:
- the router holds no request (Admin: in flight 0, every node's outstanding 0) and Drain reports
  the router empty;
- each node is idle: nothing queued, listed or in flight, 0 KV pages used;
- every process of the fleet (router, nodes, their rank processes) is alive, with exactly the open
  file descriptors it had at the start (measured after warm-up streams, which make what is made
  once: channels, the router's tokenizer), and its threads back to the start but for thread pools
  that grow on demand to a fixed size: POOL_THREADS more at most.

100 streams a round by default, 1,000 with -m slow; three rounds each. (A round costs the ranks about
0.2 CPU-seconds a stream on a 2-core machine, so 300 a round would not fit the fast suite.) The
race behind the issue's leak (a prompt list closed while its pumps wait for room in Fanout's queue)
needs the router's loop to fall a decode step behind, which a storm hits only now and then:
tests/router/test_router_lifecycle.py reproduces it deterministically.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest

from kvbridge.common import rpc
from kvbridge.v1 import admin_pb2, common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.test_load import (
    IDLE,
    LOADED_NODE_FLAGS,
    NODE_FLAGS,
    WORDS,
    Process,
    admin,
    process_tree,
    read_status,
    stop_all,
    wait_idle,
)

ROUNDS = 3
CONCURRENCY = 200  # streams open at once, at most
MAX_TOKENS = 3  # of every choice
KINDS = ("chat", "chat_n4", "prompt_list", "grpc")
SETTLE_S = 60  # how long the fleet may take to settle after a round (counts, fds, threads)
# Threads a process may gain under load and keep: pools that start empty and grow on demand to a
# fixed size, never shrinking (the router's asyncio default executor, min(32, cpus + 4): measured +4
# on 2 cores; a decode rank's threaded KV-plane gRPC server: +1). A leak per stream would be hundreds.
POOL_THREADS = min(32, (os.cpu_count() or 1) + 4)
STREAM_S = 300  # a client's own timeout for any read (a hang is a failure, not a wait)


@dataclass(frozen=True)
class Stream:
    kind: str  # one of KINDS
    prompts: tuple[str, ...]  # one, or a prompt list's 2 to 4
    n: int  # choices per prompt
    stop_after: int  # events (responses) read before leaving; -1: leave right after sending
    reset: bool  # leave with a TCP reset (SO_LINGER 0) instead of a FIN


def make_streams(count: int, seed: int) -> list[Stream]:
    rng = random.Random(seed)

    def prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))

    streams = []
    for _ in range(count):
        kind = rng.choice(KINDS)
        prompts = tuple(prompt() for _ in range(rng.randint(2, 4) if kind == "prompt_list" else 1))
        n = 4 if kind == "chat_n4" or (kind != "chat" and rng.random() < 0.3) else 1
        events = len(prompts) * n * MAX_TOKENS + 2  # (about: a token an event, the usage, [DONE])
        stop_after = -1 if rng.random() < 0.1 else events + 1 if rng.random() < 0.1 else rng.randint(0, events)
        streams.append(Stream(kind, prompts, n, stop_after, rng.random() < 0.5))
    return streams


# ---------------------------------------------------------------- clients


def http_body(s: Stream) -> tuple[str, bytes]:
    common = {"model": "tiny-random", "stream": True, "max_tokens": MAX_TOKENS, "n": s.n, "temperature": 0.8,
              "seed": 1, "ignore_eos": True}  # fmt: skip
    if s.kind == "prompt_list":
        return "/v1/completions", json.dumps({**common, "prompt": list(s.prompts)}).encode()
    return "/v1/chat/completions", json.dumps(
        {**common, "messages": [{"role": "user", "content": s.prompts[0]}]}
    ).encode()


async def http_stream(port: int, s: Stream) -> str:
    """Send the request, read s.stop_after events, leave; what happened ("done": it read [DONE])."""
    path, body = http_body(s)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        if s.stop_after < 0:
            return "left_at_once"
        status = (await reader.readuntil(b"\r\n\r\n")).split(b" ", 2)[1]
        if status != b"200":
            return f"http_{status.decode()}"
        events = 0
        while events < s.stop_after:
            line = await reader.readline()
            if not line:
                return "closed_by_router"
            if line.startswith(b"data: "):
                events += 1
                if line.startswith(b"data: [DONE]"):
                    return "done"
        return "left"
    finally:
        if s.reset:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()


async def grpc_stream(stub: generation_pb2_grpc.GenerationStub, s: Stream) -> str:
    req = generation_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(text=s.prompts[0]),
        sampling=common_pb2.SamplingParams(max_new_tokens=MAX_TOKENS, n=s.n, temperature=0.8, seed=1, ignore_eos=True),
    )
    call = stub.Generate(req, timeout=STREAM_S)
    try:
        if s.stop_after < 0:
            return "left_at_once"
        got = 0
        async for _ in call:
            got += 1
            if got >= s.stop_after:
                return "left"
        return "done"
    except grpc.aio.AioRpcError as e:
        return f"grpc_{e.code().name}"
    finally:
        call.cancel()  # (a no-op once the call ended)


async def storm(router: Process, channel: grpc.aio.Channel, streams: list[Stream]) -> Counter:
    """Every stream at once (CONCURRENCY open at most); how many ended each way."""
    limit = asyncio.Semaphore(CONCURRENCY)
    stub = generation_pb2_grpc.GenerationStub(channel)

    async def one(s: Stream) -> str:
        async with limit:
            await asyncio.sleep(random.random() * 0.05)  # (not all in the same instant)
            run = grpc_stream(stub, s) if s.kind == "grpc" else http_stream(router.http_port, s)
            return await asyncio.wait_for(run, STREAM_S)

    return Counter(await asyncio.gather(*(one(s) for s in streams)))


class Clients:
    """The clients' event loop and gRPC channel, one for every round, made before the fleet's
    resources are first counted: a channel stays connected to the router (a grpc.aio channel
    closed after cancelled streams was seen to keep its connection, which is the client's, not a
    leak of the router's), and a closed loop would raise on grpc.aio's late events."""

    def __init__(self, router: Process):
        self.router = router
        self.loop = rpc.EventLoop("storm-clients")
        self.channel = self.loop.run(self._connect())

    async def _connect(self) -> grpc.aio.Channel:
        return rpc.make_aio_channel(self.router.address)

    def run(self, streams: list[Stream]) -> Counter:
        return self.loop.run(storm(self.router, self.channel, streams))

    def close(self) -> None:
        self.loop.run(self.channel.close())
        self.loop.stop()


# ---------------------------------------------------------------- the fleet


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class StormFleet:
    prefill: Process
    decode: Process
    router: Process

    def tree(self) -> dict[str, int]:
        return process_tree({"router": self.router.proc.pid, "prefill": self.prefill.proc.pid,
                             "decode": self.decode.proc.pid})  # fmt: skip

    def resources(self) -> dict[str, dict[str, int]]:
        """label -> its open fds and threads, for every process of the fleet."""
        return {label: {"fds": fds(pid), "threads": read_status(pid)["Threads"]} for label, pid in self.tree().items()}

    def router_state(self) -> dict:
        status = admin(self.router.address).GetStatus(admin_pb2.GetStatusRequest(), timeout=30)
        return {"in_flight": status.requests_in_flight, "queues": {k: v for k, v in status.queues.items() if v}}


@pytest.fixture(scope="module")
def fleet():
    started: list[Process] = []
    try:
        prefill = Process("prefill", "prefill", *NODE_FLAGS, *LOADED_NODE_FLAGS)
        decode = Process("decode", "decode", *NODE_FLAGS, *LOADED_NODE_FLAGS)
        started += [prefill, decode]
        prefill.wait_ready()
        decode.wait_ready()
        router = Process("router", "router", "--prefill", prefill.address, "--decode", decode.address,
                         "--port", "0", "--http-port", "0", "--log-level", "warning")  # fmt: skip
        started.append(router)
        router.wait_ready()
        yield StormFleet(prefill, decode, router)
    finally:
        stop_all(started)
    unclean = [p for p in started if p.proc.returncode != 0 or any("Traceback" in line for line in p.lines)]
    assert not unclean, "\n".join(f"{p.name}: rc {p.proc.returncode}\n{''.join(p.lines[-40:])}" for p in unclean)


IDLE_ROUTER = {"in_flight": 0, "queues": {}}


def back(now: dict, start: dict) -> bool:
    """Every process of `start` still there, with its fds and its threads but for grown pools."""
    return now.keys() == start.keys() and all(
        now[p]["fds"] == start[p]["fds"]
        and start[p]["threads"] <= now[p]["threads"] <= start[p]["threads"] + POOL_THREADS
        for p in start
    )


def settle(fleet: StormFleet, start: dict | None = None) -> tuple[dict, dict]:
    """The router's state and the fleet's resources once the router is idle and the resources are
    back at `start` (if given), or at SETTLE_S: then the test fails on the difference."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        state, now = fleet.router_state(), fleet.resources()
        if (state == IDLE_ROUTER and (start is None or back(now, start))) or time.monotonic() > deadline:
            return state, now
        time.sleep(0.2)


def steady(fleet: StormFleet) -> dict:
    """The fleet's resources once the same for a second (the warm-up's connections closed)."""
    before, deadline = fleet.resources(), time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = fleet.resources()
        if now == before:
            break
        before = now
    return before


@pytest.fixture(scope="module")
def clients(fleet):
    made = Clients(fleet.router)
    yield made
    made.close()


@pytest.mark.parametrize(
    "count", [pytest.param(100, marks=pytest.mark.long), pytest.param(1000, marks=pytest.mark.slow)]
)
def test_a_storm_of_cancelled_streams_leaves_nothing_in_flight_and_every_process_as_it_started(
    fleet, clients, count, tmp_path
):
    kinds = [("chat", ("kv page",), 1), ("chat_n4", ("kv page",), 4), ("prompt_list", ("kv", "page ring"), 1),
             ("grpc", ("kv page",), 1), ("grpc", ("kv page",), 4)]  # fmt: skip
    warm_up = [Stream(kind, prompts, n, stop_after=10**6, reset=False) for kind, prompts, n in kinds]  # read to the end
    assert clients.run(warm_up) == Counter({"done": 5})
    # (every Admin channel this test uses is opened now, and kept: its connection counted from the start)
    assert settle(fleet)[0] == IDLE_ROUTER
    for node in (fleet.prefill, fleet.decode):
        assert wait_idle(node.address) == {**IDLE, "pages_used": [0]}, node.name
    start = steady(fleet)
    figures = {"streams": count, "start": start, "rounds": []}
    for round_ in range(ROUNDS):
        began = time.monotonic()
        outcomes = clients.run(make_streams(count, seed=1000 * count + round_))
        sent = time.monotonic() - began
        state, now = settle(fleet, start)
        settled = time.monotonic() - began - sent
        figures["rounds"].append({"seconds": round(sent, 1), "settled_s": round(settled, 1),
                                  "outcomes": dict(outcomes), "end": now})  # fmt: skip
        print(f"\nround {round_}: {json.dumps(figures['rounds'][-1])}")
        assert sum(outcomes.values()) == count
        # every stream was served until its client left (no refusal, no failure)
        assert set(outcomes) <= {"left_at_once", "left", "done"}, outcomes
        assert state == IDLE_ROUTER
        drained = admin(fleet.router.address).Drain(admin_pb2.DrainRequest(wait_s=5), timeout=30)
        assert (drained.empty, drained.requests_in_flight) == (True, 0)
        admin(fleet.router.address).Resume(admin_pb2.ResumeRequest(), timeout=30)
        for node in (fleet.prefill, fleet.decode):
            assert wait_idle(node.address) == {**IDLE, "pages_used": [0]}, node.name
        assert [p.name for p in (fleet.router, fleet.prefill, fleet.decode) if p.proc.poll() is not None] == []
        assert back(now, start), {
            p: (start.get(p), now.get(p)) for p in start.keys() | now.keys() if start.get(p) != now.get(p)
        }
    (tmp_path / f"storm_{count}.json").write_text(json.dumps(figures))
