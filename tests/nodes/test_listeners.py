"""With default flags (`--host 127.0.0.1`), no process of a fleet listens beyond loopback: the
gRPC and HTTP servers, /metrics, each rank's pipeline rendezvous and gloo pairs, and the TCPStore
of every decode rank that can receive over the torch engine. Read from /proc/net/tcp{,6} while
the fleet serves a request over each transfer engine."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_load import Process, process_tree, stop_all

ENGINES = ("shm", "torch", "grpc")
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
NODE = ("--model", "tiny-random", "--port", "0", "--pp-size", "2", "--metrics-port", "0", "--log-level", "warning")


def listening_sockets(pids: dict[str, int]) -> list[tuple[str, str, int]]:
    """(process label, local address, port) of every TCP socket in LISTEN state the processes hold,
    each read from its own network namespace's tables (/proc/PID/net/tcp{,6})."""
    found = []
    for label, pid in pids.items():
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                host, port = local.split(":")
                raw = bytes.fromhex(host)  # the kernel's words, each little-endian
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                address = socket.inet_ntop(family, raw).removeprefix("::ffff:")  # (IPv4 on an IPv6 socket)
                found.append((label, address, int(port, 16)))
    return found


@pytest.fixture(scope="module")
def fleet():
    started: list[Process] = []
    try:
        nodes = {"prefill": Process("prefill", "prefill", *NODE), "colocated": Process("colocated", "serve", *NODE)}
        nodes |= {f"decode-{e}": Process(f"decode-{e}", "decode", *NODE, "--transfer-backend", e) for e in ENGINES}
        started += nodes.values()
        for n in nodes.values():
            n.wait_ready()
        routers = {}
        for e in ENGINES:
            flags = ("--prefill", nodes["prefill"].address, "--decode", nodes[f"decode-{e}"].address)
            routers[f"router-{e}"] = Process(f"router-{e}", "router", *flags, "--port", "0", "--http-port", "0",
                                             "--metrics-port", "0", "--log-level", "warning")  # fmt: skip
        started += routers.values()
        for r in routers.values():
            r.wait_ready()
        yield nodes, routers
    finally:
        stop_all(started)


def test_every_listening_socket_of_every_fleet_process_is_on_loopback(fleet):
    nodes, routers = fleet
    for e in ENGINES:  # each engine's connections open: every listener the fleet will ever have exists now
        body = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        resp = httpx.post(f"http://127.0.0.1:{routers[f'router-{e}'].http_port}/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
    pids = process_tree({name: p.proc.pid for name, p in {**nodes, **routers}.items()})
    sockets = listening_sockets(pids)
    assert {label.split("/")[0] for label, _, _ in sockets} == {*nodes, *routers}  # (the reading works)
    assert [s for s in sockets if s[1] not in LOOPBACK] == []
    ranks_listening = {label for label, _, _ in sockets if "/rank" in label}
    assert {"decode-torch/rank", "decode-torch/rank2"} <= ranks_listening  # (their stores, on loopback)
