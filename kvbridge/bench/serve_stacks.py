"""The stacks bench serve measures: a router over one colocated node, or over one prefill node and
one decode node.

- `start_in_process`: the nodes' fronts in this process, their ranks in child processes (as
  kvbridge/bench/soak.py starts its fleet).
- `start_pinned`: every node a `kvbridge serve|prefill|decode` child process pinned to a set of
  cores (os.sched_setaffinity before it execs; its rank processes inherit the mask), its address
  read from the "listening on ADDR" line it prints on stderr when ready.
The router always runs in this process, unpinned.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"kvbridge (?:serve|prefill|decode): listening on (\S+?)(?:,|$)")
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Stack:
    name: str  # "colocated" | "disaggregated"
    router: object  # router.server.Router
    nodes: list = field(default_factory=list)  # what .stop() is called on after the router, in order
    layout: dict = field(default_factory=dict)  # pp sizes (and cores when pinned), as reported

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.http_port}"

    def stop(self) -> None:
        for thing in [self.router, *self.nodes]:
            try:
                thing.stop()
            except Exception as e:  # stop the others all the same
                print(f"bench serve: stopping the {self.name} stack: {type(e).__name__}: {e}", file=sys.stderr)


def _router(name: str, addresses: dict, request_timeout_s: float):
    from kvbridge.router.config import RouterConfig
    from kvbridge.router.server import start_router

    return start_router(RouterConfig(port=0, http_port=0, request_timeout_s=request_timeout_s, **addresses))


def _start_all(starters: list) -> list:
    """Run the start functions at once; if one fails, stop the others and raise its error."""
    with ThreadPoolExecutor(len(starters)) as pool:
        futures = [pool.submit(f) for f in starters]
        errors = [f.exception() for f in futures]
    if any(errors):
        for f, e in zip(futures, errors):
            if e is None:
                f.result().stop()
        raise next(e for e in errors if e is not None)
    return [f.result() for f in futures]


def start_in_process(name: str, config, pp: int, prefill_pp: int, decode_pp: int, request_timeout_s: float) -> Stack:
    from kvbridge.engine.config import PPConfig

    if name == "colocated":
        from kvbridge.nodes import start_node
        from kvbridge.serving.config import NodeConfig

        [node] = _start_all([lambda: start_node("colocated", NodeConfig(config, PPConfig(pp_size=pp)))])
        nodes, addresses, layout = [node], {"colocated": (node.address,)}, {"pp": pp}
    else:
        from kvbridge.nodes import start_node
        from kvbridge.serving.config import NodeConfig

        p, d = _start_all(
            [
                lambda: start_node("prefill", NodeConfig(config, PPConfig(pp_size=prefill_pp))),
                lambda: start_node("decode", NodeConfig(config, PPConfig(pp_size=decode_pp))),
            ]
        )
        nodes, addresses = [d, p], {"prefill": (p.address,), "decode": (d.address,)}
        layout = {"prefill_pp": prefill_pp, "decode_pp": decode_pp}
    try:
        router = _router(name, addresses, request_timeout_s)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return Stack(name, router, nodes, layout)


# ---------------------------------------------------------------------------- pinned child processes

_EXEC_PINNED = (
    "import os, sys; os.sched_setaffinity(0, {cores}); "
    "os.execv(sys.executable, [sys.executable, '-m', 'kvbridge', *sys.argv[1:]])"
)


class PinnedNode:
    """`kvbridge ROLE` in a child process restricted to `cores`; .address once ready; .stop() SIGTERMs it."""

    def __init__(self, role: str, cores: set[int], flags: list[str]):
        self.role = role
        self.tail: deque[str] = deque(maxlen=40)  # its latest stderr lines, for error messages
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        argv = [sys.executable, "-c", _EXEC_PINNED.format(cores=sorted(cores)), role, "--port", "0", *flags]
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.address = ""
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"bench-serve-{role}-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip())
            m = READY.search(line)
            if m and not self.address:
                self.address = m.group(1)
                self._ready.set()
        self._ready.set()  # it exited

    def wait_ready(self) -> None:
        self._ready.wait(START_TIMEOUT_S)
        if not self.address:
            self.stop()
            raise RuntimeError(f"kvbridge {self.role} did not start: " + " | ".join(list(self.tail)[-5:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=5)


def start_pinned(
    name: str, engine_flags: list[str], cores: list[int], pp: int, prefill_pp: int, decode_pp: int, timeout_s: float
) -> Stack:
    """colocated: one node on every core in `cores`; disaggregated: the prefill node on cores[0],
    the decode node on cores[1]. Torch threads per rank: the node's cores over its ranks."""

    def flags(n_cores: int, pp_size: int) -> list[str]:
        common = ["--log-level", "error", "--quiet", "--shutdown-grace-s", "5", *engine_flags]
        return [*common, "--pp-size", str(pp_size), "--threads", str(max(1, n_cores // pp_size))]

    if name == "colocated":
        nodes = [PinnedNode("serve", set(cores), flags(len(cores), pp))]
        layout = {"pp": pp, "cores": cores}
    else:
        nodes = [
            PinnedNode("decode", {cores[1]}, flags(1, decode_pp)),
            PinnedNode("prefill", {cores[0]}, flags(1, prefill_pp)),
        ]
        layout = {
            "prefill_pp": prefill_pp,
            "decode_pp": decode_pp,
            "prefill_cores": cores[:1],
            "decode_cores": cores[1:2],
        }
    return _route_to(name, nodes, layout, timeout_s)


def _route_to(name: str, nodes: list, layout: dict, timeout_s: float) -> Stack:
    """The stack, once its child nodes are ready and a router serves them."""
    try:
        for n in nodes:
            n.wait_ready()
        by_role = {n.role: (n.address,) for n in nodes}
        addresses = {"colocated": by_role["serve"]} if name == "colocated" else by_role
        router = _router(name, addresses, timeout_s)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return Stack(name, router, nodes, layout)


def start_unpinned(
    name: str, engine_flags: list[str], pp: int, prefill_pp: int, decode_pp: int, timeout_s: float
) -> Stack:
    """Like start_pinned, but every node may use every core this process may (as deployed on one host)."""
    cores = sorted(os.sched_getaffinity(0))
    common = ["--log-level", "error", "--quiet", "--shutdown-grace-s", "5", *engine_flags]
    if name == "colocated":
        nodes, layout = [PinnedNode("serve", set(cores), [*common, "--pp-size", str(pp)])], {"pp": pp}
    else:
        nodes = [
            PinnedNode("decode", set(cores), [*common, "--pp-size", str(decode_pp)]),
            PinnedNode("prefill", set(cores), [*common, "--pp-size", str(prefill_pp)]),
        ]
        layout = {"prefill_pp": prefill_pp, "decode_pp": decode_pp}
    return _route_to(name, nodes, layout | {"processes": "kvbridge CLI children, unpinned"}, timeout_s)


def wait_healthy(stack: Stack, timeout_s: float = 30.0) -> None:
    """Until the router's /health answers 200 (its nodes reported SERVING)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(stack.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {stack.name} router at {stack.url} is not healthy after {timeout_s:g}s")
        time.sleep(0.2)
