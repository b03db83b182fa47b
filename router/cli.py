"""`kvbridge router`: flags built from RouterConfig, so every default lives there."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import fields

from common.logs import LEVELS
from common.security import add_tls_flags
from router.config import RouterConfig

GIL_SWITCH_S = 0.001  # sys.setswitchinterval of a router process (see run_router)

_HELP = {
    "host": "address every server binds (gRPC, HTTP, metrics)",
    "port": "gRPC port: Generation, Admin (unless --admin-port), health, reflection (0: a free one, printed when "
    "ready)",
    "http_port": "OpenAI-compatible HTTP port (0: a free one, printed when ready)",
    "colocated": "nodes serving Generation themselves (kvbridge serve), HOST:PORT[,HOST:PORT..]",
    "prefill": "prefill nodes, HOST:PORT[,HOST:PORT..]; disaggregated requests need a prefill and a decode node",
    "decode": "decode nodes, HOST:PORT[,HOST:PORT..]; disaggregated requests need a prefill and a decode node",
    "discover": "nodes found in DNS, ROLE=NAME:PORT[,ROLE=NAME:PORT..] (a headless Service: one address per pod), "
    "resolved again every --discover-interval-s; an address gone from the answer is removed",
    "discover_interval_s": "how often every --discover name is resolved again, seconds",
    "request_timeout_s": "deadline of each upstream Generate / Prefill call, seconds",
    "max_attempts": "tries of a request in all: one that a node fails before any token reached the client "
    "(UNAVAILABLE, RESOURCE_EXHAUSTED, a node timeout, no first token in time) is tried again on other nodes",
    "max_migrations": "times a stream whose node fails after tokens reached the client is moved to another pair "
    "(resubmitted as prompt + the tokens sent; the client's stream goes on, nothing repeated or lost); 0: never",
    "retry_backoff_s": "pause before the first retry, doubling for each next one (at most 1 s), seconds",
    "first_token_timeout_s": "cancel an attempt that got no first token within this and retry it elsewhere "
    "(the last attempt fails with DEADLINE_EXCEEDED), seconds; 0: off",
    "idle_stream_timeout_s": "fail a stream (DEADLINE_EXCEEDED) whose node sent nothing for this long after the "
    "first token, seconds; 0: off",
    "health_retry_s": "pause before re-checking a node whose health check failed, seconds",
    "startup_wait_s": "wait at most this long at start for every node's first health report, seconds",
    "metrics_port": "Prometheus /metrics port (-1: off; 0: a free one, printed when ready)",
    "max_concurrent_requests": "HTTP requests handled at once; one more is answered 503 with Retry-After at once",
    "max_body_bytes": "the largest HTTP request body, bytes; a larger one is answered 413 (chunked bodies too)",
    "max_answer_bytes": "the largest non-streamed HTTP answer (its JSON), bytes: one growing past it ends with a 400 "
    "naming this limit and its requests are cancelled at the nodes; streamed answers are not held and have no limit",
    "http_header_timeout_s": "close an HTTP connection whose request headers are not in this long after it opened or "
    "after its last response, seconds",
    "http_body_timeout_s": "answer 408 to an HTTP request whose body is not in this long after its headers, seconds",
    "http_keep_alive_s": "close an HTTP connection idle this long after a response (at most --http-header-timeout-s), "
    "seconds",
    "routing": "how nodes are picked: cache_aware (the node with the least of the prompt left to compute, by the "
    "nodes' KV events; decode nodes by load, then cached prefix), least_loaded (fewest outstanding requests) or "
    "round_robin",
    "balance_abs_threshold": "cache_aware routes least-loaded while a role's nodes are imbalanced: max - min "
    "outstanding requests above this, and max above --balance-rel-threshold times min",
    "balance_rel_threshold": "the ratio of max to min outstanding requests above which (with --balance-abs-threshold) "
    "cache_aware routes least-loaded",
}


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    """The `router` subcommand. Values are parsed by run_router, so that a bad one is one line."""
    parser = subparsers.add_parser(
        "router",
        help="the front door: gRPC and OpenAI-compatible HTTP over the nodes",
        description="Any fleet may be given, none included: nodes can be added and removed at run time "
        "(Admin.AddNode / RemoveNode); the router is NOT_SERVING while no request could be routed.",
    )
    for f in fields(RouterConfig):
        default = ",".join(f.default) if isinstance(f.default, tuple) else f.default
        shown = f" (default: {default})" if default != "" else ""
        metavar = "ADDRS" if isinstance(f.default, tuple) else type(f.default).__name__.upper()
        text = f.metadata["help"] if "help" in f.metadata else _HELP[f.name]  # (fields declared with `setting`)
        parser.add_argument("--" + f.name.replace("_", "-"), default=str(default), metavar=metavar, help=text + shown)
    parser.add_argument("--log-level", default="info", choices=LEVELS, help="log level (default: info)")
    add_tls_flags(parser)
    parser.add_argument(
        "--api-key-file", default="", metavar="FILE",
        help="Generation (gRPC) and the HTTP API need Authorization: Bearer KEY with this file's key; off when absent",
    )  # fmt: skip
    parser.set_defaults(func=run_router)
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from the flag strings; ValueError naming the flag and the value."""
    values = {}
    for f in fields(RouterConfig):
        raw, flag = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if isinstance(f.default, tuple):
            values[f.name] = tuple(a.strip() for a in raw.split(",") if a.strip())
            continue
        try:
            values[f.name] = type(f.default)(raw)
        except ValueError:
            kind = (
                "an integer" if isinstance(f.default, int) else "a number" if isinstance(f.default, float) else "text"
            )
            raise ValueError(f"{flag} must be {kind}, got {raw!r}") from None
    try:
        return RouterConfig(**values)
    except ValueError as e:  # name the flag, not the field
        message = str(e)
        for f in fields(RouterConfig):
            if message.startswith(f.name + " ") or message.startswith(f.name + ":"):
                message = "--" + f.name.replace("_", "-") + message[len(f.name) :]
        raise ValueError(message) from None


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM. Bad flag values: one line on stderr, exit status 2."""
    from common import heap, rpc, security
    from common.logs import setup as setup_logs
    from router.server import start_router

    heap.map_large_blocks()  # (a body of a few MiB goes back to the system when it is freed)
    # the event loop's thread waits at most this long for the GIL while the parser or tokenizer
    # threads run Python (5 ms by default: a /health answer takes a dozen waits)
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        rpc.configure(security.from_flags(args, api_key_file=args.api_key_file))
        setup_logs(args.log_level)
        config = config_from_args(args)
        router = start_router(config)
    except ValueError as e:
        print(f"kvbridge router: error: {e}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if router.admin_port >= 0:  # (a line of its own: the ready line's form stays as scripts read it)
        print(f"kvbridge router: admin on {config.host}:{router.admin_port}", file=sys.stderr, flush=True)
    ready = f"kvbridge router: grpc on {config.host}:{router.port}, http on {config.host}:{router.http_port}"
    if router.metrics_port >= 0:
        ready += f", metrics on {config.host}:{router.metrics_port}"
    print(ready, file=sys.stderr, flush=True)
    stop.wait()
    router.stop()
    return 0
