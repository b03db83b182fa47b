"""`kvbridge demo`: a router, one prefill node and one decode node on 127.0.0.1, a handful of
chat requests through the router, the answers, and a summary; then everything stops.

Free ports everywhere; nothing is left behind: no process, no /dev/shm segment.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from kvbridge.common.progress import Progress
from kvbridge.common.security import add_tls_flags
from kvbridge.engine.config import EngineConfig, PPConfig

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What do bees make?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about the sea.",
    "What is 12 times 7?",
]


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="router + one prefill node + one decode node, a few chat requests, a summary")
    demo.add_argument("--model", default=EngineConfig.model, help="preset, .gguf file or Hugging Face directory")
    demo.add_argument("--prefill-pp", type=int, default=2, help="prefill node's pipeline ranks (default: 2)")
    demo.add_argument("--decode-pp", type=int, default=2, help="decode node's pipeline ranks (default: 2)")
    demo.add_argument("--requests", type=int, default=4, help=f"chat requests, 1..{len(QUESTIONS)} (default: 4)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--transfer-backend", default="auto", choices=["auto", "shm", "torch", "grpc"])
    demo.add_argument("--json", action="store_true", help="one JSON object per answer, then the summary")
    demo.add_argument("--metrics", action="store_true", help="serve /metrics on every process (free ports, printed)")
    demo.add_argument("--log-level", default="warning", help="debug | info | warning | error (default: warning)")
    add_tls_flags(demo, admin_key=False)


def ask(port: int, question: str, max_new_tokens: int) -> dict:
    from kvbridge.common import rpc
    from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(f"127.0.0.1:{port}"))
    chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content=question)])
    req = generation_pb2.GenerateRequest(
        prompt=common_pb2.Prompt(chat=chat), sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens)
    )
    t0 = time.perf_counter()
    out = {"question": question, "text": "", "tokens": 0, "ttft_s": 0.0}
    for resp in stub.Generate(req, timeout=600):
        if resp.token_ids and not out["tokens"]:
            out["ttft_s"] = time.perf_counter() - t0
        out["tokens"] += len(resp.token_ids)
        out["text"] += resp.text
        if resp.HasField("transfer"):
            out |= {"backend": resp.transfer.backend, "kv_bytes": resp.transfer.kv_bytes, "kv_s": resp.transfer.seconds}
    out["e2e_s"] = time.perf_counter() - t0
    return out


def start_fleet(config: EngineConfig, prefill_pp: int, decode_pp: int, backend: str = "auto", metrics: bool = False):
    """A prefill node, a decode node and a router over them, on free ports (started in that order;
    the caller stops them in reverse). metrics: each serves /metrics on a free port too."""
    from kvbridge.nodes import start_node
    from kvbridge.router.config import RouterConfig
    from kvbridge.router.server import start_router
    from kvbridge.serving.config import NodeConfig

    port = 0 if metrics else -1
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(start_node, "prefill", NodeConfig(config, PPConfig(pp_size=prefill_pp), metrics_port=port))
        d_node = NodeConfig(config, PPConfig(pp_size=decode_pp), transfer_backend=backend, metrics_port=port)
        d = pool.submit(start_node, "decode", d_node)
        prefill, decode = p.result(), d.result()
    try:
        router = start_router(
            RouterConfig(port=0, http_port=0, prefill=(prefill.address,), decode=(decode.address,), metrics_port=port)
        )
    except BaseException:
        decode.stop()
        prefill.stop()
        raise
    return prefill, decode, router


def push_figures(registry) -> dict:
    """The hand-off itself, from the prefill node's series: the mean time a request's hand-off took
    after its prompt was computed (kvbridge_kv_handoff_seconds), and the push's own speed: the bytes
    its ranks wrote over the time they spent writing them (kvbridge_kv_transfer_bytes over
    kvbridge_kv_push_seconds)."""
    total: dict[str, float] = {}
    for family in registry.collect():
        for s in family.samples:
            total[s.name] = total.get(s.name, 0.0) + s.value
    nbytes, seconds = total.get("kvbridge_kv_transfer_bytes_total", 0), total.get("kvbridge_kv_push_seconds_total", 0)
    count = total.get("kvbridge_kv_handoff_seconds_count", 0)
    return {
        "kv_handoff_s_mean": round(total.get("kvbridge_kv_handoff_seconds_sum", 0) / count, 4) if count else None,
        "kv_push_s": round(seconds, 4),
        "kv_push_gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds else None,
    }


def run_traffic(port: int, requests: int, max_new_tokens: int, progress: bool = True) -> list[dict]:
    """The demo's chat requests, all at once, through the router on `port`; their answers in order."""
    with Progress("requests", requests, enabled=progress) as bar, ThreadPoolExecutor(requests) as pool:
        futures = [pool.submit(ask, port, q, max_new_tokens) for q in QUESTIONS[:requests]]
        answers = []
        for f in futures:
            answers.append(f.result())
            bar.advance()
    return answers


def run_demo(args: argparse.Namespace) -> int:
    from kvbridge.common import logs, rpc, security

    try:  # every server and channel of the demo's processes, their ranks included
        rpc.configure(security.from_flags(args))
    except ValueError as e:
        print(f"kvbridge demo: error: {e}", file=sys.stderr)
        return 2
    if not 1 <= args.requests <= len(QUESTIONS):
        print(
            f"kvbridge demo: error: --requests must be in [1, {len(QUESTIONS)}], got {args.requests}", file=sys.stderr
        )
        return 2
    try:
        logs.setup(args.log_level)
    except ValueError as e:
        print(f"kvbridge demo: error: {e}", file=sys.stderr)
        return 2
    config = EngineConfig(model=args.model, kv_cache_tokens=8192)
    print(
        f"starting a prefill node (pp {args.prefill_pp}) and a decode node (pp {args.decode_pp}) ...",
        file=sys.stderr,
    )
    prefill, decode, router = start_fleet(config, args.prefill_pp, args.decode_pp, args.transfer_backend, args.metrics)
    try:
        print(f"router: grpc 127.0.0.1:{router.port}, http 127.0.0.1:{router.http_port}", file=sys.stderr)
        if args.metrics:
            ports = {"router": router.metrics_port, "prefill": prefill.metrics_port, "decode": decode.metrics_port}
            print("metrics: " + ", ".join(f"{k} 127.0.0.1:{v}/metrics" for k, v in ports.items()), file=sys.stderr)
        t0 = time.perf_counter()
        answers = run_traffic(router.port, args.requests, args.max_new_tokens)
        wall = time.perf_counter() - t0
        pushed = push_figures(prefill.registry)
    finally:
        for s in (router, decode, prefill):
            s.stop()
    kv_bytes = sum(a.get("kv_bytes", 0) for a in answers)
    summary = {
        "requests": len(answers),
        "ttft_s_p50": round(statistics.median(a["ttft_s"] for a in answers), 3),
        "output_tokens": sum(a["tokens"] for a in answers),
        "tokens_per_s": round(sum(a["tokens"] for a in answers) / wall, 1),
        "kv_bytes": kv_bytes,
        # the decode node's wait for the KV: from its registration to the KV landing on every rank,
        # computing the prompt on the prefill node included
        "kv_wait_s_p50": round(statistics.median(a.get("kv_s", 0.0) for a in answers), 3),
        **pushed,
        "backend": sorted({a.get("backend", "") for a in answers}),
        "prefill_pp": args.prefill_pp,
        "decode_pp": args.decode_pp,
    }
    for a in answers:
        if args.json:
            print(json.dumps(a))
        else:
            print(f"\nQ: {a['question']}\nA: {a['text'].strip()}")
    print(json.dumps({"summary": summary}) if args.json else "\n" + " ".join(f"{k}={v}" for k, v in summary.items()))
    return 0
