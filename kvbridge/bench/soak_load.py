"""bench soak's clients (see kvbridge/bench/soak.py): the requests they draw at random, sending
them over gRPC or OpenAI HTTP (streamed or not), cancelling some at a random moment, and the
client-side tally of outcomes, latencies, tokens and replays."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import socket
import string
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

WORDS = ["the", "a", "kv", "page", "node", "token", "bridge", "prefill", "decode", "rank", "ring", "soak", "river"]


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
        from kvbridge.common import rpc
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
