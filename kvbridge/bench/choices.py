"""What n > 1 saves: one request with n choices against n requests of the same prompt (seeds
seed..seed+n-1), sent at once, on one colocated node, side by side in one run.

    kvbridge bench choices [--model smollm2-135m-instruct] [--n 4] [--prompt-tokens 512]
        [--output-tokens 32] [--repeats 3] [--cache on|off]

The prompt is --prompt-tokens seeded random ids; every choice samples (temperature 1, ignore_eos)
--output-tokens tokens. The variants alternate, --repeats times (medians), after one uncounted
warm-up of each; the node's prefix cache is cleared before every run, so neither finds the other's
pages. With `--cache on` (the default) the n separate requests may share pages too, once the first
one's prompt is scheduled and indexed; `--cache off` starts the node with --disable-prefix-cache,
where only the choices of one request share.

Per variant, one JSON line: prefill_tokens (prompt tokens the node computed: its
kvbridge_prefill_chunk_tokens_sum over the run), seconds (send -> the last choice's end),
ttft_ms (send -> the last choice's first token), and `ratio` (seconds / the separate requests'
seconds, same run). The summary line says whether every choice equalled its separate request,
token for token (it must: choice i samples with seed + i). Progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.request import urlopen

from prometheus_client.parser import text_string_to_metric_families

from kvbridge.common import rpc
from kvbridge.common.progress import Progress
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.nodes import start_node
from kvbridge.serving.config import NodeConfig
from kvbridge.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

SEED = 1234


def prefill_tokens(metrics_port: int) -> float:
    text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvbridge_prefill_chunk_tokens_sum"
    )


def generate(stub, prompt: list[int], n: int, seed: int, output_tokens: int, started: float) -> dict[int, tuple]:
    """{choice: (tokens, first-token time, end time)} of one request."""
    s = common_pb2.SamplingParams(max_new_tokens=output_tokens, temperature=1.0, seed=seed, ignore_eos=True)
    if n > 1:
        s.n = n
    ids = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=prompt))
    req = generation_pb2.GenerateRequest(prompt=ids, sampling=s)
    out: dict[int, list] = {}
    for r in stub.Generate(req, timeout=3600):
        mine = out.setdefault(r.index, [[], None, None])
        if r.token_ids and mine[1] is None:
            mine[1] = time.perf_counter() - started
        mine[0] += r.token_ids
        if r.finish_reason:
            mine[2] = time.perf_counter() - started
    return {i: tuple(v) for i, v in out.items()}


def run(node, stub, variant: str, prompt: list[int], n: int, output_tokens: int) -> tuple[dict, list]:
    admin_pb2_grpc.AdminStub(stub.channel).ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=60)
    before = prefill_tokens(node.metrics_port)
    started = time.perf_counter()
    if variant == "n":
        choices = generate(stub.gen, prompt, n, SEED, output_tokens, started)
        got = [choices[i] for i in range(n)]
    else:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(generate, stub.gen, prompt, 1, SEED + i, output_tokens, started) for i in range(n)]
            got = [f.result()[0] for f in futures]
    row = {
        "prefill_tokens": prefill_tokens(node.metrics_port) - before,
        "seconds": max(g[2] for g in got),
        "ttft_ms": 1000 * max(g[1] for g in got),
    }
    return row, [g[0] for g in got]


class Stubs:
    def __init__(self, address: str):
        self.channel = rpc.make_channel(address)
        self.gen = generation_pb2_grpc.GenerationStub(self.channel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench choices", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=4, help="choices (2..16)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", choices=("on", "off"), default="on", help="the node's prefix cache")
    args = ap.parse_args(argv)
    for name, lo, hi in (("n", 2, 16), ("prompt_tokens", 1, 1 << 16), ("output_tokens", 1, 1 << 16),
                         ("repeats", 1, 1000)):  # fmt: skip
        if not lo <= getattr(args, name) <= hi:
            flag = "--" + name.replace("_", "-")
            print(f"kvbridge bench choices: error: {flag} must be in [{lo}, {hi}], got {getattr(args, name)}",
                  file=sys.stderr)  # fmt: skip
            return 2
    config = EngineConfig(model=args.model, disable_prefix_cache=args.cache == "off")
    node = start_node("colocated", NodeConfig(config, PPConfig(), metrics_port=0), progress=True)
    try:
        stub = Stubs(node.address)
        vocab = node.node.ranks.model.config.vocab_size
        prompt = [random.Random(SEED).randrange(100, vocab) for _ in range(args.prompt_tokens)]
        variants = ("n", "separate")
        rows: dict[str, list[dict]] = {v: [] for v in variants}
        outputs: dict[str, list] = {}
        with Progress("bench choices", (args.repeats + 1) * len(variants)) as bar:
            for k in range(args.repeats + 1):  # the first round warms up, uncounted
                for v in variants:
                    row, outputs[v] = run(node, stub, v, prompt, args.n, args.output_tokens)
                    if k:
                        rows[v].append(row)
                    bar.advance()
    finally:
        node.stop()
    header = {
        "bench": "choices",
        "model": args.model,
        "cache": args.cache,
        "n": args.n,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "repeats": args.repeats,
    }
    medians = {v: {key: statistics.median(r[key] for r in rows[v]) for key in rows[v][0]} for v in variants}
    for v in variants:
        m = medians[v]
        ratio = round(m["seconds"] / medians["separate"]["seconds"], 3)
        print(json.dumps({**header, "variant": f"n={args.n}" if v == "n" else f"{args.n} requests",
                          "prefill_tokens": int(m["prefill_tokens"]), "seconds": round(m["seconds"], 3),
                          "ttft_ms": round(m["ttft_ms"], 1), "ratio": ratio}))  # fmt: skip
    equal = outputs["n"] == outputs["separate"]
    saved = 1 - medians["n"]["prefill_tokens"] / medians["separate"]["prefill_tokens"]
    summary = {"summary": True, "choices_equal_separate_requests": equal}
    summary["distinct_choices"] = len({tuple(t) for t in outputs["n"]})
    summary["prefill_tokens_saved_pct"] = round(100 * saved, 1)
    print(json.dumps({**header, **summary}))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
