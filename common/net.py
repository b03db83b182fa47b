"""Sockets and torch.distributed plumbing that listen on one address only.

torch's TCPStore, given a host name, listens on every interface, and its gloo groups' transports on
whatever the machine's host name resolves to (init_process_group and new_group ignore gloo's
pg_options); a store or group here listens where it is told (`listening_store`, `gloo_options`,
`gloo_backend`), and `local_address` says where that is when only the peer's address is known.
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


def listening_store(
    host: str, port: int, timeout: timedelta, world_size: int | None = None, sock: socket.socket | None = None
) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (or on `sock`, already listening there). (Given just
    a host name, torch's own listens on every interface: anyone who reaches the machine could write
    keys.)"""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = sock or socket.create_server((bare, port), family=family, backlog=1024)
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


def local_address(peer: str) -> str:
    """The address of this host that reaches `peer`: loopback for a loopback peer, else the source
    address the kernel routes to it (a UDP socket's connect picks it and sends nothing). What a
    listener meant for that peer binds: the host name's address is no answer, since inside a network
    namespace (a container, a pod) it may resolve to one the namespace does not have. OSError when
    nothing routes to `peer`."""
    bare = peer.strip("[]")
    if is_loopback(bare):
        return "::1" if ":" in bare else "127.0.0.1"
    try:
        family, _, _, _, where = socket.getaddrinfo(bare, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(where)
            return s.getsockname()[0]
    except OSError as e:
        raise OSError(f"no local address reaches {peer!r}: {e}") from e


def gloo_options(host: str, timeout: timedelta):
    """Gloo group options whose transport listens on `host` (torch's default: the address the
    machine's host name resolves to, which may be any interface)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host.strip("[]"))]
    opts._timeout = timeout
    return opts


GLOO_BACKEND = "kvbridge_gloo"  # torch.distributed backend name of gloo_backend's groups


def gloo_backend(host: str) -> str:
    """A torch.distributed backend (its name, for init_process_group and new_group): gloo whose
    groups' transports listen on `host`. torch's own "gloo" builds each group's transport on the
    address the machine's host name resolves to, ignoring pg_options; this one passes gloo_options.
    Registered for the whole process: the groups made after a call listen where it said."""

    def make(store, rank: int, size: int, timeout: timedelta):
        return dist.ProcessGroupGloo(store, rank, size, gloo_options(host, timeout))

    dist.Backend.register_backend(GLOO_BACKEND, make, devices=["cpu"])
    return GLOO_BACKEND
