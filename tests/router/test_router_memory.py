"""The router's memory under a flood of requests at the body limit: `kvbridge router` as a process
(its resident memory read from /proc) in front of an in-test node that hands out its tokenizer (so
cache_aware routing would tokenize what it is sent). Eight prompts at once, each a body of almost 4
MiB (one text, or many empty chat messages), are refused by their size before anything expands
them: the router's peak resident memory grows by under 100 MB, and its /health answers 200 all along.
How fast it answers is a wall-clock figure: kvbridge/bench/router_memory.py measures it."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.router.config import RouterConfig
from tests.router.fakes import FakeNode, Rooms, wait_until

HARD_TIMEOUT_S = 300
FLOOD = 8  # requests at once
MAX_GROWTH = 100 << 20  # bytes of resident memory the flood may add at its peak
BODY_LIMIT = RouterConfig.max_body_bytes  # the router runs with the default


def memory(pid: int, field: str) -> int:
    """A VmRSS / VmHWM line of the process's status, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak(pid: int) -> None:
    """Start VmHWM over from the present VmRSS (Linux >= 4.0, the process's owner)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def body_at_limit(kind: str) -> tuple[str, bytes]:
    """(path, body) of just under BODY_LIMIT bytes: one text, or empty chat messages."""
    if kind == "text":
        frame = len(json.dumps({"prompt": "", "max_tokens": 2}))
        return "/v1/completions", json.dumps({"prompt": "x" * (BODY_LIMIT - frame - 16), "max_tokens": 2}).encode()
    message = {"role": "user", "content": ""}
    count = (BODY_LIMIT - 64) // (len(json.dumps(message)) + 2)
    return "/v1/chat/completions", json.dumps({"messages": [message] * count, "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def router(hard_timeout):
    """(the router's process, its HTTP port, the node): warmed up, its tokenizer fetched."""
    node = FakeNode("colocated", Rooms(), kv_events=True)
    flags = ["--colocated", node.address, "--port", "0", "--http-port", "0", "--health-retry-s", "0.1"]
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "router", *flags], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith("kvbridge router: grpc on "), line
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # (its log lines, unread)
        port = int(line.strip().split(", ")[1].rsplit(":", 1)[1])
        assert wait_until(lambda: health(port) == 200)
        small = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
        assert wait_until(lambda: post(port, "/v1/completions", small)[0] == 200 and node.tokenizer_calls == 1)
        yield proc, port, node
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        node.stop()


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_eight_prompts_at_the_body_limit_are_refused_by_size_and_grow_the_router_by_under_100_mb(router, kind):
    proc, port, node = router
    path, body = body_at_limit(kind)
    assert BODY_LIMIT - 100 < len(body) <= BODY_LIMIT
    received = len(node.requests)
    before = memory(proc.pid, "VmRSS")
    reset_peak(proc.pid)
    probes: list[int] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            probes.append(health(port))
            done.wait(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with ThreadPoolExecutor(FLOOD) as pool:
            answers = list(pool.map(lambda _: post(port, path, body), range(FLOOD)))
    finally:
        done.set()
        prober.join()
    peak = memory(proc.pid, "VmHWM")
    print(f"router RSS {before >> 20} MiB before, peak {peak >> 20} MiB (+{(peak - before) >> 20} MiB)")
    assert peak - before < MAX_GROWTH
    if kind == "text":
        size = len(json.loads(body)["prompt"])
        message = f"prompt.text has {size} bytes; a prompt that fits the context of 64 tokens has at most 2048"
        param = "prompt"
    else:
        message = f"messages lists {len(json.loads(body)['messages'])} messages; at most 4096"
        param = "messages"
    want = {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_argument"}
    assert answers == [(400, {"error": want})] * FLOOD
    assert len(node.requests) == received  # nothing was routed
    assert probes and set(probes) == {200}  # /health answered SERVING all along
