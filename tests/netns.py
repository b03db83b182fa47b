"""Hosts for real on one machine: Linux network namespaces joined by a bridge.

A "switch" namespace holds a Linux bridge; each host is a namespace of its own joined to it by a
veth pair, with one address (172.31.213.N/24 on its `eth0`) and `lo` up. Nothing is added to the root
namespace, so the test process has no address on this network: clients run inside a host, as this
file run as a script (`Host.client`: one command, its answer as JSON on stdout). Names carry the
pid (and a count per process); `Network.close` kills every process a host started, then deletes
every namespace (each veth goes with it), also after a failure, and a new Network first deletes
what a killed run left behind.

    net = Network(["prefill", "decode"])     # pytest.skip, naming the command, where none can be made
    p = net["prefill"].start(KVBRIDGE, "prefill", "--host", net["prefill"].address, "--port", "0")
    p.wait_ready()                           # "kvbridge prefill: listening on ADDR"
    net["decode"].client("status", p.address)
    net.link_down(net["prefill"]); net.link_up(net["prefill"])
    net.close()

Client commands (each prints one JSON value): `generate TARGET REQUESTS` (REQUESTS: a JSON list of
{"rid", "prompt", "sampling"}; the streams run at once; each result has its tokens, the first
response's transfer backend, the status code and details of a failure and time.monotonic() when it
ended: one clock for every namespace), `status TARGET...`, `wait_idle TIMEOUT TARGET...` and
`wait_phase TIMEOUT TARGET RID PHASE PEER [TARGET RID PHASE PEER]...` (Admin).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# Hosts are SUBNET.1, SUBNET.2, ... (/24), inside the network's namespaces only. Above 127.0.0.1 on
# purpose: of a gloo pair, the side with the higher address dials the other (gloo's tcp
# Device::isInitiator), so a rank that announces 127.0.0.1 (its host name's address) to a peer here is
# dialled there and the pair fails, where under 127 it would dial out itself and work by luck.
SUBNET = "172.31.213"
PREFIX = "kvb"  # every namespace this file makes is named kvb{pid}n{count}-{role}
START_TIMEOUT_S = 120
_count = itertools.count()


IP = shutil.which("ip") or "/usr/sbin/ip"


class CommandError(RuntimeError):
    pass


def ip(*args: str) -> str:
    """`ip ARGS`; CommandError naming the command and its stderr when it fails."""
    r = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise CommandError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2][:3]
    except OSError:
        return False


def remove_stale() -> None:
    """Delete the namespaces of runs whose process is gone (killed before their teardown), after
    killing what still runs in them."""
    with contextlib.suppress(CommandError, OSError, subprocess.TimeoutExpired):
        for line in ip("netns", "list").splitlines():
            name = line.split()[0] if line.split() else ""
            m = re.fullmatch(rf"{PREFIX}(\d+)n\d+-.+", name)
            if m and not _running(int(m[1])):
                for pid in ip("netns", "pids", name).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                ip("netns", "del", name)


class Proc:
    """A command run in a host (`ip netns exec NS ARGV`, which execs it: the pid is the command's),
    in a session of its own; its stderr drained by a thread, its ready line read for the addresses
    it bound: `kvbridge ROLE: listening on ADDR` (nodes), `kvbridge router: grpc on ADDR, http on
    ADDR`."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.addresses: tuple[str, ...] = ()
        self.lines: list[str] = []  # its stderr, every line
        self._ready = threading.Event()
        threading.Thread(target=self._drain, name=f"stderr-{name}", daemon=True).start()

    def _drain(self) -> None:
        ready = re.compile(r"^kvbridge \w+: (?:listening on|grpc on) ([^,\s]+)(?:, http on ([^,\s]+))?")
        for line in self.proc.stderr:
            self.lines.append(line)
            if not self._ready.is_set() and (m := ready.match(line)):
                self.addresses = tuple(a for a in m.groups() if a)
                self._ready.set()
        self._ready.set()  # EOF: it exited

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Proc:
        ready = self._ready.wait(timeout) and self.addresses
        assert ready, f"{self.name} not ready within {timeout} s:\n{''.join(self.lines[-40:])}"
        return self

    @property
    def address(self) -> str:
        return self.addresses[0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, then SIGKILL of its whole session (rank processes included)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class Host:
    """One network namespace on the network: its address, and the processes started in it."""

    def __init__(self, network: Network, role: str, index: int):
        self.role = role
        self.ns = f"{network.name}-{role}"
        self.address = f"{SUBNET}.{index}"
        self.port = f"v{os.getpid()}n{network.number}h{index}"  # its veth's end in the switch (<= 15 chars)
        self.procs: list[Proc] = []

    def argv(self, *command: str) -> list[str]:
        return [IP, "netns", "exec", self.ns, *command]

    def start(self, *command: str, name: str = "") -> Proc:
        """A process in this host (see Proc); Network.close stops it."""
        proc = Proc(name or f"{self.role}/{Path(command[0]).name}", self.argv(*command))
        self.procs.append(proc)
        return proc

    def client(self, *args: str, timeout: float = 60) -> object:
        """This file's client command run inside this host: what it printed, as JSON."""
        argv = self.argv(sys.executable, str(Path(__file__).resolve()), *args)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"client {args[0]} in {self.role} failed ({r.returncode}):\n{r.stderr[-4000:]}"
        return json.loads(r.stdout)

    def client_async(self, *args: str) -> ClientCall:
        """The same, in the background: `.result()` waits for it."""
        return ClientCall(self, args)


class ClientCall:
    """Host.client in a thread."""

    def __init__(self, host: Host, args: tuple[str, ...]):
        self._args = args
        self._outcome: list = []  # [value] or [None, exception]
        self.thread = threading.Thread(target=self._run, args=(host,), daemon=True)
        self.thread.start()

    def _run(self, host: Host) -> None:
        try:
            self._outcome = [host.client(*self._args)]
        except BaseException as e:  # (raised again by result())
            self._outcome = [None, e]

    def result(self, timeout: float = 60) -> object:
        self.thread.join(timeout)
        assert self._outcome, f"client {self._args[0]} did not end within {timeout} s"
        if len(self._outcome) == 2:
            raise self._outcome[1]
        return self._outcome[0]


class Network:
    """A switch namespace (a bridge) and one host namespace per role, each joined to it by a veth
    pair. Skips the test (pytest.skip naming the command) only where namespaces cannot be made."""

    def __init__(self, roles: list[str]):
        import pytest  # (here: the client commands below never need it)

        self.number = next(_count)
        self.name = f"{PREFIX}{os.getpid()}n{self.number}"
        self.switch = f"{self.name}-switch"
        self.hosts = {role: Host(self, role, i) for i, role in enumerate(roles, start=1)}
        self._made: list[str] = []  # namespaces made, deleted by close()
        self._closed = False
        if os.geteuid() != 0:
            pytest.skip(f"network namespaces need root (`ip netns add` as uid {os.geteuid()})")
        if not Path(IP).exists():
            pytest.skip(f"no `ip` command (iproute2) at {IP}")
        remove_stale()
        try:
            ip("netns", "add", self.switch)
        except CommandError as e:
            pytest.skip(f"cannot make a network namespace here: {e}")
        self._made.append(self.switch)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            ip("netns", "add", host.ns)
            self._made.append(host.ns)
            # both ends are made inside their namespaces: the root namespace never sees them
            ip("link", "add", host.port, "netns", self.switch, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            ip("-n", self.switch, "link", "set", host.port, "master", "br0")
            ip("-n", self.switch, "link", "set", host.port, "up")
            ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            ip("-n", host.ns, "link", "set", "eth0", "up")
            ip("-n", host.ns, "link", "set", "lo", "up")

    def __getitem__(self, role: str) -> Host:
        return self.hosts[role]

    def link_down(self, host: Host) -> None:
        """Pull the host's cable at the switch: its packets are dropped, nothing is reset."""
        ip("-n", self.switch, "link", "set", host.port, "down")

    def link_up(self, host: Host) -> None:
        ip("-n", self.switch, "link", "set", host.port, "up")

    def processes(self) -> list[Proc]:
        return [p for host in self.hosts.values() for p in host.procs]

    def close(self) -> None:
        """Stop every process (routers first, all at once), then delete every namespace. Idempotent;
        safe from a timer thread (the hard timeout's before_hard_exit)."""
        if self._closed:
            return
        self._closed = True
        procs = sorted(self.processes(), key=lambda p: "router" not in p.name)
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            p.stop(timeout=20)
        for ns in reversed(self._made):
            with contextlib.suppress(CommandError, subprocess.TimeoutExpired):
                ip("netns", "del", ns)


# ---------------------------------------------------------------------- the client, run in a host


def _generate(target: str, requests: list[dict]) -> list[dict]:
    import grpc
    from google.protobuf import json_format

    from kvbridge.common import rpc
    from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(target))
    results: list[dict] = [{} for _ in requests]

    def run(i: int, spec: dict) -> None:
        req = generation_pb2.GenerateRequest(
            rid=spec.get("rid", ""),
            prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=spec["prompt"])),
            sampling=json_format.ParseDict(spec["sampling"], common_pb2.SamplingParams()),
        )
        out = {"tokens": [], "backend": None, "code": "OK", "details": "", "finish_reason": ""}
        try:
            for n, resp in enumerate(stub.Generate(req, timeout=spec.get("timeout", 60))):
                if n == 0 and resp.HasField("transfer"):
                    out["backend"] = resp.transfer.backend
                out["tokens"] += list(resp.token_ids)
                out["finish_reason"] = resp.finish_reason or out["finish_reason"]
        except grpc.RpcError as e:
            out["code"], out["details"] = e.code().name, e.details()
        out["ended"] = time.monotonic()
        results[i] = out

    threads = [threading.Thread(target=run, args=(i, spec)) for i, spec in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@functools.cache
def _admin(target: str):
    from kvbridge.common import rpc
    from kvbridge.v1 import admin_pb2_grpc

    return admin_pb2_grpc.AdminStub(rpc.make_channel(target))


def _status(target: str) -> dict:
    from kvbridge.v1 import admin_pb2

    st = _admin(target).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    return {
        "role": st.role,
        "pages_used": [r.kv_pages_used for r in st.ranks],
        "queues": dict(st.queues),
        "requests_in_flight": st.requests_in_flight,
        "transfers_in_flight": st.transfers_in_flight,
    }


def _idle(status: dict) -> bool:
    return not any(status["pages_used"]) and not any(status["queues"].values()) and not status["requests_in_flight"]


def _wait_idle(timeout: float, targets: list[str]) -> list[dict]:
    """Every target's status once each is idle (no page used, empty queues, nothing in flight), or at
    the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = [_status(t) for t in targets]
        if all(_idle(s) for s in statuses) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.1)


def _wait_phase(timeout: float, wanted: list[tuple[str, ...]]) -> list[dict]:
    """Once each (target, rid, phase, peer) holds at once: each request's info there. SystemExit at
    the timeout."""
    from kvbridge.v1 import admin_pb2

    deadline = time.monotonic() + timeout
    while True:
        found = []
        for target, rid, _, _ in wanted:
            reqs = _admin(target).ListRequests(admin_pb2.ListRequestsRequest(), timeout=10).requests
            found += [{"target": target, "rid": r.rid, "phase": r.phase, "peer": r.peer} for r in reqs if r.rid == rid]
        if [(f["target"], f["rid"], f["phase"], f["peer"]) for f in found] == wanted:
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"not all of {wanted} within {timeout} s; last seen {found}")
        time.sleep(0.02)


def main(argv: list[str]) -> None:
    command, args = argv[0], argv[1:]
    if command == "generate":
        out = _generate(args[0], json.loads(args[1]))
    elif command == "status":
        out = [_status(t) for t in args]
    elif command == "wait_idle":
        out = _wait_idle(float(args[0]), args[1:])
    elif command == "wait_phase":
        out = _wait_phase(float(args[0]), [tuple(args[i : i + 4]) for i in range(1, len(args), 4)])
    else:
        raise SystemExit(f"unknown client command {command!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization: it can abort under gRPC's native threads (as kvbridge.cli.run says)
