"""Nodes found in DNS: `--discover ROLE=NAME:PORT[,ROLE=NAME:PORT..]`.

A Kubernetes headless Service has one A (or AAAA) record per ready pod: every `--discover-interval-s`
the router resolves each NAME and makes the pool match it (router/pool.py add / remove). An
address that appears is added (eligible once its health says SERVING); one that is gone from a
successful answer is removed, as Admin.RemoveNode would (its requests in flight finish). A lookup
that fails (the name does not resolve now, the resolver is down) changes nothing: a DNS outage must
not empty the fleet. Only nodes this module added are ever removed by it; nodes given by flags or
Admin are left alone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvbridge.common.limits import parse_address
from kvbridge.common.logs import log_event

log = logging.getLogger("kvbridge.router")
ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class DnsTarget:
    role: str
    name: str  # a DNS name (a headless Service's)
    port: int


def parse_target(spec: str) -> DnsTarget:
    """ROLE=NAME:PORT -> DnsTarget; ValueError naming the bad value."""
    role, sep, where = spec.partition("=")
    if not sep or role not in ROLES:
        raise ValueError(f"discover: expected ROLE=NAME:PORT with ROLE one of {', '.join(ROLES)}, got {spec!r}")
    name, port = parse_address(where, "discover")
    return DnsTarget(role, name, port)


async def resolve(name: str, port: int) -> set[str]:
    """Every address `name` resolves to, as HOST:PORT (IPv6 as [addr]:PORT); OSError when it does not."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {f"[{i[4][0]}]:{port}" if i[0] == socket.AF_INET6 else f"{i[4][0]}:{port}" for i in infos}


class Discovery:
    def __init__(self, pool, targets: list[DnsTarget], resolver: Callable[[str, int], Awaitable[set[str]]] = resolve):
        self.pool, self.targets, self.resolver = pool, targets, resolver
        self.found: dict[DnsTarget, set[str]] = {t: set() for t in targets}  # the addresses each target added

    async def run(self, every_s: float) -> None:
        """Refresh every `every_s` seconds, until cancelled (the first refresh is the caller's)."""
        while True:
            await asyncio.sleep(every_s)
            await self.refresh()

    async def refresh(self) -> None:
        for target in self.targets:
            try:
                now = await self.resolver(target.name, target.port)
            except OSError as e:  # (socket.gaierror included) keep what was found
                log_event(log, "discover_failed", logging.WARNING, name=target.name, error=str(e))
                continue
            known = self.found[target]
            for address in sorted(now - known):
                try:
                    self.pool.add(target.role, address)
                except ValueError:  # in the pool already (a flag, Admin, another name), or the pool is full
                    continue
                known.add(address)
                log_event(log, "discovered", role=target.role, address=address, name=target.name)
            for address in sorted(known - now):
                known.discard(address)
                try:
                    self.pool.remove(address, target.role)
                except KeyError:  # removed meanwhile (Admin)
                    continue
                log_event(log, "undiscovered", role=target.role, address=address, name=target.name)
