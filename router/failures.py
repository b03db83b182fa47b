"""How the router answers a failed attempt: retry it, migrate the stream, or end it.

Retries. An attempt that fails before any response reached the client is tried again on another
node (pair) when another node may do better: UNAVAILABLE (down, draining, lost a rank),
RESOURCE_EXHAUSTED (full), DEADLINE_EXCEEDED from a node's own timeout (bootstrap, prealloc,
transfer; not the request's own deadline), or no first token within first_token_timeout_s. The node
that failed is left out of the request's later attempts; but P's own timeouts leave out D (P waited
on D: for its registration, or for its pages to take the KV), and a first-token timeout leaves out
P while its Prefill call runs, else D. Each attempt has a fresh room and, after the first, a fresh
upstream rid, `RID:retryN` (the nodes may still be dropping the attempt before). At most
max_attempts attempts; the n-th retry waits retry_backoff_s * 2**(n-1), at most
RETRY_BACKOFF_CAP_S (router/routed.py). When the attempts are used up or no node is left, the client gets the last
failure's status and message (RESOURCE_EXHAUSTED stays RESOURCE_EXHAUSTED: clients back off on it).
Retries are counted in kvbridge_router_retries_total{reason}.

Unpaired. A decode node that refuses the prefill node it was paired with (their layouts differ:
page size, KV dtype, model, kvbridge version; it says so with rpc.PAIR_FAULT beside its
FAILED_PRECONDITION) has refused the pair, not the request: the client did nothing wrong, so it is not
told 400. The attempt is retried (or migrated) as if UNAVAILABLE, leaving out that pair rather than
either node (`Unpaired`: the prefill node for that decode node, and a decode node that no prefill
node is left for); when no pair is left, the client gets UNAVAILABLE (HTTP 503: the fleet's fault,
and it may pass) naming both nodes and the mismatch.

Migration. Once a response reached the client, a failure that another pair may not have (MIGRATED:
the node died, lost a rank or is shutting down (UNAVAILABLE), a broken stream (UNKNOWN, INTERNAL), a
node timeout, or the router's own idle-stream or first-token timeout) moves the stream: the request
is resubmitted to another pair (the failed node left out) with `resume_ids`, the tokens already sent,
and the new node computes prompt + those tokens (its prefix cache helps) and goes on after them as
if it had sampled them (sampling randomness is a function of (seed, token index): the router gives an
unseeded sampled request a seed of its own when it arrives, so any request continues as it would
have). Its responses carry only what follows, so the client's stream goes on with nothing lost or
repeated; its usage counts the earlier tokens as completion tokens. At most max_migrations per
request; a request that cannot move (none left, no other node, a client's own deadline) ends with
the failure's status and a message saying why it was not migrated. Each migration is a log line
(`phase=migrate`) and counted in kvbridge_router_migrations_total{reason}. A failure that another
node would repeat (INVALID_ARGUMENT, FAILED_PRECONDITION, PERMISSION_DENIED) or an abort (CANCELLED)
ends the stream with the upstream status.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from kvbridge.common import rpc

if TYPE_CHECKING:
    from kvbridge.router.pool import Node, NodePool
    from kvbridge.router.routed import Routed

RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
# after a token reached the client: a broken stream (gRPC reports a transport's end as UNKNOWN or INTERNAL) too
MIGRATED_CODES = (*RETRIED_CODES, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class RouteError(Exception):
    """The request failed; `code` and `message` are what the client is told."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class Retry(Exception):
    """An attempt failed before any response reached the client, in a way other nodes may not."""

    def __init__(self, nodes: list[Node], error: RouteError):
        super().__init__(error.message)
        self.nodes, self.error = nodes, error  # the nodes to leave out from now on; what the client gets if last


class Migrate(Retry):
    """An attempt failed after responses reached the client, in a way other nodes may not: the
    stream moves to another pair, resuming after the tokens sent (`reason`: for the metric)."""

    def __init__(self, nodes: list[Node], error: RouteError, reason: str):
        super().__init__(nodes, error)
        self.reason = reason


class TimedOut(Exception):
    """The wait for the node's next response ran past the timeout that applied (`kind`)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind  # "first_token" | "idle_stream"


class Interrupted(Exception):
    """The upstream call was cancelled by this router (cancel(), or D's stream for P's failure)
    while the attempt waited on it."""


class Unpaired:
    """The (prefill, decode) pairs of one request whose decode node refused its prefill node."""

    def __init__(self):
        self.pairs: list[tuple[Node, Node]] = []

    def add(self, p: Node, d: Node, details: str) -> str:
        """Leave the pair out from now on; what the client is told if no other pair serves."""
        self.pairs.append((p, d))
        return f"{p.key} and {d.key} cannot serve together: {details}"

    def prefill_of(self, d: Node) -> list[Node]:
        """The prefill nodes `d` refused."""
        return [p for p, dd in self.pairs if dd is d]

    def stuck(self, pool: NodePool, excluded: list[Node]) -> list[Node]:
        """The decode nodes no eligible prefill node is left for."""
        return [d for _, d in self.pairs if not pool.has_eligible("prefill", [*excluded, *self.prefill_of(d)])]


def upstream_error(r: Routed, e: grpc.aio.AioRpcError, nodes: list[Node], pair: tuple | None = None) -> Exception:
    """What a failed upstream call of `r` means for the client: a RouteError, or a Retry (Migrate)
    when another node may succeed; `pair`: the attempt's (P, D) when D's call failed."""
    code, details = e.code(), e.details() or ""
    if r.cancelled.is_set():
        return RouteError(grpc.StatusCode.CANCELLED, r.why)
    where = ", ".join(n.key for n in nodes)
    error = RouteError(code, f"{details} (from {where})")
    if pair is not None and rpc.fault_of(e) == "pair":  # D refused P: leave out the pair, not a node
        code, nodes = grpc.StatusCode.UNAVAILABLE, []
        error = RouteError(code, r.unpaired.add(*pair, details))
    own_deadline = code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= r.deadline
    if code in RETRIED_CODES and r.sent == 0 and not own_deadline:
        return Retry(nodes, error)
    if code in MIGRATED_CODES and r.sent and not own_deadline:
        return migration(r, nodes, error, code.name.lower())
    return error


def migration(r: Routed, nodes: list[Node], error: RouteError, reason: str) -> Exception:
    """Migrate, for a request that can: one of n > 1 choices cannot (a continuation resumes one)."""
    if r.request.sampling.n > 1:
        return RouteError(error.code, f"{error.message}; not migrated: a request of n > 1 choices does not move")
    return Migrate(nodes, error, reason)


def timeout_error(r: Routed, kind: str, nodes: list[Node]) -> Exception:
    """What the router's own timeout (`kind`) on an upstream call of `r` means for the client."""
    if r.cancelled.is_set():
        return RouteError(grpc.StatusCode.CANCELLED, r.why)
    where = ", ".join(n.key for n in nodes)
    if kind == "first_token":
        message = f"no first token within {r.config.first_token_timeout_s:g} s (from {where})"
    else:
        message = f"no token for {r.config.idle_stream_timeout_s:g} s (from {where})"
    error = RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, message)
    return migration(r, nodes, error, kind) if r.sent else Retry(nodes, error)
