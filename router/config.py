"""Router configuration: a frozen dataclass; the CLI flags are built from it."""

from __future__ import annotations

from dataclasses import dataclass


def parse_address(addr: str, flag: str = "address") -> tuple[str, int]:
    """host:port (IPv6 as [::1]:port) -> (host, port); ValueError naming the bad value."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: expected HOST:PORT with a port in [1, 65535], got {addr!r}")
    if host.startswith("[") != host.endswith("]") or ("[" not in host and ":" in host):
        raise ValueError(f"{flag}: bad host in {addr!r} (write IPv6 as [::1]:PORT)")
    return host, int(port)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"  # address both servers bind
    port: int = 50050  # gRPC port (Generation, Admin, health, reflection); 0 = a free one
    http_port: int = 8000  # OpenAI-compatible HTTP port; 0 = a free one
    colocated: tuple[str, ...] = ()  # host:port of nodes that serve Generation themselves
    prefill: tuple[str, ...] = ()  # host:port of prefill nodes (Prefill service)
    decode: tuple[str, ...] = ()  # host:port of decode nodes (Generation with a PrefillRoute)
    request_timeout_s: float = 300.0  # deadline of each upstream Generate / Prefill call, seconds
    health_retry_s: float = 1.0  # pause before re-watching the health of a node that failed, seconds
    startup_wait_s: float = 5.0  # start_router waits this long at most for every node's first health report
    grpc_workers: int = 64  # handler threads of the gRPC server: concurrent client streams served

    def __post_init__(self) -> None:
        for name in ("port", "http_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if self.port == self.http_port != 0:
            raise ValueError(f"port and http_port are both {self.port}")
        for flag, addrs in (("colocated", self.colocated), ("prefill", self.prefill), ("decode", self.decode)):
            for addr in addrs:
                parse_address(addr, flag)
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("prefill and decode nodes come together: give both or neither")
        if not (self.colocated or self.prefill):
            raise ValueError("no backends: give colocated nodes, or prefill and decode nodes")
        seen: set[tuple[str, str]] = set()
        for node in self.nodes:
            if node in seen:
                raise ValueError(f"a {node[0]} node is listed twice: {node[1]!r}")
            seen.add(node)
        for name in ("request_timeout_s", "health_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.startup_wait_s >= 0:
            raise ValueError(f"startup_wait_s must be >= 0, got {self.startup_wait_s}")
        if self.grpc_workers < 1:
            raise ValueError(f"grpc_workers must be >= 1, got {self.grpc_workers}")

    @property
    def nodes(self) -> list[tuple[str, str]]:
        """(role, address) of every backend."""
        return (
            [("colocated", a) for a in self.colocated]
            + [("prefill", a) for a in self.prefill]
            + [("decode", a) for a in self.decode]
        )
