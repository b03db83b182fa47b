"""What one client's largest sampling controls cost everyone else: inter-token latency (ITL) of
normal streams alone, beside a client sending plain sampled requests, and beside a client that
sends the largest stop strings, bad words, logit_bias, allowed_token_ids and stop_token_ids the
limits allow (common/sampling.py), again and again; on one colocated node, in one run.

    kvbridge bench hostile_sampling [--model smollm2-135m-instruct] [--streams 8] [--tokens 64]
        [--hostile 1] [--hostile-tokens 32] [--repeats 2] [--threads 0]

Each run sends --streams greedy streams at once (--prompt-tokens seeded random ids, ignore_eos,
--tokens tokens each, gRPC Generate straight to the node) and times the gap before each of their
tokens from the fourth on (WARM_GAPS). Run kinds: "quiet", the streams alone; "plain", beside
--hostile clients each sending requests of --hostile-tokens sampled tokens back to back;
"hostile", the same with every size of `at_the_limits` at its limit. The streams start once a
client's first request is through, and the clients stop when the streams end. The kinds
alternate, --repeats times, after one uncounted warm-up of each. One JSON line per kind (ITL
p50/p99/max in ms over every gap of its runs, tokens and gaps counted exactly, the clients'
requests), then a summary: hostile over quiet (issue 25's bound: p99 within 1.5x) and over plain
(what the sizes cost beyond one more sampled request). Progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvbridge.common import logs, rpc
from kvbridge.common.progress import Progress
from kvbridge.common.sampling import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc

SEED = 1234
KINDS = ("quiet", "plain", "hostile")
# gaps of each stream left out: its first tokens wait for the other streams' prompts (they arrive
# together), which is time to first token, not the interference measured here
WARM_GAPS = 2


def at_the_limits(vocab: int, max_new_tokens: int, seed: int = 0) -> common_pb2.SamplingParams:
    """Sampling parameters with every size a client chooses at its limit: MAX_STOP_STRINGS stop
    strings of MAX_STOP_CHARS characters in all, MAX_BAD_WORDS bad words of MAX_BAD_WORDS_CHARS in
    all, MAX_LOGIT_BIAS logit_bias entries (at most the vocabulary's), MAX_ALLOWED_TOKEN_IDS allowed
    ids (repeats count: the whole vocabulary over and over) and MAX_STOP_TOKEN_IDS stop token ids
    (past the vocabulary: none of them ends the request). Random lower-case text: the stop strings
    and bad words rarely match, so the request runs its max_new_tokens."""
    rng = random.Random(seed)

    def word(n: int) -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))

    stop_len = MAX_STOP_CHARS // MAX_STOP_STRINGS
    bad_len = min(MAX_BAD_WORD_CHARS, MAX_BAD_WORDS_CHARS // MAX_BAD_WORDS)
    return common_pb2.SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seed=seed,
        ignore_eos=True,
        stop=[word(stop_len) for _ in range(MAX_STOP_STRINGS)],
        bad_words=[word(bad_len) for _ in range(MAX_BAD_WORDS)],
        logit_bias={t: rng.uniform(-2, 2) for t in rng.sample(range(vocab), min(MAX_LOGIT_BIAS, vocab))},
        allowed_token_ids=[i % vocab for i in range(MAX_ALLOWED_TOKEN_IDS)],
        stop_token_ids=[vocab + i for i in range(MAX_STOP_TOKEN_IDS)],
    )


def stream(stub, prompt: list[int], tokens: int) -> tuple[list[float], int]:
    """One greedy stream: (the gap before each of its tokens from the WARM_GAPS + 2nd on, in
    seconds; its tokens). A response of k tokens gives each of them 1/k of the time since the last
    response (those that come with the first token: 0)."""
    s = common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    ids = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=prompt))
    gaps, got, last = [], 0, None
    for r in stub.Generate(generation_pb2.GenerateRequest(prompt=ids, sampling=s), timeout=3600):
        now, k = time.perf_counter(), len(r.token_ids)
        if not k:
            continue
        gaps += [0.0] * (k - 1) if last is None else [(now - last) / k] * k
        last, got = now, got + k
    return gaps[WARM_GAPS:], got


class Client:
    """--hostile clients beside the streams, each sending requests of `params` back to back until stop()."""

    def __init__(self, stub, prompt: list[int], params: common_pb2.SamplingParams, clients: int):
        self.stub, self.prompt, self.params = stub, prompt, params
        self.done, self.tokens, self.errors = 0, 0, []
        self._stop, self._first = threading.Event(), threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        prompt = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=self.prompt))
        while not self._stop.is_set():
            try:
                got = sum(len(r.token_ids) for r in self.stub.Generate(
                    generation_pb2.GenerateRequest(prompt=prompt, sampling=self.params), timeout=3600))  # fmt: skip
            except grpc.RpcError as e:
                self.errors.append(f"{e.code().name}: {e.details()}")
                self._first.set()
                return
            self.done, self.tokens = self.done + 1, self.tokens + got
            self._first.set()

    def wait_first(self) -> None:
        """Until a first request is through (or failed): the streams start beside a client in its stride."""
        self._first.wait(600)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def run(stub, prompts: list[list[int]], tokens: int) -> dict:
    """The streams at once: every gap, and the tokens of each."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream(stub, p, tokens), prompts))
    return {"gaps": [g for gaps, _ in results for g in gaps], "tokens": [n for _, n in results]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def row_of(kind: str, runs: list[dict], header: dict, client: dict) -> dict:
    gaps = [g for r in runs for g in r["gaps"]]
    return {
        **header,
        "run": kind,
        "runs": len(runs),
        "stream_tokens": sum(sum(r["tokens"]) for r in runs),
        "gaps": len(gaps),
        "itl_p50_ms": round(1e3 * statistics.median(gaps), 3),
        "itl_p99_ms": round(1e3 * percentile(gaps, 0.99), 3),
        "itl_max_ms": round(1e3 * max(gaps), 3),
        **client,
    }


def sizes_of(params: common_pb2.SamplingParams) -> dict:
    return {
        "stop": [len(params.stop), sum(map(len, params.stop))],
        "bad_words": [len(params.bad_words), sum(map(len, params.bad_words))],
        "logit_bias": len(params.logit_bias),
        "allowed_token_ids": len(params.allowed_token_ids),
        "stop_token_ids": len(params.stop_token_ids),
    }


def measure(args: argparse.Namespace, node) -> tuple[dict[str, list[dict]], dict[str, dict], common_pb2.SamplingParams]:
    """Every run of each kind: (runs by kind, the clients' requests, tokens and errors by kind, the
    hostile params)."""
    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address))
    # ids both the tokenizer's and the logits' (a model may pad its logits past its tokenizer)
    vocab = min(node.node.front.tokenizer.vocab_size, node.node.ranks.model.config.vocab_size)
    rng = random.Random(SEED)
    prompts = [[rng.randrange(min(100, vocab // 4), vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.streams + 1)]  # fmt: skip
    hostile = at_the_limits(vocab, args.hostile_tokens, SEED)
    plain = common_pb2.SamplingParams(max_new_tokens=args.hostile_tokens, temperature=1.0, seed=SEED, ignore_eos=True)
    params = {"plain": plain, "hostile": hostile}
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    clients = {k: {"client_requests": 0, "client_tokens": 0, "client_errors": []} for k in params}
    with Progress("bench hostile_sampling", (args.repeats + 1) * len(KINDS)) as bar:
        for i in range(args.repeats + 1):  # the first round warms up, uncounted
            for kind in KINDS:
                client = Client(stub, prompts[-1], params[kind], args.hostile) if kind in params else None
                try:
                    if client is not None:
                        client.wait_first()
                    result = run(stub, prompts[: args.streams], args.tokens)
                finally:
                    if client is not None:
                        client.stop()
                if i:
                    runs[kind].append(result)
                if i and client is not None:
                    c = clients[kind]
                    c["client_requests"] += client.done
                    c["client_tokens"] += client.tokens
                    c["client_errors"] = sorted(set(c["client_errors"] + client.errors))
                bar.advance()
    return runs, clients, hostile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench hostile_sampling", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, default=8, help="normal greedy streams at once")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of each normal stream")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--hostile", type=int, default=1, help="clients beside the streams, each one request at a time")
    ap.add_argument("--hostile-tokens", type=int, default=32, help="tokens of each of their requests")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each kind (after one warm-up of each)")
    ap.add_argument("--threads", type=int, default=0, help="the node's torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    for name, lo, hi in (("streams", 1, 64), ("tokens", WARM_GAPS + 2, 1 << 16), ("prompt_tokens", 1, 1 << 14),
                         ("hostile", 1, 16), ("hostile_tokens", 1, 1 << 16), ("repeats", 1, 1000),
                         ("threads", 0, 1024)):  # fmt: skip
        if not lo <= getattr(args, name) <= hi:
            flag = "--" + name.replace("_", "-")
            print(f"kvbridge bench hostile_sampling: error: {flag} must be in [{lo}, {hi}], got {getattr(args, name)}",
                  file=sys.stderr)  # fmt: skip
            return 2
    logs.setup("warning")  # (the node's warnings and errors in logfmt; not a line per request phase)
    config = EngineConfig(model=args.model, threads=args.threads)
    node = start_node("colocated", NodeConfig(config, PPConfig()), progress=True)
    try:
        runs, clients, hostile = measure(args, node)
    finally:
        node.stop()
    header = {"bench": "hostile_sampling", "model": args.model, "streams": args.streams, "tokens": args.tokens,
              "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "clients": args.hostile,
              "threads": args.threads}  # fmt: skip
    rows = {
        "quiet": row_of("quiet", runs["quiet"], header, {}),
        "plain": row_of("plain", runs["plain"], header, clients["plain"]),
        "hostile": row_of("hostile", runs["hostile"], header, clients["hostile"] | {"sizes": sizes_of(hostile)}),
    }
    for row in rows.values():
        print(json.dumps(row))
    summary = {**header, "summary": True}
    for over in ("quiet", "plain"):
        for stat in ("itl_p50_ms", "itl_p99_ms", "itl_max_ms"):
            base = rows[over][stat]
            summary[f"hostile_over_{over}_{stat[:-3]}"] = round(rows["hostile"][stat] / base, 3) if base else None
    summary["p99_within_1_5x"] = (summary["hostile_over_quiet_itl_p99"] or math.inf) <= 1.5
    print(json.dumps(summary))
    return 0 if not any(c["client_errors"] for c in clients.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
