"""`kvbridge router`: flags built from RouterConfig, so every default lives there."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import fields

from router.config import RouterConfig

_HELP = {
    "host": "address both servers bind",
    "port": "gRPC port: Generation, Admin, health, reflection (0: a free one, printed when ready)",
    "http_port": "OpenAI-compatible HTTP port (0: a free one, printed when ready)",
    "colocated": "nodes serving Generation themselves (kvbridge serve), HOST:PORT[,HOST:PORT..]",
    "prefill": "prefill nodes, HOST:PORT[,HOST:PORT..] (with --decode)",
    "decode": "decode nodes, HOST:PORT[,HOST:PORT..] (with --prefill)",
    "request_timeout_s": "deadline of each upstream Generate / Prefill call, seconds",
    "health_retry_s": "pause before re-checking a node whose health check failed, seconds",
    "startup_wait_s": "wait at most this long at start for every node's first health report, seconds",
    "grpc_workers": "gRPC handler threads: client streams served at once",
}


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    """The `router` subcommand. Values are parsed by run_router, so that a bad one is one line."""
    parser = subparsers.add_parser("router", help="the front door: gRPC and OpenAI-compatible HTTP over the nodes")
    for f in fields(RouterConfig):
        default = ",".join(f.default) if isinstance(f.default, tuple) else f.default
        shown = f" (default: {default})" if default != "" else ""
        metavar = "ADDRS" if isinstance(f.default, tuple) else type(f.default).__name__.upper()
        parser.add_argument(
            "--" + f.name.replace("_", "-"), default=str(default), metavar=metavar, help=_HELP[f.name] + shown
        )
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
    from router.server import start_router

    try:
        config = config_from_args(args)
        router = start_router(config)
    except ValueError as e:
        print(f"kvbridge router: error: {e}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"kvbridge router: grpc on {config.host}:{router.port}, http on {config.host}:{router.http_port}",
        file=sys.stderr,
        flush=True,
    )
    stop.wait()
    router.stop()
    return 0
