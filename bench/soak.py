"""Soak: minutes of mixed, partly cancelled traffic through a router over a prefill node and a
decode node with faults injected; then checks that nothing leaked and no process died.

    python -m bench.soak [--minutes 5 | --seconds 30] [--concurrency 8] [--model tiny-random]
                         [--prefill-pp 2] [--decode-pp 2] [--cancel-rate 0.1]
                         [--fault-inject "transfer_fail=0.02,transfer_delay_ms=20"]
                         [--prefill-faults SPEC] [--decode-faults SPEC]

The fleet (a prefill node, a decode node, a router; every process serves /metrics on a free
port) runs in this process and its rank processes. The faults of a node are `--fault-inject`
followed by its own `--prefill-faults` / `--decode-faults` (engine/faults.py; a later item
overrides an earlier one, e.g. --decode-faults rank1:transfer_fail=0.05); each node draws
from its own random stream unless a spec names a seed. Node timeouts are short
(`--node-timeout-s`), so a request whose hand-off failed ends within seconds.

`--concurrency` clients loop until the time is up, each sending one request at a time, drawn
at random: gRPC streams (through the router's Generation) and OpenAI HTTP requests, streamed
(server-sent events) or not; prompts of token ids, text or chat, short to long; max_new_tokens
1 to 128; greedy, seeded or unseeded sampling; some with ignore_eos. A `--cancel-rate`
fraction is cancelled by the client at a random moment (the gRPC call cancelled, the HTTP
socket shut). Some seeded or greedy gRPC requests repeat an earlier one exactly: their tokens
must be the same (`replay_mismatches`). Progress on stderr every 10 s.

Once the clients are done the nodes get `--settle-s` to drain (pages back, no request, queue or
transfer left); what remains then is a leak. Then everything is stopped. One JSON line:

    requests = served + sum(failed_by_reason) + cancelled   (client-side outcomes)
    ttft_s / itl_s: streamed requests only; e2e_s: served requests; failed_e2e_s: failed ones
                    (how soon a failure reached the client); seconds, client-side
    tokens_per_s: tokens received by clients per second of traffic (gRPC: any outcome; HTTP:
                  the usage of finished requests); _windows: the same over each 10 s (a trend)
    retries: the router's kvbridge_router_retries_total
    transfer_failures: kvbridge_kv_transfer_failures_total summed over both nodes' ranks
    pages_used_start / _end, requests_in_flight_end: Admin GetStatus of each node (and router)
    rss_mb_start / _end: VmRSS of this process (front: the nodes' fronts, router, clients) and
                         of every rank process; cpu_s: CPU seconds each used from start to end
    leaks, dead_processes, invariant_violations, status_errors, rank_errors, logs_agree, shm_left

Exit status 1 if anything leaked, a process died, an invariant broke, a rank reported an error,
ranks' decision logs differ, a /dev/shm segment was left, or a replay differed; 2 on bad flags.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import socket
import string
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

DEFAULT_FAULTS = "transfer_fail=0.02,transfer_delay_ms=20"
REPORT_EVERY_S = 10.0
WORDS = ["the", "a", "kv", "page", "node", "token", "bridge", "prefill", "decode", "rank", "ring", "soak", "river"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvbridge bench soak", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="traffic duration (default: 5)")
    ap.add_argument("--seconds", type=float, default=None, help="traffic duration in seconds (overrides --minutes)")
    ap.add_argument("--model", default="tiny-random", help="tiny-random (default) | smollm2-135m-instruct | ...")
    ap.add_argument("--prefill-pp", type=int, default=2)
    ap.add_argument("--decode-pp", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8, help="clients, each with one request at a time")
    ap.add_argument("--cancel-rate", type=float, default=0.1, help="fraction of requests the client cancels")
    ap.add_argument("--fault-inject", default=DEFAULT_FAULTS, help=f"faults of both nodes (default: {DEFAULT_FAULTS})")
    ap.add_argument("--prefill-faults", default="", help="more faults for the prefill node (after --fault-inject)")
    ap.add_argument("--decode-faults", default="", help="more faults for the decode node (after --fault-inject)")
    ap.add_argument("--node-timeout-s", type=float, default=5.0, help="bootstrap, prealloc and transfer timeouts")
    ap.add_argument("--request-timeout-s", type=float, default=60.0, help="router and client deadline per request")
    ap.add_argument("--settle-s", type=float, default=20.0, help="after traffic: wait this long for nodes to drain")
    ap.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV pool of each node, tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=768, help="longest prompt drawn")
    ap.add_argument("--seed", type=int, default=0, help="traffic and fault random streams")
    ap.add_argument("--transfer-backend", default="auto", choices=["auto", "shm", "torch", "grpc"])
    ap.add_argument("--log-level", default="error", help="node and router logs on stderr (default: error)")
    ap.add_argument("--json", action="store_true", help="JSON line (the only output format)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------- client side


class Cancel:
    """A client's cancellation of one request at a random moment: `arm(action)` once the call
    exists; the timer runs the action unless `finish()` came first. finish() says whether the
    cancel fired before the client saw the request end (the request then counts as cancelled)."""

    def __init__(self, delay_s: float | None):
        self._lock = threading.Lock()
        self.fired = self.done = False
        self._action = None
        self._timer = None
        if delay_s is not None:
            self._timer = threading.Timer(delay_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def arm(self, action) -> None:
        with self._lock:
            self._action = action
            fire_now = self.fired and not self.done
        if fire_now:
            action()

    def _fire(self) -> None:
        with self._lock:
            if self.done:
                return
            self.fired = True
            action = self._action
        if action is not None:
            action()

    def finish(self) -> bool:
        with self._lock:
            self.done = True
            if self._timer is not None:
                self._timer.cancel()
            return self.fired


@dataclass
class Spec:
    """One request as drawn: transport, prompt, sampling, cancellation."""

    kind: str  # "grpc" | "http_stream" | "http"
    prompt_form: str  # "ids" | "text" | "chat"
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    cancel_after_s: float | None = None
    replay_key: tuple | None = None  # set for gRPC token-id requests whose output is deterministic


@dataclass
class Result:
    outcome: str  # "served" | "failed" | "cancelled"
    code: str = ""  # failed: the gRPC status code name
    message: str = ""
    tokens: int = 0
    token_ids: list[int] | None = None
    ttft_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    e2e_s: float = 0.0


class Traffic:
    def __init__(self, args: argparse.Namespace, router_port: int, http_port: int, vocab: int, max_context: int):
        self.args = args
        self.http_port = http_port
        self.vocab, self.max_context = vocab, max_context
        from kvbridge import rpc
        from kvbridge.v1 import generation_pb2_grpc

        self.channel = rpc.make_channel(f"127.0.0.1:{router_port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.lock = threading.Lock()
        self.sent = 0
        self.served = 0
        self.cancelled = 0
        self.failed: Counter[str] = Counter()
        self.failure_examples: dict[str, str] = {}
        self.tokens = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self.failed_e2e: list[float] = []  # how long failures took to reach the client
        self.kinds: Counter[str] = Counter()
        self.replays: dict[tuple, list[int]] = {}  # replay key -> tokens of a served run
        self.replay_pool: list[Spec] = []
        self.replayed = 0
        self.replay_mismatches = 0
        self.unexpected: list[str] = []  # client-side surprises (a bug in the bench or the router)

    # ---------------------------------------------------------------- drawing

    def draw(self, rng: random.Random) -> Spec:
        with self.lock:
            pool = list(self.replay_pool)
            typical = sorted(self.e2e[-200:])[len(self.e2e[-200:]) // 2] if self.e2e else 0.5
        cancel = rng.uniform(0.0, 2 * min(max(typical, 0.05), 5.0)) if rng.random() < self.args.cancel_rate else None
        if pool and rng.random() < 0.1:
            base = rng.choice(pool)
            return Spec(**{**base.__dict__, "cancel_after_s": cancel})
        kind = rng.choices(["grpc", "http_stream", "http"], weights=[6, 2, 2])[0]
        form = rng.choices(["ids", "text", "chat"], weights=[7, 2, 1])[0]
        bucket = rng.choices([(4, 32), (33, 256), (257, self.args.max_prompt_tokens)], weights=[6, 3, 1])[0]
        lo, hi = bucket[0], max(bucket[0], bucket[1])
        n = rng.randint(lo, hi)
        new = rng.choices([(1, 1), (2, 16), (17, 128)], weights=[1, 5, 4])[0]
        max_new = rng.randint(*new)
        n = max(1, min(n, self.max_context - max_new - 64))
        spec = Spec(kind=kind, prompt_form=form, max_new_tokens=max_new, cancel_after_s=cancel)
        if form == "ids":
            spec.prompt_ids = [rng.randrange(3, self.vocab) for _ in range(n)]
        else:  # about a token per 2-4 characters: words of a few letters
            words = max(1, n // 3)
            spec.prompt_text = " ".join(rng.choice(WORDS + list(string.ascii_lowercase)) for _ in range(words))
        mode = rng.choices(["greedy", "seeded", "random"], weights=[5, 4, 1])[0]
        if mode != "greedy":
            spec.temperature = rng.choice([0.7, 0.9, 1.0])
            spec.top_p = rng.choice([1.0, 0.9])
            spec.top_k = rng.choice([0, 40])
        if mode == "seeded":
            spec.seed = rng.randrange(1 << 31)
        spec.ignore_eos = rng.random() < 0.5
        if kind == "grpc" and form == "ids" and mode != "random":
            spec.replay_key = (
                tuple(spec.prompt_ids),
                max_new,
                spec.temperature,
                spec.top_p,
                spec.top_k,
                spec.seed,
                spec.ignore_eos,
            )
            with self.lock:
                if len(self.replay_pool) < 64:
                    self.replay_pool.append(Spec(**{**spec.__dict__, "cancel_after_s": None}))
        return spec

    # ---------------------------------------------------------------- sending

    def run_one(self, spec: Spec, rid: str) -> Result:
        cancel = Cancel(spec.cancel_after_s)
        t0 = time.perf_counter()
        try:
            res = self._grpc(spec, rid, cancel, t0) if spec.kind == "grpc" else self._http(spec, cancel, t0)
        except Exception as e:  # a client-side surprise is recorded, not raised
            res = Result("failed", code="CLIENT_ERROR", message=f"{type(e).__name__}: {e}")
        was_cancelled = cancel.finish()
        res.e2e_s = time.perf_counter() - t0
        if was_cancelled:
            res.outcome = "cancelled"
        return res

    def _grpc(self, spec: Spec, rid: str, cancel: Cancel, t0: float) -> Result:
        from kvbridge.v1 import common_pb2, generation_pb2

        if spec.prompt_form == "ids":
            prompt = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=spec.prompt_ids))
        elif spec.prompt_form == "text":
            prompt = common_pb2.Prompt(text=spec.prompt_text)
        else:
            chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content=spec.prompt_text)])
            prompt = common_pb2.Prompt(chat=chat)
        sampling = common_pb2.SamplingParams(
            max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
            ignore_eos=spec.ignore_eos,
        )  # fmt: skip
        if spec.seed is not None:
            sampling.seed = spec.seed
        call = self.stub.Generate(
            generation_pb2.GenerateRequest(rid=rid, prompt=prompt, sampling=sampling),
            timeout=self.args.request_timeout_s,
        )
        cancel.arm(call.cancel)
        res = Result("served", token_ids=[])
        last = None
        finish = ""
        try:
            for resp in call:
                if resp.token_ids:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.gaps.append(now - last)
                    last = now
                    res.token_ids.extend(resp.token_ids)
                if resp.finish_reason:
                    finish = resp.finish_reason
        except grpc.RpcError as e:
            res.tokens = len(res.token_ids)
            return Result("failed", code=e.code().name, message=e.details() or "", tokens=res.tokens)
        res.tokens = len(res.token_ids)
        if finish not in ("stop", "length"):
            return Result("failed", code="NO_FINISH", message=f"stream ended with finish_reason {finish!r}")
        return res

    def _http(self, spec: Spec, cancel: Cancel, t0: float) -> Result:
        stream = spec.kind == "http_stream"
        body: dict = {"max_tokens": spec.max_new_tokens, "temperature": spec.temperature, "top_p": spec.top_p}
        body |= {"top_k": spec.top_k, "ignore_eos": spec.ignore_eos, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if spec.seed is not None:
            body["seed"] = spec.seed
        if spec.prompt_form == "chat":
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": spec.prompt_text}]
        else:
            path = "/v1/completions"
            body["prompt"] = spec.prompt_ids if spec.prompt_form == "ids" else spec.prompt_text
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=self.args.request_timeout_s)
        try:
            conn.connect()
            sock = conn.sock

            def hang_up() -> None:
                with contextlib.suppress(OSError):  # closed already
                    sock.shutdown(socket.SHUT_RDWR)

            cancel.arm(hang_up)
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return self._http_error(resp.status, resp.read())
            if not stream:
                out = json.loads(resp.read())
                tokens = out.get("usage", {}).get("completion_tokens", 0)
                finish = out["choices"][0].get("finish_reason")
                if finish not in ("stop", "length"):
                    return Result("failed", code="NO_FINISH", message=f"finish_reason {finish!r}", tokens=tokens)
                return Result("served", tokens=tokens)
            return self._sse(resp, t0)
        except (OSError, http.client.HTTPException, ValueError) as e:
            return Result("failed", code="CONNECTION", message=f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def _http_error(self, status: int, raw: bytes) -> Result:
        try:
            err = json.loads(raw)["error"]
            return Result("failed", code=str(err.get("code") or status).upper(), message=err.get("message", ""))
        except (ValueError, KeyError, TypeError):
            return Result("failed", code=f"HTTP_{status}", message=raw[:200].decode(errors="replace"))

    def _sse(self, resp, t0: float) -> Result:
        res = Result("served")
        last = None
        finish = ""
        done = False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                return Result("failed", code=str(err.get("code", "")).upper(), message=err.get("message", ""))
            if chunk.get("usage"):
                res.tokens = chunk["usage"].get("completion_tokens", 0)
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if text:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.gaps.append(now - last)
                    last = now
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        if not done:
            return Result("failed", code="CONNECTION", message="the event stream ended without [DONE]")
        if finish not in ("stop", "length"):
            return Result("failed", code="NO_FINISH", message=f"finish_reason {finish!r}")
        return res

    def record(self, spec: Spec, res: Result) -> None:
        with self.lock:
            self.kinds[spec.kind] += 1
            self.tokens += res.tokens
            if res.outcome == "cancelled":
                self.cancelled += 1
                return
            if res.outcome == "failed":
                self.failed[res.code] += 1
                self.failed_e2e.append(res.e2e_s)
                self.failure_examples.setdefault(res.code, res.message[:300])
                return
            self.served += 1
            self.e2e.append(res.e2e_s)
            if res.ttft_s is not None:
                self.ttft.append(res.ttft_s)
            self.itl.extend(res.gaps)
            if spec.replay_key is not None and res.token_ids is not None:
                seen = self.replays.setdefault(spec.replay_key, res.token_ids)
                if seen is not res.token_ids:
                    self.replayed += 1
                    if seen != res.token_ids:
                        self.replay_mismatches += 1
                        self.unexpected.append(f"replay differs: {seen[:8]}... vs {res.token_ids[:8]}...")

    def client(self, worker: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 7919 + worker)
        while time.monotonic() < deadline:
            spec = self.draw(rng)
            with self.lock:
                self.sent += 1
                rid = f"soak-{self.args.seed}-{self.sent}"  # gRPC requests carry it (logs, Admin)
            self.record(spec, self.run_one(spec, rid))

    def close(self) -> None:
        self.channel.close()


# ---------------------------------------------------------------------------- fleet side


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def processes(nodes: dict) -> dict[str, int]:
    """name -> pid of this process (every front and the router) and of every rank process."""
    out = {"front": os.getpid()}
    for name, server in nodes.items():
        for rank, proc in zip(server.node.node.pp.local_ranks, server.node.node.procs):
            out[f"{name}.rank{rank}"] = proc.pid
    return out


def scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    """The /metrics samples on `port`: name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError as e:  # counted as nothing; said on stderr
        print(f"bench soak: scraping 127.0.0.1:{port}/metrics: {e}", file=sys.stderr)
        return {}
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def admin_status(address: str):
    from kvbridge import rpc
    from kvbridge.v1 import admin_pb2, admin_pb2_grpc

    channel = rpc.make_channel(address)
    try:
        return admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    finally:
        channel.close()


def node_state(nodes: dict, router) -> dict:
    """Pages per rank, requests, queues and transfers of each node; the router's requests in flight."""
    out = {}
    for name, server in nodes.items():
        try:
            st = admin_status(server.address)
        except grpc.RpcError as e:  # rank 0 did not answer: nothing known, so nothing is assumed clean
            out[name] = {"error": f"{e.code().name}: {e.details()}", "pages": None, "requests_in_flight": None}
            continue
        out[name] = {
            "pages": [r.kv_pages_used for r in st.ranks],
            "requests_in_flight": st.requests_in_flight,
            "transfers_in_flight": st.transfers_in_flight,
            "queued": sum(st.queues.values()),
            "alive": all(r.alive for r in st.ranks),
        }
    out["router"] = {"requests_in_flight": admin_status(f"127.0.0.1:{router.port}").requests_in_flight}
    return out


def is_idle(state: dict) -> bool:
    nodes = [v for k, v in state.items() if k != "router"]
    return state["router"]["requests_in_flight"] == 0 and all(
        "error" not in n
        and not any(n["pages"])
        and n["requests_in_flight"] == 0
        and n["transfers_in_flight"] == 0
        and n["queued"] == 0
        for n in nodes
    )


def dead_processes(nodes: dict) -> list[str]:
    dead = []
    for name, server in nodes.items():
        dead += [f"{name}.rank{r}" for r in server.dead]
        ranks = zip(server.node.node.pp.local_ranks, server.node.node.procs)
        dead += [f"{name}.rank{r}" for r, p in ranks if not p.is_alive()]
    return sorted(set(dead))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    s = sorted(values)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))], 4)

    return {"p50": q(0.50), "p99": q(0.99), "n": len(s)}


def faults_of(common: str, own: str, seed: int) -> str:
    """The node's spec: its own random stream first (a seed in the specs overrides it)."""
    return ",".join(s for s in (f"seed={seed}", common, own) if s)


def start(args: argparse.Namespace):
    from dataclasses import replace

    from decode_node.service import start_decode
    from engine.config import EngineConfig, PPConfig
    from prefill_node.service import start_prefill
    from router.config import RouterConfig
    from router.server import start_router

    t = args.node_timeout_s
    base = EngineConfig(
        model=args.model, page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens,
        chunked_prefill_size=args.chunked_prefill_size, bootstrap_timeout_s=t, prealloc_timeout_s=t,
        transfer_timeout_s=t,
    )  # fmt: skip
    p_config = replace(base, fault_inject=faults_of(args.fault_inject, args.prefill_faults, 2 * args.seed + 1))
    d_config = replace(base, fault_inject=faults_of(args.fault_inject, args.decode_faults, 2 * args.seed + 2))
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(start_prefill, p_config, PPConfig(pp_size=args.prefill_pp), metrics_port=0)
        d = pool.submit(
            start_decode, d_config, PPConfig(pp_size=args.decode_pp), backend=args.transfer_backend, metrics_port=0
        )
        errors = [f.exception() for f in (p, d)]
        if any(errors):
            for f in (p, d):
                if f.exception() is None:
                    f.result().stop()
            raise next(e for e in errors if e is not None)
        prefill, decode = p.result(), d.result()
    try:
        router = start_router(
            RouterConfig(
                port=0, http_port=0, prefill=(prefill.address,), decode=(decode.address,), metrics_port=0,
                request_timeout_s=args.request_timeout_s,
            )
        )  # fmt: skip
    except BaseException:
        decode.stop()
        prefill.stop()
        raise
    return {"prefill": prefill, "decode": decode}, router, (p_config.fault_inject, d_config.fault_inject)


def shm_segments(nodes: dict) -> list[str]:
    names = []
    for server in nodes.values():
        names += [r.shm_name for r in server.node.layout.ranks if r.shm_name]
    return names


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    problems = []
    if not duration > 0:
        problems.append(f"the duration must be > 0, got {duration}")
    if args.concurrency < 1 or args.prefill_pp < 1 or args.decode_pp < 1:
        problems.append("--concurrency, --prefill-pp and --decode-pp must be >= 1")
    if not 0 <= args.cancel_rate <= 1:
        problems.append(f"--cancel-rate must be in [0, 1], got {args.cancel_rate}")
    if not (args.node_timeout_s > 0 and args.request_timeout_s > 0 and args.settle_s >= 0):
        problems.append("--node-timeout-s and --request-timeout-s must be > 0, --settle-s >= 0")
    if args.max_prompt_tokens < 257:
        problems.append(f"--max-prompt-tokens must be >= 257, got {args.max_prompt_tokens}")
    from engine import faults

    for flag, spec in (("--fault-inject", args.fault_inject), ("--prefill-faults", args.prefill_faults),
                       ("--decode-faults", args.decode_faults)):  # fmt: skip
        try:
            faults.parse(spec, 0)
        except ValueError as e:
            problems.append(f"{flag}: {e}")
    if problems:
        for p in problems:
            print(f"bench soak: error: {p}", file=sys.stderr)
        return 2

    from kvbridge import logs

    logs.setup(args.log_level)
    print(
        f"bench soak: starting a prefill node (pp {args.prefill_pp}) and a decode node (pp {args.decode_pp}), "
        f"model {args.model} ...",
        file=sys.stderr,
        flush=True,
    )
    t_start = time.perf_counter()
    nodes, router, specs = start(args)
    try:
        procs = processes(nodes)
        rss_start = {name: rss_mb(pid) for name, pid in procs.items()}
        cpu_start = {name: cpu_s(pid) for name, pid in procs.items()}
        state_start = node_state(nodes, router)
        model = nodes["prefill"].node.node.model
        max_context = nodes["prefill"].node.node.max_context
        traffic = Traffic(args, router.port, router.http_port, model.config.vocab_size, max_context)
        print(
            f"bench soak: fleet up in {time.perf_counter() - t_start:.1f}s; {duration:g}s of traffic, "
            f"{args.concurrency} clients, faults prefill {specs[0]!r} decode {specs[1]!r}",
            file=sys.stderr,
            flush=True,
        )

        t0 = time.monotonic()
        deadline = t0 + duration
        workers = [
            threading.Thread(target=traffic.client, args=(i, deadline), name=f"soak-client{i}", daemon=True)
            for i in range(args.concurrency)
        ]
        for w in workers:
            w.start()
        next_report = t0 + REPORT_EVERY_S
        windows: list[float] = []  # tokens per second over each REPORT_EVERY_S of traffic
        last_tokens = 0
        while any(w.is_alive() for w in workers):
            time.sleep(min(0.2, max(0.0, next_report - time.monotonic())))
            if time.monotonic() >= next_report:
                next_report += REPORT_EVERY_S
                with traffic.lock:
                    rate = (traffic.tokens - last_tokens) / REPORT_EVERY_S
                    last_tokens = traffic.tokens
                    line = (
                        f"bench soak: {time.monotonic() - t0:5.0f}s/{duration:g}s sent={traffic.sent} "
                        f"served={traffic.served} failed={sum(traffic.failed.values())} "
                        f"cancelled={traffic.cancelled} tokens/s={rate:.0f}"
                    )
                if time.monotonic() <= deadline + 1:  # the ramp-down after the deadline says nothing
                    windows.append(round(rate, 1))
                rss = {name: rss_mb(pid) or 0.0 for name, pid in procs.items()}
                ranks_max = max(v for k, v in rss.items() if k != "front")
                line += f" rss_mb front={rss['front']:.0f} ranks_max={ranks_max:.0f}"
                dead = dead_processes(nodes)
                print(line + (f" DEAD={','.join(dead)}" if dead else ""), file=sys.stderr, flush=True)
        traffic_s = time.monotonic() - t0
        for w in workers:
            w.join()
        traffic.close()

        # settle: what the nodes still hold once they had settle_s to clean up is a leak
        t_settle = time.monotonic()
        dead = dead_processes(nodes)
        state = node_state(nodes, router) if not dead else None
        while not dead and not is_idle(state) and time.monotonic() - t_settle < args.settle_s:
            time.sleep(0.2)
            dead = dead_processes(nodes)
            state = node_state(nodes, router) if not dead else state
        settle_s = time.monotonic() - t_settle
        if state is None:
            state = node_state(nodes, router)
        violations = {}
        for name, server in nodes.items():
            if not server.dead:
                try:
                    violations[name] = server.check_invariants()
                except Exception as e:  # rank 0 did not answer
                    violations[name] = [f"no invariant check: {type(e).__name__}: {e}"]
        rss_end = {name: rss_mb(pid) for name, pid in procs.items()}
        cpu_used = {name: round(cpu_s(pid) - cpu_start[name], 1) for name, pid in procs.items()}
        metrics = {name: scrape(server.metrics_port) for name, server in nodes.items()}
        router_metrics = scrape(router.metrics_port)
        dead = dead_processes(nodes)
        segments = shm_segments(nodes)
    finally:
        reports = {}
        for name, server in (("router", router), ("decode", nodes["decode"]), ("prefill", nodes["prefill"])):
            try:
                reports[name] = server.stop() or []
            except Exception as e:  # stop the others all the same
                print(f"bench soak: stopping the {name}: {type(e).__name__}: {e}", file=sys.stderr)
                reports[name] = []
        del reports["router"]
    shm_left = [s for s in segments if os.path.exists(f"/dev/shm/{s.lstrip('/')}")]

    failures = Counter()
    failure_reasons = Counter()
    for name, m in metrics.items():
        for labels, value in m.get("kvbridge_kv_transfer_failures_total", []):
            failures[name] += int(value)
            failure_reasons[labels.get("reason", "")] += int(value)
    retries = int(sum(v for _, v in router_metrics.get("kvbridge_router_retries_total", [])))
    router_outcomes = {
        labels["outcome"]: int(v) for labels, v in router_metrics.get("kvbridge_router_requests_total", [])
    }
    rank_errors = {
        f"{name}.rank{r.rank}": r.error for name, reps in reports.items() for r in reps if r.error
    }  # fmt: skip
    logs_agree = all(len({(r.log_count, r.log_digest) for r in reps}) <= 1 for reps in reports.values())
    pages_end = {name: state[name]["pages"] for name in nodes}
    in_flight_end = {name: state[name]["requests_in_flight"] for name in (*nodes, "router")}
    leaks = not is_idle(state)  # pages, requests, queued requests or transfers left (or a node not answering)
    n_violations = sum(len(v) for v in violations.values())
    t = traffic
    row = {
        "bench": "soak",
        "model": args.model,
        "prefill_pp": args.prefill_pp,
        "decode_pp": args.decode_pp,
        "concurrency": args.concurrency,
        "cancel_rate": args.cancel_rate,
        "faults": {"prefill": specs[0], "decode": specs[1]},
        "duration_s": round(traffic_s, 2),
        "requests": t.sent,
        "served": t.served,
        "failed_by_reason": dict(sorted(t.failed.items())),
        "cancelled": t.cancelled,
        "kinds": dict(sorted(t.kinds.items())),
        "ttft_s": percentiles(t.ttft),
        "itl_s": percentiles(t.itl),
        "e2e_s": percentiles(t.e2e),
        "failed_e2e_s": percentiles(t.failed_e2e),
        "tokens": t.tokens,
        "tokens_per_s": round(t.tokens / traffic_s, 1),
        "tokens_per_s_windows": windows,
        "retries": retries,
        "router_outcomes": router_outcomes,  # the router's view: stop + length ~ served, abort ~ cancelled
        "transfer_failures": sum(failures.values()),
        "transfer_failures_by_node": dict(failures),
        "transfer_failures_by_reason": dict(sorted(failure_reasons.items())),
        "replayed": t.replayed,
        "replay_mismatches": t.replay_mismatches,
        "pages_used_start": {name: state_start[name]["pages"] for name in nodes},
        "pages_used_end": pages_end,
        "requests_in_flight_end": in_flight_end,
        "settle_s": round(settle_s, 2),
        "rss_mb_start": rss_start,
        "rss_mb_end": rss_end,
        "cpu_s": cpu_used,
        "dead_processes": dead,
        "invariant_violations": n_violations,
        "status_errors": {name: state[name]["error"] for name in nodes if "error" in state[name]},
        "rank_errors": rank_errors,
        "logs_agree": logs_agree,
        "shm_left": shm_left,
        "leaks": leaks,
        "failure_examples": t.failure_examples,
    }
    if t.unexpected:
        row["unexpected"] = t.unexpected[:10]
    print(json.dumps(row), flush=True)
    bad = leaks or dead or n_violations or rank_errors or not logs_agree or shm_left or t.replay_mismatches
    if bad:
        print("bench soak: FAILED (see leaks, dead_processes, invariant_violations, rank_errors, logs_agree, "
              "shm_left, replay_mismatches)", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
