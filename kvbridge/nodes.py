"""One way to build a node: the roles (`ROLES`) and `start_node(role, NodeConfig)`.

    server = start_node("prefill", NodeConfig(EngineConfig(model="tiny-random"), PPConfig(pp_size=2)))
    ...
    server.stop()                      # the ranks' reports

NodeConfig (serving/config.py) is a node's settings, with the help text of its flags. `bind_node`
binds the server first (health NOT_SERVING, Admin answering) and `load_node` starts the ranks;
`start_node` does both. The CLI (`kvbridge serve|prefill|decode`), the demo,
the benches and the tests all build nodes here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvbridge.serving.config import NodeConfig


@dataclass(frozen=True)
class RoleSpec:
    """A node role: its command, and (imported when a node is made: `kvbridge --help` should not
    import torch) its server, its node and the transfer backends it accepts."""

    name: str  # as servers report it (Admin GetStatus, GetModelInfo)
    command: str  # `kvbridge COMMAND`
    help: str
    parts: Callable[[], tuple]  # () -> (server class, node class: node(config, progress), accepted backends)


def _colocated() -> tuple:
    from kvbridge.serving.colocated import ColocatedNode, ColocatedServer

    return ColocatedServer, ColocatedNode, ("auto",)  # it moves no KV


def _prefill() -> tuple:
    from kvbridge.kv_transfer.factory import CHOICES
    from kvbridge.prefill_node.node import PrefillNode
    from kvbridge.prefill_node.service import PrefillServer

    return PrefillServer, PrefillNode, CHOICES  # (PrefillNode refuses one its pools' device cannot drive)


def _decode() -> tuple:
    from kvbridge.decode_node.node import DecodeNode
    from kvbridge.decode_node.service import DecodeServer
    from kvbridge.kv_transfer.factory import CHOICES

    return DecodeServer, DecodeNode, CHOICES


def _elastic() -> tuple:
    from kvbridge.elastic_node.service import ElasticServer
    from kvbridge.kv_transfer.factory import CHOICES

    return ElasticServer, None, CHOICES  # (its node: elastic_node/node.py ElasticNode, made with its role)


ROLES: dict[str, RoleSpec] = {
    spec.name: spec
    for spec in (
        RoleSpec(
            "colocated", "serve", "a colocated node (prefill and decode in one pipeline) serving Generation", _colocated
        ),
        RoleSpec("prefill", "prefill", "a prefill node (Prefill and Bootstrap)", _prefill),
        RoleSpec("decode", "decode", "a decode node (Generation for disaggregated requests)", _decode),
    )
}
COMMANDS = {spec.command: spec for spec in ROLES.values()}


def bind_node(role: str, config: NodeConfig):
    """The role's server (serving/server.py NodeServer), bound on config.host:port (and
    metrics_port); its load() starts the node."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    server_cls, _, backends = _elastic() if config.elastic else ROLES[role].parts()
    if config.transfer_backend not in backends:
        choices = " | ".join(backends)
        raise ValueError(f"a {role} node's transfer backend must be {choices}, got {config.transfer_backend!r}")
    settings = {"model": config.engine.model}
    if role != "colocated" or config.elastic:
        settings["transfer_backend"] = config.transfer_backend
    if config.elastic:
        settings |= {"role": role, "elastic": True}
    return server_cls(config.host, config.port, config.metrics_port, settings)


def load_node(server, role: str, config: NodeConfig, progress: bool = False):
    """Start the node behind a bound server (blocks until every rank is up); returns the server."""
    if config.elastic:
        from kvbridge.elastic_node.node import ElasticNode

        return server.load(partial(ElasticNode, config, role, progress))
    _, node_cls, _ = ROLES[role].parts()
    return server.load(partial(node_cls, config, progress))


def start_node(role: str, config: NodeConfig, progress: bool = False):
    """A node of `role` serving on config.host:port once every rank is up (blocks until then)."""
    return load_node(bind_node(role, config), role, config, progress)
