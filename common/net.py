"""Sockets and torch.distributed plumbing that listen on one address only.

torch's TCPStore, given a host name, listens on every interface, and a gloo group's transport on
whatever the machine's host name resolves to; a store or group here listens where it is told.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_store(host: str, port: int, timeout: timedelta, world_size: int | None = None) -> dist.TCPStore:
    """A TCPStore server listening on `host` only. (Given just a host name, torch's own listens on
    every interface: anyone who reaches the machine could write keys.)"""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.create_server((bare, port), family=family, backlog=1024)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(
        bare, bound, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
    )


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def gloo_options(host: str, timeout: timedelta):
    """Gloo group options whose transport listens on `host` (torch's default: the address the
    machine's host name resolves to, which may be any interface)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host.strip("[]"))]
    opts._timeout = timeout
    return opts
