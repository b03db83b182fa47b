"""`kvbridge router`: flags built from RouterConfig, so every default and help text lives there."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import fields

from kvbridge.common.logs import LEVELS
from kvbridge.common.security import add_tls_flags
from kvbridge.common.tracing import add_tracing_flags
from kvbridge.router.config import RouterConfig

GIL_SWITCH_S = 0.001  # sys.setswitchinterval of a router process (see run_router)


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
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        parser.add_argument(flag, default=str(default), metavar=metavar, help=text + shown)
    parser.add_argument("--log-level", default="info", choices=LEVELS, help="log level (default: info)")
    add_tls_flags(parser)
    add_tracing_flags(parser)
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


def start_http_api(node_address: str, host: str, http_port: int):
    """The OpenAI-compatible HTTP API of one colocated node, served from the node's own process
    (`kvbridge serve --http-port`): the router's HTTP front over that node alone, no gRPC port of
    its own (the node's has Admin and health). The caller configured rpc security (its API key)."""
    from kvbridge.common import heap
    from kvbridge.router.server import start_router

    heap.map_large_blocks()
    sys.setswitchinterval(GIL_SWITCH_S)
    return start_router(RouterConfig(host=host, port=-1, http_port=http_port, colocated=(node_address,)))


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM. Bad flag values: one line on stderr, exit status 2."""
    from kvbridge.common import heap, rpc, security, tracing
    from kvbridge.common.logs import setup as setup_logs
    from kvbridge.router.server import start_router

    heap.map_large_blocks()  # (a body of a few MiB goes back to the system when it is freed)
    # the event loop's thread waits at most this long for the GIL while the parser or tokenizer
    # threads run Python (5 ms by default: a /health answer takes a dozen waits)
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        rpc.configure(security.from_flags(args, api_key_file=args.api_key_file))
        setup_logs(args.log_level)
        tracing.setup("kvbridge-router", args.otlp_traces_endpoint, args.otlp_traces_sample_ratio)
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
    tracing.shutdown()
    return 0
