"""The `kvbridge` command. Engine flags are built from EngineConfig, so defaults live there."""

from __future__ import annotations

import argparse
import json
import sys

from kvbridge.common.flags import add_config_flags, from_flags
from kvbridge.common.sampling import SamplingParams
from kvbridge.common.security import add_tls_flags
from kvbridge.common.tracing import add_tracing_flags
from kvbridge.engine.config import EngineConfig, PPConfig


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError(f"--prompt-ids is empty: {text!r}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with the colocated engine")
    add_config_flags(gen, EngineConfig)
    add_config_flags(gen, PPConfig)
    src = gen.add_argument_group("prompts (repeatable; all run as one batch)")
    src.add_argument("--prompt", action="append", default=[], help="raw text prompt")
    src.add_argument("--chat", action="append", default=[], help="a user message, wrapped in the model's chat template")
    src.add_argument("--prompt-ids", action="append", default=[], type=_token_ids, help="token ids, e.g. 1,2,3")
    d = SamplingParams()
    gen.add_argument(
        "--max-new-tokens", type=int, default=d.max_new_tokens,
        help=f"0 = the rest of the context, at most --max-default-tokens (default: {d.max_new_tokens})",
    )  # fmt: skip
    gen.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=d.top_p)
    gen.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    gen.add_argument("--seed", type=int, default=d.seed)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stop-token-ids", type=_token_ids, default=(), help="extra stop token ids, e.g. 2,7")
    gen.add_argument("--ignore-eos", action="store_true", help="EOS is an ordinary token: run to --max-new-tokens")
    gen.add_argument(
        "--min-tokens", type=int, default=d.min_tokens, help="no EOS, stop token or stop string before this many tokens"
    )
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--quiet", action="store_true", help="no progress output")

    from kvbridge.nodes import COMMANDS
    from kvbridge.serving.config import NodeConfig

    for command, spec in COMMANDS.items():
        role = spec.name
        node = sub.add_parser(command, help=spec.help)
        add_config_flags(node, EngineConfig)
        add_config_flags(node, PPConfig)
        add_config_flags(node, NodeConfig, skip=("transfer_backend",) if role == "colocated" else ())
        node.add_argument("--log-level", default="info", help="debug | info | warning | error (default: info)")
        node.add_argument(
            "--shutdown-grace-s", type=float, default=30.0,
            help="on SIGTERM: admit nothing, let requests in flight finish this long, fail the rest (default: 30)",
        )  # fmt: skip
        node.add_argument("--quiet", action="store_true", help="no progress output")
        if role == "colocated":
            node.add_argument(
                "--http-port", type=int, default=-1,
                help="also serve the OpenAI-compatible HTTP API (and GET /health) from this process on this port "
                "(0: a free one, printed when ready; default -1: off)",
            )  # fmt: skip
            node.add_argument("--api-key-file", default="", help="with --http-port: clients must send this bearer key")
        add_tls_flags(node)
        add_tracing_flags(node)

    from kvbridge.admin_cli import add_admin_parser
    from kvbridge.demo import add_demo_parser
    from kvbridge.router.cli import add_router_parser

    add_router_parser(sub)
    add_demo_parser(sub)
    add_admin_parser(sub)

    bench = sub.add_parser("bench", help="run a benchmark from kvbridge/bench/ (prints JSON)")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from kvbridge.engine.llm import LLM, completion  # deferred: torch import is slow and `--help` should not pay for it
    from kvbridge.pipeline.group import RankGroup

    if not (args.prompt or args.chat or args.prompt_ids):
        raise UsageError("give at least one of --prompt, --chat, --prompt-ids")
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
            stop_token_ids=tuple(args.stop_token_ids),
            ignore_eos=args.ignore_eos,
            min_tokens=args.min_tokens,
        )
        config, pp = from_flags(EngineConfig, args), from_flags(PPConfig, args)
        if pp.enable_dynamic_chunking and config.chunked_prefill_size < 1:
            raise ValueError("--enable-dynamic-chunking needs --chunked-prefill-size > 0")
        if pp.pp_size == 1:
            engine = LLM(config, progress=not args.quiet)
            if pp.enable_dynamic_chunking:
                engine.enable_dynamic_chunking(progress=not args.quiet)
        else:
            engine = RankGroup(config, pp, progress=not args.quiet)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    try:
        if pp.local_ranks.start != 0:  # a host without rank 0 only lends its ranks
            for proc in engine.procs:
                proc.join()
            return 0
        tok = engine.model.tokenizer
        if (args.prompt or args.chat) and tok is None:
            raise UsageError(f"model {args.model!r} has no tokenizer; use --prompt-ids")
        prompts = [tok.encode(p) for p in args.prompt]
        prompts += [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in args.chat]
        prompts += args.prompt_ids
        try:
            if pp.pp_size == 1:
                reqs = [engine.add_request(p, params) for p in prompts]
                while engine.scheduler.num_unfinished:
                    engine.step()
                results = [completion(r) for r in reqs]
            else:
                results = engine.generate(prompts, params)
        except ValueError as e:
            raise UsageError(str(e)) from None
    finally:
        if pp.pp_size > 1:
            engine.shutdown()
    for c in results:
        if args.json:
            print(
                json.dumps(
                    {
                        "rid": c.rid,
                        "prompt_tokens": c.prompt_tokens,
                        "output_ids": c.output_ids,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "ttft_s": round(c.ttft_s, 4),
                        "e2e_s": round(c.e2e_s, 4),
                        "tokens_per_s": round(c.tokens_per_s, 2),
                    }
                )
            )
        else:
            print(c.text if tok is not None else " ".join(map(str, c.output_ids)))
    return 0


def stop_on_signal():
    """An event set by SIGINT or SIGTERM; install it before announcing readiness."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_node(args: argparse.Namespace) -> int:
    """`kvbridge serve|prefill|decode`: a node with its gRPC server, until SIGINT or SIGTERM.
    The server is bound first (health NOT_SERVING, Admin answering) and serves once the ranks are up."""
    from kvbridge.common import logs, rpc, security, tracing

    http_port = getattr(args, "http_port", -1)  # (kvbridge serve only)
    if not -1 <= http_port < 65536:
        raise UsageError(f"--http-port must be in [0, 65535] (or -1: off), got {http_port}")
    try:  # before any server or channel exists; the ranks get it from the node
        rpc.configure(security.from_flags(args, api_key_file=getattr(args, "api_key_file", "")))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not args.shutdown_grace_s >= 0:
        raise UsageError(f"--shutdown-grace-s must be >= 0, got {args.shutdown_grace_s}")
    try:
        logs.setup(args.log_level)
        # (before the ranks start: they take the settings from the environment)
        tracing.setup(f"kvbridge-{args.command}", args.otlp_traces_endpoint, args.otlp_traces_sample_ratio)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from kvbridge.nodes import COMMANDS, bind_node, load_node
    from kvbridge.serving.config import NodeConfig

    role, progress = COMMANDS[args.command].name, not args.quiet
    try:
        config = from_flags(NodeConfig, args, engine=from_flags(EngineConfig, args), pp=from_flags(PPConfig, args))
        server = bind_node(role, config)
    except (ValueError, FileNotFoundError) as e:  # a bad value, or the port is taken
        raise UsageError(str(e)) from None
    stop = stop_on_signal()
    metrics = f", metrics on {args.host}:{server.metrics_port}" if server.metrics_port >= 0 else ""
    print(f"kvbridge {args.command}: bound {server.address}{metrics}; loading", file=sys.stderr, flush=True)
    try:
        load_node(server, role, config, progress)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    except RuntimeError as e:  # a rank failed or died while starting: exit non-zero, as on a death later
        print(f"kvbridge {args.command}: error: {e}", file=sys.stderr, flush=True)
        tracing.shutdown()
        return 1
    http = None
    if http_port >= 0:
        from kvbridge.router.cli import start_http_api

        try:
            http = start_http_api(server.address, args.host, http_port)
        except ValueError as e:  # the port is taken
            server.stop(grace_s=0)
            raise UsageError(str(e)) from None
        metrics = f", http on {args.host}:{http.http_port}{metrics}"
    print(f"kvbridge {args.command}: listening on {server.address}{metrics}", file=sys.stderr, flush=True)
    server.on_death = stop.set
    stop.wait()
    if http is not None:  # (first: it stops taking requests, and those in flight finish on the node)
        http.stop(grace_s=0 if server.dead else args.shutdown_grace_s)
    if server.dead:  # its streams are failed already; a supervisor restarts a node that exits non-zero
        print(f"kvbridge {args.command}: error: pipeline rank {server.dead[0]} died", file=sys.stderr, flush=True)
        server.stop(grace_s=0)
        tracing.shutdown()
        return 1
    server.shutdown_gracefully(args.shutdown_grace_s)
    tracing.shutdown()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvbridge.demo import run_demo

    return run_demo(args)


BENCHES = (
    "engine", "consensus", "pp", "kv_transfer", "soak", "serve", "prefix", "sampling", "choices", "hostile_sampling",
    "router_memory", "startup", "decode_budget",
)  # fmt: skip


def cmd_bench(args: argparse.Namespace) -> int:
    from kvbridge.bench import (
        choices,
        consensus,
        decode_budget,
        engine,
        hostile_sampling,
        kv_transfer,
        pp,
        prefix,
        router_memory,
        sampling,
        serve,
        soak,
        startup,
    )

    mains = {
        "engine": engine,
        "consensus": consensus,
        "pp": pp,
        "kv_transfer": kv_transfer,
        "soak": soak,
        "serve": serve,
        "prefix": prefix,
        "sampling": sampling,
        "choices": choices,
        "hostile_sampling": hostile_sampling,
        "router_memory": router_memory,
        "startup": startup,
        "decode_budget": decode_budget,
    }
    return mains[args.name].main(args.rest)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"generate": cmd_generate, "serve": cmd_node, "prefill": cmd_node, "decode": cmd_node}
        commands |= {"bench": cmd_bench, "router": lambda a: a.func(a), "demo": cmd_demo, "admin": lambda a: a.func(a)}
        return commands[args.command](args)
    except UsageError as e:
        print(f"kvbridge {args.command}: error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The console script: main(), then exit without interpreter finalization. Everything was
    stopped and flushed by then; finalization would only destroy gRPC's and gloo's native
    threads underneath them, which can abort the process ("terminate called ...") on exit."""
    import multiprocessing.util
    import os

    code = main()
    # multiprocessing's own exit hook: releases its semaphores (else its resource tracker warns)
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
