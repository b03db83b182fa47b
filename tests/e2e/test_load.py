"""Load as part of correctness: the real fleet driven as users' load generators drive it.

The router, a prefill node and a decode node are each an OS process started with the `kvbridge`
CLI; the client is httpx's AsyncClient in this process, one connection per stream, on the
router's OpenAI endpoint (streamed chat, greedy, ignore_eos). What is shown, each exactly:

- hundreds (2,000 with -m slow) of concurrent streams all end with [DONE], their finish_reason
  and the text a colocated node gives the same request, while no process of the fleet (router,
  node fronts, their rank processes) grows past 100 threads or a fixed memory bound;
- 160 concurrent streams mixing n=4 seeded choices, logprobs, json_object and the penalties give
  what the colocated node gives each (every choice's text, finish_reason and logprobs);
- beyond a decode node's --max-pending-requests, every request succeeds or gets 429 in the
  OpenAI format, none times out, and the nodes end idle and keep serving;
- 500 clients trickling their headers do not stop a stream on another connection (and the
  router's header timeout closes such clients without an answer); a body over the limit gets 413;
  a client that leaves mid-stream aborts its request on both nodes.

A module fixture starts the processes (ports 0 on 127.0.0.1, read back from their ready lines)
and stops them at the end: SIGTERM, then SIGKILL of each one's session.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.common import rpc
from kvbridge.router.config import RouterConfig
from kvbridge.v1 import admin_pb2, admin_pb2_grpc

KVBRIDGE = str(Path(sys.executable).with_name("kvbridge"))  # the console script users run
MAX_TOKENS = 4
MAX_THREADS = 100  # per process of the fleet, whatever the number of streams
MAX_HWM_KIB = 3 << 19  # 1.5 GiB: the peak resident memory of any process of the fleet
NODE_FLAGS = ("--model", "tiny-random", "--port", "0", "--page-size", "4", "--chunked-prefill-size", "16",
              "--quiet", "--log-level", "warning")  # fmt: skip
SLOW_DECODE_PENDING = 8  # the slow decode node's --max-pending-requests
# The fleet runs with the default timeouts: on the loaded pair every stream is admitted at once (its
# pools and --max-pending-requests hold 2,000 prompts of <= 40 tokens) and then waits its turn at the
# one prefill node, on two shared cores, so the node hand-off timeouts and the router's first-token
# timeout (300 s each) must bound hangs, not this queueing. The client's own timeouts below only turn
# a hang into a failure.
START_TIMEOUT_S = 300
STREAM_TIMEOUT_S = 1200  # each HTTP read or connect of the client (a stream's first bytes come with its first token)
RUN_TIMEOUT_S = 1500  # a whole burst of requests
IDLE_TIMEOUT_S = 60  # the nodes' cleanup after a burst
LOADED_NODE_FLAGS = ("--kv-cache-tokens", "131072", "--max-pending-requests", "4096")
# (the loaded router holds clients trickling their headers for 300 s: see the trickling test)
LOADED_ROUTER_FLAGS = ("--http-header-timeout-s", "300")
WORDS = ("kv", "page", "prefill", "decode", "router", "token", "stream", "load", "ring", "rank")


# ---------------------------------------------------------------- processes


class Process:
    """One `kvbridge ROLE ...` child in a session of its own; its stderr is drained by a thread,
    and its ready line gives the addresses it bound."""

    def __init__(self, name: str, role: str, *flags: str):
        self.name, self.role = name, role
        ready = r"grpc on (\S+), http on ([^,\s]+)" if role == "router" else r"listening on ([^,\s]+)"
        ready += r"(?:, metrics on ([^;\s]+))?"
        self._ready_re = re.compile(rf"^kvbridge {role}: {ready}")
        self.proc = subprocess.Popen(
            [KVBRIDGE, role, *flags], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.addresses: tuple[str, ...] = ()
        self.lines: list[str] = []  # its stderr, every line
        self._ready = threading.Event()
        threading.Thread(target=self._drain, name=f"stderr-{name}", daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if not self._ready.is_set() and (m := self._ready_re.match(line)):
                self.addresses = tuple(a for a in m.groups() if a)
                self._ready.set()
        self._ready.set()  # EOF: it exited

    def wait_ready(self) -> None:
        ready = self._ready.wait(START_TIMEOUT_S) and self.addresses
        assert ready, f"{self.name} not ready within {START_TIMEOUT_S} s:\n{''.join(self.lines[-40:])}"

    @property
    def address(self) -> str:
        return self.addresses[0]

    @property
    def http_port(self) -> int:
        return int(self.addresses[1].rpartition(":")[2])

    @property
    def metrics_url(self) -> str:
        return f"http://{self.addresses[-1]}/metrics"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # its rank processes, if any outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass
class Fleet:
    prefill: Process  # one prefill node behind both disaggregated routers
    decode: Process  # sized for every stream at once
    slow_decode: Process  # SLOW_DECODE_PENDING requests at most, each step 50 ms late
    colocated: Process  # the reference
    router: Process  # prefill + decode, the loaded pair
    slow_router: Process  # prefill + slow_decode, default router settings
    reference_router: Process  # colocated
    references: dict = field(default_factory=dict)  # request body (JSON) -> the colocated answer

    def reference(self, bodies: list[dict]) -> list[Answer]:
        """The colocated node's answer to each body, non-streamed (computed once per body)."""
        keys = [json.dumps(b, sort_keys=True) for b in bodies]
        todo = list(dict.fromkeys(k for k in keys if k not in self.references))
        if todo:
            plain = [{**json.loads(k), "stream": False} for k in todo]
            answers = asyncio.run(post_all(self.reference_router.http_port, plain, concurrency=256))
            for key, answer in zip(todo, answers):
                assert answer.status == 200 and answer.finish_reason == "length", answer
                self.references[key] = answer
        return [self.references[k] for k in keys]


def start_fleet() -> tuple[Fleet, list[Process]]:
    started: list[Process] = []

    def start(name: str, role: str, *flags: str) -> Process:
        started.append(Process(name, role, *flags))
        return started[-1]

    try:
        nodes = {
            "prefill": start("prefill", "prefill", *NODE_FLAGS, *LOADED_NODE_FLAGS),
            "decode": start("decode", "decode", *NODE_FLAGS, *LOADED_NODE_FLAGS),
            "slow_decode": start("slow_decode", "decode", *NODE_FLAGS, "--max-pending-requests",
                                 str(SLOW_DECODE_PENDING), "--fault-inject", "step_delay_ms=50", "--metrics-port", "0"),
            "colocated": start("colocated", "serve", *NODE_FLAGS, *LOADED_NODE_FLAGS),
        }  # fmt: skip
        for node in nodes.values():
            node.wait_ready()
        p, d, slow, c = (nodes[n].address for n in ("prefill", "decode", "slow_decode", "colocated"))
        common = ("--port", "0", "--http-port", "0", "--metrics-port", "0", "--log-level", "warning")
        routers = {
            "router": start("router", "router", "--prefill", p, "--decode", d, *common, *LOADED_ROUTER_FLAGS),
            "slow_router": start("slow_router", "router", "--prefill", p, "--decode", slow, *common),
            "reference_router": start("reference_router", "router", "--colocated", c, *common, *LOADED_ROUTER_FLAGS),
        }
        for r in routers.values():
            r.wait_ready()
    except BaseException:
        stop_all(started)
        raise
    return Fleet(**nodes, **routers), started


def stop_all(processes: list[Process]) -> None:
    for p in sorted(processes, key=lambda p: p.role != "router"):  # routers first
        p.stop()


@pytest.fixture(scope="module")
def fleet():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"the file-descriptor hard limit is {hard}: thousands of sockets need 8192 or more")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fleet, started = start_fleet()
    try:
        yield fleet
    finally:
        stop_all(started)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # every process stopped cleanly on SIGTERM and logged no traceback on the way
    unclean = [p for p in started if p.proc.returncode != 0 or any("Traceback" in line for line in p.lines)]
    assert not unclean, "\n".join(f"{p.name}: rc {p.proc.returncode}\n{''.join(p.lines[-40:])}" for p in unclean)


# ---------------------------------------------------------------- measuring processes


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def process_tree(named: dict[str, int]) -> dict[str, int]:
    """label -> pid: each named process and every descendant ("decode/rank", "decode/resource_tracker")."""
    out: dict[str, int] = {}

    def walk(label: str, pid: int) -> None:
        out[label] = pid
        for kid in sorted(children(pid)):
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
                kind = "rank" if b"spawn_main" in cmd else "resource_tracker" if b"resource_tracker" in cmd else "child"
                name, n = f"{label}/{kind}", 1
                while name in out:
                    n += 1
                    name = f"{label}/{kind}{n}"
                walk(name, kid)

    for label, pid in named.items():
        walk(label, pid)
    return out


def read_status(pid: int) -> dict[str, int]:
    """Threads, VmRSS and VmHWM (KiB) from /proc/PID/status."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Threads", "VmRSS", "VmHWM"):
            values[key] = int(value.split()[0])
    return values


class Sampler:
    """Threads and memory of every process of a fleet, sampled before, during and after a run."""

    def __init__(self, named: dict[str, int]):
        self.tree = process_tree(named)
        self.samples: dict[str, list[dict[str, int]]] = {"before": [], "during": [], "after": []}

    def take(self, phase: str) -> None:
        self.samples[phase].append({label: read_status(pid) for label, pid in self.tree.items()})

    async def run(self, period_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.take("during")

    def figures(self) -> dict:
        """label -> pid, and threads, VmRSS and VmHWM (MiB) as [before, the most during, after]."""
        out = {}
        for label, pid in self.tree.items():
            row: dict = {"pid": pid}
            for key, name, scale in (("Threads", "threads", 1), ("VmRSS", "rss_mib", 1024), ("VmHWM", "hwm_mib", 1024)):
                peaks = [max(s[label][key] for s in self.samples[p]) for p in self.samples]
                row[name] = peaks if scale == 1 else [round(v / scale, 1) for v in peaks]
            out[label] = row
        return out


# ---------------------------------------------------------------- the client


@dataclass
class Answer:
    status: int | str  # HTTP status, or "timeout" / an exception's name
    text: str = ""  # the content deltas joined (or the message's content)
    finish_reason: str | None = None
    done: bool = False  # the stream ended with data: [DONE]
    usage: dict | None = None
    errors: list = field(default_factory=list)  # error events inside a stream
    body: dict | None = None  # the JSON body of a non-200 answer


def counts(usage: dict) -> dict:
    """Token counts only: what a node found cached depends on what it served before (test_cache_routing.py)."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def make_chats(n: int, seed: int, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """n streamed greedy chat requests with prompts drawn from `seed` (<= 40 tokens with the template)."""
    rng = random.Random(seed)
    return [
        {
            "model": "tiny-random",
            "messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        for _ in range(n)
    ]


def client(n: int) -> httpx.AsyncClient:
    """A connection per request, none kept: a connection httpx's pool left idle for the router's
    --http-keep-alive-s (5 s) can be closed by the router just as a request goes out on it (the
    HTTP/1.1 keep-alive race; httpx does not retry a POST), which is no failure of the fleet."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(STREAM_TIMEOUT_S))


async def post(http: httpx.AsyncClient, port: int, body: dict, on_first=None) -> Answer:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200 or not body.get("stream"):
                raw = json.loads(await r.aread())
                if r.status_code != 200:
                    return Answer(r.status_code, body=raw)
                [choice] = raw["choices"]
                return Answer(200, choice["message"]["content"], choice["finish_reason"], usage=counts(raw["usage"]))
            answer = Answer(200)
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert not answer.done, f"an event after [DONE]: {line!r}"
                if line == "data: [DONE]":
                    answer.done = True
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    answer.errors.append(event)
                    continue
                if event.get("usage"):
                    answer.usage = counts(event["usage"])
                for choice in event["choices"]:
                    if choice["delta"].get("content") and on_first is not None and not answer.text:
                        on_first()
                    answer.text += choice["delta"].get("content", "")
                    answer.finish_reason = choice["finish_reason"] or answer.finish_reason
            return answer
    except httpx.TimeoutException:
        return Answer("timeout")
    except httpx.HTTPError as e:
        return Answer(type(e).__name__)


async def post_all(port: int, bodies: list[dict], concurrency: int | None = None, sampler: Sampler | None = None):
    """Every body at once (at most `concurrency` at a time), each on a connection of its own; the
    sampler reads the fleet every half second and as the first tokens reach a quarter, half and
    three quarters of the streams."""
    n = len(bodies)
    limit = asyncio.Semaphore(concurrency or n)
    firsts = 0

    def first() -> None:
        nonlocal firsts
        firsts += 1
        if sampler is not None and firsts in (n // 4, n // 2, 3 * n // 4):
            sampler.take("during")

    async def one(http, body):
        async with limit:
            return await post(http, port, body, first)

    async with client(concurrency or n) as http:
        ticking = asyncio.ensure_future(sampler.run()) if sampler is not None else None
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(http, b) for b in bodies)), RUN_TIMEOUT_S)
        finally:
            if ticking is not None:
                ticking.cancel()


def expected(reference: Answer) -> Answer:
    """What a stream of the request must give: the colocated text, its finish reason and usage."""
    return Answer(200, reference.text, reference.finish_reason, True, reference.usage)


def assert_all_match(got: list[Answer], want: list[Answer]) -> None:
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert len(got) == len(want) and not bad, (
        f"{len(bad)} of {len(want)} answers differ; by status: {Counter(got[i].status for i in bad)}; "
        f"first: #{bad[0]} got {got[bad[0]]}, want {want[bad[0]]}"
    )


# ---------------------------------------------------------------- nodes and routers


@functools.cache
def admin(addr: str) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(rpc.make_channel(addr))


def node_state(addr: str) -> dict:
    st = admin(addr).GetStatus(admin_pb2.GetStatusRequest(), timeout=30)
    listed = admin(addr).ListRequests(admin_pb2.ListRequestsRequest(), timeout=30)
    return {
        "pages_used": [r.kv_pages_used for r in st.ranks],
        "queues": {q: n for q, n in st.queues.items() if n},
        "requests_in_flight": st.requests_in_flight,
        "listed": [(r.rid, r.phase) for r in listed.requests],
        "transfers_in_flight": st.transfers_in_flight,
    }


IDLE = {"queues": {}, "requests_in_flight": 0, "listed": [], "transfers_in_flight": 0}


def wait_idle(addr: str, ranks: int = 1) -> dict:
    """The node's state once idle (or at the timeout): nothing listed, queued, in flight or paged."""
    want = {**IDLE, "pages_used": [0] * ranks}
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while (state := node_state(addr)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return state


def router_requests(addr: str) -> int:
    return admin(addr).GetStatus(admin_pb2.GetStatusRequest(), timeout=30).requests_in_flight


def metric(url: str, name: str, labels: dict[str, str]) -> float:
    text = httpx.get(url, timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


# ---------------------------------------------------------------- 1. concurrent streams


@pytest.mark.parametrize("n", [300, pytest.param(2000, marks=pytest.mark.slow)])
def test_concurrent_streams_give_the_colocated_text_in_bounded_threads_and_memory(fleet, n, tmp_path):
    bodies = make_chats(n, seed=n)
    want = [expected(r) for r in fleet.reference(bodies)]
    sampler = Sampler({"router": fleet.router.proc.pid, "prefill": fleet.prefill.proc.pid,
                       "decode": fleet.decode.proc.pid})  # fmt: skip
    sampler.take("before")
    started = time.monotonic()
    got = asyncio.run(post_all(fleet.router.http_port, bodies, sampler=sampler))
    seconds = round(time.monotonic() - started, 1)
    sampler.take("after")
    figures = {
        "streams": n,
        "max_tokens": MAX_TOKENS,
        "seconds": seconds,
        "samples_during": len(sampler.samples["during"]),
    }
    figures["processes"] = sampler.figures()
    path = tmp_path / f"load_{n}.json"
    path.write_text(json.dumps(figures))
    print(f"\n{path}:\n" + json.dumps({k: v for k, v in figures.items() if k != "processes"}))
    for label, row in figures["processes"].items():
        print(f"  {label}: {json.dumps(row)}")

    assert_all_match(got, want)
    assert figures["samples_during"] >= 3
    processes = figures["processes"]
    assert set(processes) >= {"router", "prefill", "prefill/rank", "decode", "decode/rank"}
    threads = {label: max(row["threads"]) for label, row in processes.items()}
    assert max(threads.values()) <= MAX_THREADS, threads
    hwm = {label: max(row["hwm_mib"]) for label, row in processes.items()}
    assert max(hwm.values()) < MAX_HWM_KIB / 1024, hwm
    for node in (fleet.prefill, fleet.decode):
        assert wait_idle(node.address) == {**IDLE, "pages_used": [0]}, node.name


# ---------------------------------------------------------------- 2. admission


def test_beyond_max_pending_requests_each_request_succeeds_or_gets_429(fleet):
    bodies = make_chats(8 * SLOW_DECODE_PENDING, seed=2)
    want = [expected(r) for r in fleet.reference(bodies)]
    got = asyncio.run(post_all(fleet.slow_router.http_port, bodies))

    statuses = Counter(a.status for a in got)
    print(f"\n{len(bodies)} requests at once, --max-pending-requests {SLOW_DECODE_PENDING}: statuses {dict(statuses)}")
    assert set(statuses) <= {200, 429}, statuses  # no timeout, no 504, no other failure
    assert statuses[429] >= 1 and statuses[200] >= 1, statuses
    for g, w in zip(got, want):
        if g.status == 200:
            assert g == w
        else:
            error = g.body["error"]
            assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "resource_exhausted", None)
            assert isinstance(error["message"], str) and error["message"], g.body
    for node in (fleet.prefill, fleet.slow_decode):
        assert wait_idle(node.address) == {**IDLE, "pages_used": [0]}, node.name
    [one] = make_chats(1, seed=3)
    assert asyncio.run(post_all(fleet.slow_router.http_port, [one])) == [expected(r) for r in fleet.reference([one])]


def mixed_bodies(count: int, seed: int) -> list[dict]:
    """Streamed chats using what lies beyond the greedy core, mixed: n=4 seeded choices, logprobs
    with top_logprobs, json_object, the penalties (seeded)."""
    variants = [
        lambda k: {"n": 4, "seed": k, "temperature": 1.0, "ignore_eos": True},
        lambda k: {"logprobs": True, "top_logprobs": 3, "temperature": 0, "ignore_eos": True},
        lambda k: {"response_format": {"type": "json_object"}, "temperature": 0.8, "seed": k},
        lambda k: {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "temperature": 0.7,
                   "seed": k, "ignore_eos": True},
    ]  # fmt: skip
    bodies = make_chats(count, seed)
    for k, body in enumerate(bodies):
        del body["ignore_eos"]
        body |= variants[k % len(variants)](k) | {"max_tokens": 6}
    return bodies


async def post_choices(http: httpx.AsyncClient, port: int, body: dict) -> tuple:
    """(status, [(text, finish_reason, [(token, logprob)...]) per choice]) of one chat, streamed or not."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    choices: dict[int, list] = {}
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())
            if not body.get("stream"):
                for c in json.loads(await r.aread())["choices"]:
                    lps = [(t["token"], t["logprob"]) for t in (c["logprobs"] or {}).get("content") or []]
                    choices[c["index"]] = [c["message"]["content"], c["finish_reason"], lps]
                return 200, [tuple(choices[i]) for i in sorted(choices)]
            async for line in r.aiter_lines():
                if not line or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return "error", event
                for c in event["choices"]:
                    mine = choices.setdefault(c["index"], ["", None, []])
                    mine[0] += c["delta"].get("content", "")
                    mine[1] = c["finish_reason"] or mine[1]
                    mine[2] += [(t["token"], t["logprob"]) for t in (c["logprobs"] or {}).get("content") or []]
    except httpx.HTTPError as e:
        return type(e).__name__, None
    return 200, [tuple(choices[i]) for i in sorted(choices)]


def test_a_mix_of_choices_logprobs_json_and_penalties_under_load_equals_colocated(fleet):
    bodies = mixed_bodies(160, seed=5)

    async def run(port: int, bodies: list[dict]) -> list:
        async with client(len(bodies)) as http:
            return await asyncio.wait_for(asyncio.gather(*(post_choices(http, port, b) for b in bodies)), RUN_TIMEOUT_S)

    want = asyncio.run(run(fleet.reference_router.http_port, [{**b, "stream": False} for b in bodies]))
    got = asyncio.run(run(fleet.router.http_port, bodies))
    assert all(w[0] == 200 for w in want), [w for w in want if w[0] != 200][:1]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == 200, (i, g)
        assert len(g[1]) == (4 if "n" in bodies[i] else 1), (i, g)
        for (text, finish, lps), (w_text, w_finish, w_lps) in zip(g[1], w[1]):
            assert (text, finish, [t for t, _ in lps]) == (w_text, w_finish, [t for t, _ in w_lps]), (i, bodies[i])
            assert [lp for _, lp in lps] == pytest.approx([lp for _, lp in w_lps], abs=1e-4)
    assert sum(len({c[0] for c in g[1]}) == 4 for g, b in zip(got, bodies) if "n" in b) >= 30  # choices differ
    for node in (fleet.prefill, fleet.decode):
        assert wait_idle(node.address) == {**IDLE, "pages_used": [0]}, node.name


# ---------------------------------------------------------------- 3. slow, large and vanishing clients


async def trickle_while(port: int, slow_port: int, body: dict) -> tuple[Answer, list, list]:
    """500 clients on `port` and 20 on `slow_port` send a header line a second, never ending their
    headers; meanwhile `body` is streamed on another connection to `port`. Returns the answer, what
    each of the 500 had received once it came (None: still open, nothing received), and what each
    of the 20 received before the router closed it (b"": closed without an answer)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    conns = [await asyncio.open_connection("127.0.0.1", p) for p in [port] * 500 + [slow_port] * 20]
    heard = [asyncio.ensure_future(reader.read(1)) for reader, _ in conns]
    lines = 0

    async def trickle() -> None:
        nonlocal lines
        for _, writer in conns:
            writer.write(head)
        while True:
            await asyncio.sleep(1)
            for i, (_, writer) in enumerate(conns):
                if not heard[i].done():
                    writer.write(f"X-Trickle-{lines}: {i}\r\n".encode())
            lines += 1

    trickling = asyncio.ensure_future(trickle())
    try:
        while lines < 2:  # every client is trickling
            await asyncio.sleep(0.1)
        async with client(1) as http:
            answer = await post(http, port, body)
        held = [h.result() if h.done() else None for h in heard[:500]]
        closed = await asyncio.wait_for(asyncio.gather(*heard[500:], return_exceptions=True), 120)
        closed = [b"" if isinstance(c, ConnectionResetError) else c for c in closed]
        return answer, held, closed
    finally:
        trickling.cancel()
        for h in heard:
            h.cancel()
        for _, writer in conns:
            writer.close()


@pytest.mark.long
def test_five_hundred_trickling_clients_do_not_stop_a_stream(fleet):
    [body] = make_chats(1, seed=4)
    answer, held, closed = asyncio.run(trickle_while(fleet.router.http_port, fleet.slow_router.http_port, body))
    assert answer == expected(fleet.reference([body])[0])
    assert held == [None] * 500  # held open by the router (its header timeout is 300 s), nothing sent
    assert closed == [b""] * 20  # the default header timeout (10 s) closed each, without an answer


def test_a_body_declared_over_the_limit_gets_413(fleet):
    limit = RouterConfig().max_body_bytes  # the router runs with the default
    with socket.create_connection(("127.0.0.1", fleet.router.http_port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {limit + 1}\r\n\r\n".encode()
        )
        data = b""
        while chunk := sock.recv(65536):  # the router answers and closes, the body unread
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 413 Request Entity Too Large"
    assert b"Connection: close" in head.split(b"\r\n")
    error = {"message": f"body over {limit} bytes", "type": "invalid_request_error", "param": None}
    assert json.loads(body) == {"error": {**error, "code": "invalid_argument"}}


def test_a_client_that_leaves_mid_stream_aborts_its_request_on_both_nodes(fleet):
    router, decode = fleet.slow_router, fleet.slow_decode
    aborted = {"outcome": "abort"}
    before = (metric(router.metrics_url, "kvbridge_router_requests_total", aborted),
              metric(decode.metrics_url, "kvbridge_aborts_total", {"source": "client"}))  # fmt: skip
    [body] = make_chats(1, seed=5, max_tokens=1000)  # 1,000 steps of >= 50 ms: running when the client leaves
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", router.http_port), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        data = b""
        while b'"content": "' not in data.partition(b"\r\n\r\n")[2]:  # the first event with text
            chunk = sock.recv(65536)
            assert chunk, f"closed before the first token: {data!r}"
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 OK\r\n"), data
        running = node_state(decode.address)
        assert [phase for _, phase in running["listed"]] == ["decoding"], running
    # the socket is closed: the router cancels upstream, both nodes drop the request
    for node in (fleet.prefill, decode):
        assert wait_idle(node.address) == {**IDLE, "pages_used": [0]}, node.name
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while router_requests(router.address) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert router_requests(router.address) == 0
    after = (metric(router.metrics_url, "kvbridge_router_requests_total", aborted),
             metric(decode.metrics_url, "kvbridge_aborts_total", {"source": "client"}))  # fmt: skip
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
