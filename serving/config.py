"""A node process's settings: its engine and pipeline, and where it listens (flags: common/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.common.flags import setting
from kvbridge.engine.config import EngineConfig, PPConfig


@dataclass(frozen=True)
class NodeConfig:
    """How one node process serves: its engine and pipeline, and where it listens."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    pp: PPConfig = field(default_factory=PPConfig)
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(0, "gRPC port (0: a free one, printed when ready)")
    metrics_port: int = setting(-1, "Prometheus /metrics port (0: a free one; -1: off)")
    transfer_backend: str = setting(
        "auto",
        "KV transfer backend: on a decode node, the one it asks for (auto: the fastest the pair supports); "
        "on a prefill node, the only one it offers (auto: all it can drive)",
    )

    elastic: bool = setting(
        False,
        "let the node change role at run time (Admin.SetRole, `kvbridge admin set-role`), weights and KV "
        "cache kept: it serves every role's services and refuses those of the roles it does not have now",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535] (or -1: off), got {self.metrics_port}")
