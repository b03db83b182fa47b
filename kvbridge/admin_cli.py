"""`kvbridge admin`: operate a running node or router over its Admin service.

    kvbridge admin status --target 127.0.0.1:50051 [--json]
    kvbridge admin requests --target ... [--phase P] [--limit N] [--all]
    kvbridge admin abort RID --target ...
    kvbridge admin drain [--wait SECONDS] --target ... / resume / config
    kvbridge admin clear-cache --target ...   (a node: its prefix cache; the router: every node's)
    kvbridge admin nodes [list | add ROLE ADDR | remove ADDR [--role ROLE]] --target ...   (router only)
    kvbridge admin set-role ROLE --target ... [--node ADDR] [--wait SECONDS] [--migrate]   (an --elastic node)

The render_* and *_dict functions are pure (a message in, a string or dict out); run_admin
only parses, calls and prints. A gRPC error is one line on stderr and exit status 1; a bad
argument value is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

from kvbridge.common.security import add_tls_flags
from kvbridge.v1 import admin_pb2  # grpc itself is imported when a command runs: `kvbridge --help` stays fast

if TYPE_CHECKING:
    from google.protobuf.message import Message

NODE_ROLES = ("colocated", "prefill", "decode")


class ArgumentError(Exception):
    """A bad argument value: one line on stderr, exit status 2."""


# ---------------------------------------------------------------------- pure: message in, text out


def to_dict(msg: Message) -> dict:
    """Every field of a message under its proto name, defaults included. Unlike json_format, 64-bit
    integers stay numbers, and maps come out sorted by key."""
    out = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(sorted(value.items()))  # every map of the Admin API has scalar values
        elif field.message_type is not None:
            out[field.name] = [to_dict(v) for v in value] if field.is_repeated else to_dict(value)
        else:
            out[field.name] = list(value) if field.is_repeated else value
    return out


def duration(seconds: float) -> str:
    """A readable age: 4.2s, 3m 07s, 2h 05m, 1d 03h."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def columns(rows: list[list[object]]) -> str:
    """Left-aligned columns two spaces apart; no trailing blanks."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A header line, then one line per row."""
    return columns([headers, *rows])


def status_dict(st: admin_pb2.Status) -> dict:
    return to_dict(st)


def render_nodes(nodes: list[admin_pb2.NodeInfo]) -> str:
    def health(n):
        return "unknown" if not n.reported else yes_no(n.healthy)

    def role(n):
        return f"{n.role} -> {n.switching_to}" if n.switching_to else n.role

    rows = [[role(n), n.address, health(n), n.outstanding, n.routed, n.model or "-"] for n in nodes]
    return table(["ROLE", "ADDRESS", "HEALTHY", "OUTSTANDING", "ROUTED", "MODEL"], rows)


def render_cache(c: admin_pb2.PrefixCacheStatus) -> str:
    """off | N pages (M idle), hit H of Q prompt tokens (P%), E evicted"""
    if not c.enabled:
        return "off"
    rate = f" ({100 * c.hit_tokens / c.query_tokens:.0f}%)" if c.query_tokens else ""
    return (
        f"{c.cached_pages} pages ({c.idle_pages} idle), hit {c.hit_tokens} of {c.query_tokens} prompt tokens{rate}, "
        f"{c.evicted_pages} evicted"
    )


def render_status(st: admin_pb2.Status) -> str:
    """The summary, then a queue table and a rank table (each when non-empty), then the router's nodes."""
    summary = [
        ["role", st.role],
        ["model", st.model or "-"],
        ["fingerprint", st.model_fingerprint or "-"],
        ["version", st.version or "-"],
        ["uptime", duration(st.uptime_s)],
        ["serving", yes_no(st.serving)],
        ["draining", yes_no(st.draining)],
        *(
            [
                [
                    "elastic",
                    f"yes, {st.role_epoch} switches{f', switching to {st.switching_to}' if st.switching_to else ''}",
                ]
            ]
            if st.elastic
            else []
        ),
        ["requests", f"{st.requests_in_flight} in flight, {st.requests_served} served"],
        ["transfers", f"{st.transfers_in_flight} in flight"],
    ]
    if st.role != "router":
        summary.insert(4, ["pp size", st.pp_size])
        summary.append(["cache", render_cache(st.prefix_cache)])
    lines = [columns(summary)]
    if st.queues:
        lines.append(table(["QUEUE", "REQUESTS"], sorted(st.queues.items())))
    if st.ranks:
        rows = [[r.rank, yes_no(r.alive), r.kv_pages_used, r.kv_pages_total] for r in st.ranks]
        lines.append(table(["RANK", "ALIVE", "KV PAGES USED", "KV PAGES TOTAL"], rows))
    if st.role == "router":
        lines.append(render_nodes(st.nodes))
    if st.planner_moves:
        lines.append("\n".join(["PLANNER MOVES", *st.planner_moves]))
    return "\n\n".join(lines)


def requests_dict(resp: admin_pb2.ListRequestsResponse) -> dict:
    return to_dict(resp)


def render_requests(resp: admin_pb2.ListRequestsResponse) -> str:
    """One row per request (TOKENS is prompt+output), then how many of how many are shown."""
    rows = [
        [
            r.rid,
            r.room or "-",
            r.phase,
            duration(r.age_s),
            r.kv_pages,
            r.peer or "-",
            f"{r.prompt_tokens}+{r.output_tokens}",
            handoff(r),
        ]
        for r in resp.requests
    ]
    footer = f"{len(resp.requests)} of {resp.total} requests"
    if resp.next_page_token:
        footer += " (--all for every page)"
    return table(["RID", "ROOM", "PHASE", "AGE", "PAGES", "PEER", "TOKENS", "HANDOFF"], rows) + "\n" + footer


def handoff(r: admin_pb2.RequestInfo) -> str:
    """What a disaggregated request's hand-off moves (and, on its prefill node once done, how long it took)."""
    if not r.backend:
        return "-"
    moved = f"{r.kv_pages_moved}p {r.kv_bytes_moved / 1e6:.2f}MB {r.backend}"  # (pages, MB, the backend)
    return moved + (f" {r.handoff_s * 1e3:.1f}ms" if r.handoff_s else "")


def render_abort(resp: admin_pb2.AbortRequestResponse) -> str:
    return f"aborted {resp.rid} (was {resp.phase or 'in an unknown phase'})"


def render_drain(resp: admin_pb2.DrainResponse) -> str:
    state = "draining" if resp.draining else "serving"
    line = f"{state}: {resp.requests_in_flight} requests in flight"
    return line + ("; empty, safe to stop" if resp.empty else "")


def render_set_role(resp: admin_pb2.SetRoleResponse) -> str:
    if resp.old_role == resp.role:
        return f"{resp.node} is a {resp.role} node already"
    return (
        f"{resp.node}: {resp.old_role} -> {resp.role} (switch {resp.role_epoch}) in {resp.switch_s:.3f} s, "
        f"{resp.drain_s:.3f} s of it waiting for its requests to end"
    )


def render_config(cfg: admin_pb2.Config) -> str:
    """The effective configuration as indented JSON (the server sends it compact)."""
    return json.dumps(json.loads(cfg.json or "{}"), indent=2, sort_keys=True)


def config_dict(cfg: admin_pb2.Config) -> dict:
    return {"role": cfg.role, "version": cfg.version, "config": json.loads(cfg.json or "{}")}


def render_node_change(verb: str, node: admin_pb2.NodeInfo) -> str:
    return f"{verb} {node.role} node {node.address}"


# ---------------------------------------------------------------------- the command


def host_port(text: str, what: str) -> str:
    """`text` if it is HOST:PORT with a port in [1, 65535]; ArgumentError naming `what` and the value."""
    host, sep, port = text.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ArgumentError(f"{what} must be HOST:PORT, got {text!r}")
    return text


def add_admin_parser(subparsers) -> argparse.ArgumentParser:
    """The `admin` subcommand and its actions. --target and the other values are checked by run_admin,
    so that a bad one is one line."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", required=True, metavar="HOST:PORT", help="the node's or router's gRPC address")
    common.add_argument("--timeout", default="10", metavar="SECONDS", help="deadline of each call (default: 10)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    add_tls_flags(common, admin_key=False, fleet_key=False)
    common.add_argument("--key-file", default="", metavar="FILE", help="the target's admin key (its --admin-key-file)")

    parser = subparsers.add_parser("admin", help="operate a running node or router (its Admin service)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("status", parents=[common], help="role, model, load, queues, ranks (and the router's nodes)")
    req = actions.add_parser("requests", parents=[common], help="the requests held, oldest first")
    req.add_argument("--phase", default="", help="only requests in this phase")
    req.add_argument("--limit", default="100", metavar="N", help="requests per page, 1..1000 (default: 100)")
    req.add_argument("--all", action="store_true", help="every page, not just the first")
    abort = actions.add_parser("abort", parents=[common], help="end one request and free what it holds")
    abort.add_argument("rid")
    drain = actions.add_parser("drain", parents=[common], help="stop admitting; in-flight requests finish")
    drain.add_argument(
        "--wait", default="0", metavar="SECONDS", help="answer once nothing is in flight, or after this long"
    )
    actions.add_parser("resume", parents=[common], help="admit requests again after a drain")
    actions.add_parser("config", parents=[common], help="the effective configuration (JSON)")
    actions.add_parser("clear-cache", parents=[common], help="drop the prefix cache (the router: every node's)")

    switch = actions.add_parser(
        "set-role", parents=[common], help="change an --elastic node's role (weights and KV cache kept)"
    )
    switch.add_argument("role", metavar="ROLE", help=f"the new role: {' | '.join(NODE_ROLES)}")
    switch.add_argument(
        "--node", default="", metavar="ADDR", help="to a router: the node (it refuses its last of a role)"
    )
    switch.add_argument(
        "--wait", default="120", metavar="SECONDS", help="how long the node's requests may take to end (default: 120)"
    )
    switch.add_argument(
        "--migrate", action="store_true", help="end its requests now: the router resumes each elsewhere"
    )

    nodes = actions.add_parser("nodes", parents=[common], help="the router's nodes (router only)")
    nodes.add_argument("words", nargs="*", metavar="WORD", help="list (the default) | add ROLE ADDR | remove ADDR")
    nodes.add_argument("--role", default="", help=f"with remove: the address's role ({', '.join(NODE_ROLES)})")
    parser.set_defaults(func=run_admin)
    return parser


def seconds(text: str, flag: str, zero_ok: bool) -> float:
    """A finite number of seconds, >= 0 (zero_ok) or > 0; ArgumentError naming the flag and the value."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
        raise ArgumentError(f"{flag} must be a number of seconds {'>= 0' if zero_ok else '> 0'}, got {text!r}")
    return value


def run_admin(args: argparse.Namespace) -> int:
    """Parse the values, make the call(s), print the result. Exit status 0, 1 (gRPC error) or 2 (bad value)."""
    import grpc

    from kvbridge.common import rpc, security
    from kvbridge.v1 import admin_pb2_grpc

    try:
        target = host_port(args.target, "--target")
        timeout = seconds(args.timeout, "--timeout", zero_ok=False)
        call = ACTIONS[args.action]
        try:
            key = security.read_key(args.key_file, "--key-file") if args.key_file else ""
            rpc.configure(security.from_flags(args))
        except ValueError as e:
            raise ArgumentError(str(e)) from None
        with rpc.make_channel(target) as channel:
            out = call(Keyed(admin_pb2_grpc.AdminStub(channel), security.auth_metadata(key)), args, timeout)
    except ArgumentError as e:
        print(f"kvbridge admin: error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        details = " ".join((e.details() or "").split())  # one line, whatever the server sent
        print(f"kvbridge admin: error: {e.code().name}: {details} (target {args.target})", file=sys.stderr)
        return 1
    print(json.dumps(out) if args.json else out)
    return 0


class Keyed:
    """A stub whose every call carries `metadata` (the admin key's bearer)."""

    def __init__(self, stub, metadata: tuple[tuple[str, str], ...]):
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        return lambda request, **kw: method(request, metadata=self._metadata, **kw)


# Each action: (stub, args, timeout) -> a dict with --json, else the text to print.


def do_status(stub, args, timeout):
    st = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=timeout)
    return status_dict(st) if args.json else render_status(st)


def do_requests(stub, args, timeout):
    limit = args.limit
    if not (limit.isdigit() and 1 <= int(limit) <= 1000):
        raise ArgumentError(f"--limit must be an integer in [1, 1000], got {limit!r}")
    req = admin_pb2.ListRequestsRequest(page_size=int(limit), phase=args.phase)
    resp = stub.ListRequests(req, timeout=timeout)
    if args.all:
        every = list(resp.requests)
        while resp.next_page_token:
            req.page_token = resp.next_page_token
            resp = stub.ListRequests(req, timeout=timeout)
            every += resp.requests
        resp = admin_pb2.ListRequestsResponse(requests=every, total=resp.total)
    return requests_dict(resp) if args.json else render_requests(resp)


def do_abort(stub, args, timeout):
    resp = stub.AbortRequest(admin_pb2.AbortRequestRequest(rid=args.rid), timeout=timeout)
    return to_dict(resp) if args.json else render_abort(resp)


def do_drain(stub, args, timeout):
    wait = seconds(args.wait, "--wait", zero_ok=True)
    resp = stub.Drain(admin_pb2.DrainRequest(wait_s=wait), timeout=timeout + wait)  # the server may wait that long
    return to_dict(resp) if args.json else render_drain(resp)


def do_resume(stub, args, timeout):
    resp = stub.Resume(admin_pb2.ResumeRequest(), timeout=timeout)
    return to_dict(resp) if args.json else render_drain(resp)


def do_config(stub, args, timeout):
    cfg = stub.GetConfig(admin_pb2.GetConfigRequest(), timeout=timeout)
    return config_dict(cfg) if args.json else render_config(cfg)


def do_clear_cache(stub, args, timeout):
    resp = stub.ClearPrefixCache(admin_pb2.ClearPrefixCacheRequest(), timeout=timeout)
    return to_dict(resp) if args.json else f"dropped {resp.pages_dropped} cached pages"


def do_set_role(stub, args, timeout):
    if args.role not in NODE_ROLES:
        raise ArgumentError(f"ROLE must be one of {', '.join(NODE_ROLES)}, got {args.role!r}")
    wait = seconds(args.wait, "--wait", zero_ok=False)
    node = host_port(args.node, "--node") if args.node else ""
    req = admin_pb2.SetRoleRequest(role=args.role, wait_s=wait, migrate=args.migrate, node=node)
    resp = stub.SetRole(req, timeout=timeout + wait + 5)  # the node may wait that long for its requests
    return to_dict(resp) if args.json else render_set_role(resp)


def do_nodes(stub, args, timeout):
    words = args.words or ["list"]
    match words:
        case ["list"]:
            resp = stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=timeout)
            return to_dict(resp) if args.json else render_nodes(resp.nodes)
        case ["add", role, address]:
            if role not in NODE_ROLES:
                raise ArgumentError(f"ROLE must be one of {', '.join(NODE_ROLES)}, got {role!r}")
            req = admin_pb2.AddNodeRequest(role=role, address=host_port(address, "ADDR"))
            node = stub.AddNode(req, timeout=timeout)
            return to_dict(node) if args.json else render_node_change("added", node)
        case ["remove", address]:
            if args.role not in ("", *NODE_ROLES):
                raise ArgumentError(f"--role must be one of {', '.join(NODE_ROLES)}, got {args.role!r}")
            req = admin_pb2.RemoveNodeRequest(address=host_port(address, "ADDR"), role=args.role)
            node = stub.RemoveNode(req, timeout=timeout)
            return to_dict(node) if args.json else render_node_change("removed", node)
    raise ArgumentError(f"nodes takes list, add ROLE ADDR or remove ADDR, got {' '.join(words)!r}")


ACTIONS = {
    "status": do_status,
    "requests": do_requests,
    "abort": do_abort,
    "drain": do_drain,
    "resume": do_resume,
    "config": do_config,
    "clear-cache": do_clear_cache,
    "nodes": do_nodes,
    "set-role": do_set_role,
}
