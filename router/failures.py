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

from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from kvbridge.router.pool import Node

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
