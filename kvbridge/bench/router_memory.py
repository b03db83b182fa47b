"""The router's memory and its /health latency while clients send it large requests and ask for large
answers: `kvbridge router` as a child process (its resident memory read from /proc/PID/status) in
front of one colocated node (`kvbridge serve`, a child process too).

    kvbridge bench router_memory [--model tiny-random] [--flood 8] [--answer-prompts 8] [--answer-n 8]
        [--answer-tokens 200] [--logprobs 20] [--max-answer-bytes 1048576] [--big-answer-bytes 268435456]

One JSON line per phase, each with the router's resident memory before it (rss_mb), its peak during
it (peak_mb: VmHWM, restarted at the phase's start through /proc/PID/clear_refs), after it (after_mb,
1 s later), the growth at the peak (growth_mb), the CPU time the router spent (router_cpu_s), and
the slowest /health answer meanwhile (health_max_ms; probes every 20 ms from a process of their own,
so that this one's work does not count; a wall-clock figure: load_avg is the machine's 1-minute load
average at the phase's start):

- text_flood, chat_flood: --flood requests at once, each a body just under the router's body limit
  (4 MiB): one text prompt, or empty chat messages. statuses: what they were answered.
- chat_32000: --flood requests at once of 32,000 empty chat messages each (128,000 bytes).
- answer_stream: one streamed completion of --answer-prompts prompts x --answer-n choices x
  --answer-tokens tokens with --logprobs alternatives a token, through a router whose
  --max-answer-bytes is --big-answer-bytes; answer_mb: the size of its events.
- answer_whole: the same request not streamed (after answer_stream: the memory that the streams
  themselves take is in rss_mb already); answer_mb: its size.
- answer_refused: the same non-streamed request through a router whose --max-answer-bytes is
  --max-answer-bytes (the floods' router): its status and how long until it came; node_idle: the node
  holds no request and no page after.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvbridge.bench.serve_stacks import ROOT, PinnedNode
from kvbridge.router.config import RouterConfig

PROBE_EVERY_S = 0.02
SETTLE_S = 1.0  # after a phase, before after_mb is read
BODY_LIMIT = RouterConfig.max_body_bytes


class RouterProcess:
    """`kvbridge router` over `node` in a child process; .http_port once ready; .stop() ends it."""

    def __init__(self, node: str, flags: list[str]):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        argv = [sys.executable, "-m", "kvbridge", "router", "--colocated", node, "--port", "0", "--http-port", "0"]
        self.proc = subprocess.Popen(
            [*argv, "--log-level", "error", *flags], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.proc.stderr.readline()
        if not line.startswith("kvbridge router: grpc on "):
            raise RuntimeError(f"kvbridge router did not start: {line.strip()}")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        self.http_port = int(line.strip().split(", ")[1].rsplit(":", 1)[1])
        self.pid = self.proc.pid

    def memory_mb(self, field: str = "VmRSS") -> float:
        with open(f"/proc/{self.pid}/status") as f:
            line = next(line for line in f if line.startswith(field + ":"))
        return int(line.split()[1]) / 1024

    def cpu_s(self) -> float:
        """User and system CPU seconds the router has spent (/proc/PID/stat)."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def reset_peak(self) -> None:
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts over from VmRSS

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def post(port: int, path: str, body: bytes, stream: bool = False) -> tuple[int, int, bytes]:
    """(status, bytes of the answer, its first 300 bytes); the answer is counted, never parsed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        size, head = 0, b""
        while chunk := resp.read(1 << 20):
            size += len(chunk)
            head = head or chunk[:300]
        return resp.status, size, head
    finally:
        conn.close()


def _probe(port: int, stop, out) -> None:
    """(a process of its own) GET /health every PROBE_EVERY_S until `stop`; sends [(seconds, status)]."""
    seen = []
    while not stop.is_set():
        started = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        seen.append((time.perf_counter() - started, status))
        stop.wait(PROBE_EVERY_S)
    out.send(seen)


def phase(name: str, router: RouterProcess, work) -> dict:
    """Run work() while probing the router's /health; its memory before, at the peak and after."""
    ctx = multiprocessing.get_context("fork")
    stop, (receive, send) = ctx.Event(), ctx.Pipe(duplex=False)
    prober = ctx.Process(target=_probe, args=(router.http_port, stop, send), daemon=True)
    load, cpu = os.getloadavg()[0], router.cpu_s()
    rss = router.memory_mb()
    router.reset_peak()
    prober.start()
    started = time.perf_counter()
    try:
        result = work()
    finally:
        seconds = time.perf_counter() - started
        stop.set()
        probes = receive.recv()
        prober.join()
    peak = router.memory_mb("VmHWM")
    time.sleep(SETTLE_S)
    return {
        "phase": name,
        **result,
        "seconds": round(seconds, 2),
        "rss_mb": round(rss, 1),
        "peak_mb": round(peak, 1),
        "growth_mb": round(peak - rss, 1),
        "after_mb": round(router.memory_mb(), 1),
        "router_cpu_s": round(router.cpu_s() - cpu, 2),
        "load_avg": round(load, 1),
        "health_max_ms": round(1000 * max(s for s, _ in probes), 1),
        "health_probes": len(probes),
        "health_statuses": sorted({status for _, status in probes}),
    }


def flood(router: RouterProcess, path: str, body: bytes, count: int):
    def work() -> dict:
        with ThreadPoolExecutor(count) as pool:
            answers = list(pool.map(lambda _: post(router.http_port, path, body), range(count)))
        return {"body_bytes": len(body), "statuses": [a[0] for a in answers], "first": answers[0][2].decode()[:200]}

    return work


def answer_body(args: argparse.Namespace, stream: bool) -> bytes:
    prompts = [f"Prompt {i}: tell a long story." for i in range(args.answer_prompts)]
    body = {"prompt": prompts, "n": args.answer_n, "max_tokens": args.answer_tokens, "ignore_eos": True}
    return json.dumps(body | {"logprobs": args.logprobs, "stream": stream, "seed": 1}).encode()


def answer(router: RouterProcess, body: bytes):
    def work() -> dict:
        status, size, head = post(router.http_port, "/v1/completions", body)
        return {"status": status, "answer_mb": round(size / 2**20, 1), "first": head.decode(errors="replace")[:200]}

    return work


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench router_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--flood", type=int, default=8, help="requests at once in the floods")
    parser.add_argument("--answer-prompts", type=int, default=8)
    parser.add_argument("--answer-n", type=int, default=8)
    parser.add_argument("--answer-tokens", type=int, default=200)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--max-answer-bytes", type=int, default=1 << 20, help="the floods' and answer_refused's router")
    parser.add_argument("--big-answer-bytes", type=int, default=256 << 20, help="answer_whole's and answer_stream's")
    args = parser.parse_args(argv)

    cores = set(os.sched_getaffinity(0))
    node = PinnedNode("serve", cores, ["--model", args.model, "--log-level", "error", "--quiet"])
    routers: list[RouterProcess] = []
    try:
        node.wait_ready()
        limited = RouterProcess(node.address, ["--max-answer-bytes", str(args.max_answer_bytes)])
        routers.append(limited)
        big = RouterProcess(
            node.address, ["--max-answer-bytes", str(args.big_answer_bytes), "--request-timeout-s", "3600"]
        )
        routers.append(big)
        for r in routers:  # warm: the node's model reported, the tokenizer fetched, the KV index synced
            deadline = time.monotonic() + 60
            while post(r.http_port, "/v1/completions", b'{"prompt": "hello", "max_tokens": 2}')[0] != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the router did not serve within 60 s")
                time.sleep(0.2)
        text = {"prompt": "", "max_tokens": 2}
        text["prompt"] = "x" * (BODY_LIMIT - len(json.dumps(text)) - 16)
        empty = {"role": "user", "content": ""}
        chat = {"messages": [empty] * ((BODY_LIMIT - 64) // (len(json.dumps(empty)) + 2)), "max_tokens": 2}
        many = {"messages": [empty] * 32_000, "max_tokens": 2}
        phases = [
            ("text_flood", limited, flood(limited, "/v1/completions", json.dumps(text).encode(), args.flood)),
            ("chat_flood", limited, flood(limited, "/v1/chat/completions", json.dumps(chat).encode(), args.flood)),
            ("chat_32000", limited, flood(limited, "/v1/chat/completions", json.dumps(many).encode(), args.flood)),
            ("answer_stream", big, answer(big, answer_body(args, stream=True))),
            ("answer_whole", big, answer(big, answer_body(args, stream=False))),
            ("answer_refused", limited, answer(limited, answer_body(args, stream=False))),
        ]
        for name, router, work in phases:
            row = phase(name, router, work)
            if name == "answer_refused":
                row["node_idle"] = wait_node_idle(node.address)
            print(json.dumps(row), flush=True)
    finally:
        for r in routers:
            r.stop()
        node.stop()
    return 0


def wait_node_idle(address: str, timeout_s: float = 30.0) -> bool:
    """The node holds no request and no KV page (its Admin status) within timeout_s."""
    from kvbridge.common import rpc
    from kvbridge.v1 import admin_pb2, admin_pb2_grpc

    stub = admin_pb2_grpc.AdminStub(rpc.make_channel(address))
    deadline = time.monotonic() + timeout_s
    while True:
        st = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
        if not st.requests_in_flight and not any(r.kv_pages_used for r in st.ranks):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
