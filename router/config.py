"""Router configuration: a frozen dataclass, each setting with its default and help text (the
CLI flags are built from it, router/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from kvbridge.common.flags import setting
from kvbridge.common.limits import parse_address
from kvbridge.common.security import CLIENT_CERT_REQS
from kvbridge.router.discovery import parse_target
from kvbridge.router.local_prefill import LocalPrefill
from kvbridge.router.policy import POLICIES, Policy


@dataclass(frozen=True)
class RouterConfig:
    host: str = setting("127.0.0.1", "address every server binds (gRPC, HTTP, metrics)")
    port: int = setting(
        50050,
        "gRPC port: Generation, Admin (unless --admin-port), health, reflection (0: a free one, printed when ready; "
        "-1: none, the HTTP API only)",
    )
    http_port: int = setting(8000, "OpenAI-compatible HTTP port (0: a free one, printed when ready)")
    colocated: tuple[str, ...] = setting(
        (), "nodes serving Generation themselves (kvbridge serve), HOST:PORT[,HOST:PORT..]"
    )
    prefill: tuple[str, ...] = setting(
        (), "prefill nodes, HOST:PORT[,HOST:PORT..]; disaggregated requests need a prefill and a decode node"
    )
    decode: tuple[str, ...] = setting(
        (), "decode nodes, HOST:PORT[,HOST:PORT..]; disaggregated requests need a prefill and a decode node"
    )
    discover: tuple[str, ...] = setting(
        (),
        "nodes found in DNS, ROLE=NAME:PORT[,ROLE=NAME:PORT..] (a headless Service: one address per pod), "
        "resolved again every --discover-interval-s; an address gone from the answer is removed",
    )
    discover_interval_s: float = setting(10.0, "how often every --discover name is resolved again, seconds")
    request_timeout_s: float = setting(300.0, "deadline of each upstream Generate / Prefill call, seconds")
    max_attempts: int = setting(
        3,
        "tries of a request in all: one that a node fails before any token reached the client "
        "(UNAVAILABLE, RESOURCE_EXHAUSTED, a node timeout, no first token in time) is tried again on "
        "other nodes",
    )
    max_migrations: int = setting(
        3,
        "times a stream whose node fails after tokens reached the client is moved to another pair "
        "(resubmitted as prompt + the tokens sent; the client's stream goes on, nothing repeated or "
        "lost); 0: never",
    )
    retry_backoff_s: float = setting(
        0.05, "pause before the first retry, doubling for each next one (at most 1 s), seconds"
    )
    # (a first token waits for the request's turn in the nodes' queues: this bounds a hang, not a burst)
    first_token_timeout_s: float = setting(
        300.0,
        "cancel an attempt that got no first token within this and retry it elsewhere (the last attempt "
        "fails with DEADLINE_EXCEEDED), seconds; 0: off",
    )
    idle_stream_timeout_s: float = setting(
        30.0,
        "fail a stream (DEADLINE_EXCEEDED) whose node sent nothing for this long after the first token, "
        "seconds; 0: off",
    )
    health_retry_s: float = setting(1.0, "pause before re-checking a node whose health check failed, seconds")
    startup_wait_s: float = setting(
        5.0, "wait at most this long at start for every node's first health report, seconds"
    )
    metrics_port: int = setting(-1, "Prometheus /metrics port (-1: off; 0: a free one, printed when ready)")
    max_concurrent_requests: int = setting(
        4096, "HTTP requests handled at once; one more is answered 503 with Retry-After at once"
    )
    max_body_bytes: int = setting(
        4 << 20, "the largest HTTP request body, bytes; a larger one is answered 413 (chunked bodies too)"
    )
    max_answer_bytes: int = setting(
        16 << 20,
        "the largest non-streamed HTTP answer (its JSON), bytes: one growing past it ends with a 400 "
        "naming this limit and its requests are cancelled at the nodes; streamed answers are not held and "
        "have no limit",
    )
    http_header_timeout_s: float = setting(
        10.0,
        "close an HTTP connection whose request headers are not in this long after it opened or after its "
        "last response, seconds",
    )
    http_body_timeout_s: float = setting(
        30.0, "answer 408 to an HTTP request whose body is not in this long after its headers, seconds"
    )
    http_keep_alive_s: float = setting(
        5.0, "close an HTTP connection idle this long after a response (at most --http-header-timeout-s), seconds"
    )
    routing: str = setting(
        "cache_aware",
        "how nodes are picked: cache_aware (the node with the least of the prompt left to compute, by the "
        "nodes' KV events; decode nodes by load, then cached prefix), least_loaded (fewest outstanding "
        "requests) or round_robin",
    )
    balance_abs_threshold: int = setting(
        64,
        "cache_aware routes least-loaded while a role's nodes are imbalanced: max - min outstanding "
        "requests above this, and max above --balance-rel-threshold times min",
    )
    balance_rel_threshold: float = setting(
        1.5,
        "the ratio of max to min outstanding requests above which (with --balance-abs-threshold) "
        "cache_aware routes least-loaded",
    )
    local_prefill_max_tokens: int = setting(
        512,
        "a decode node computes a prompt itself, with no prefill node, when at most this many of its tokens are "
        "not in that node's prefix cache and the prefill queue is long (--local-prefill-ratio); 0: off, every "
        "prompt of a P/D pair is computed by its prefill node",
    )
    local_prefill_ratio: float = setting(
        4.0,
        "local prefill needs the least-queued prefill node's prompt tokens (routed and not yet handed off) "
        "above this times the decode node's (its local prompts not yet computed, plus this prompt's uncached "
        "tokens)",
    )
    client_cert_reqs: str = setting(
        "required",
        "under --tls-ca, what the HTTP API and gRPC Generation ask of clients: required (a certificate "
        "--tls-ca signed, as on every fleet port), optional (checked when presented; the gRPC port, which "
        "grpcio cannot ask for an optional one, asks for none) or none (server TLS: clients authenticate "
        "with --api-key-file, which optional and none need, as they need --admin-port); no effect without --tls-ca",
    )
    admin_port: int = setting(
        -1,
        "gRPC port of Admin (and health) on its own, with mutual TLS whatever --client-cert-reqs says; "
        "-1: Admin is served on --port; 0: a free one, printed when ready",
    )

    planner: str = setting(
        "off",
        "slo: move elastic nodes (--elastic) between prefill and decode, one at a time, when the TTFT or ITL "
        "SLO is missed (router/planner.py); off: roles change only by Admin.SetRole",
    )
    slo_ttft_ms: float = setting(500.0, "the planner's time-to-first-token SLO (p90 over an interval), milliseconds")
    slo_itl_ms: float = setting(50.0, "the planner's inter-token latency SLO (p90 over an interval), milliseconds")
    planner_interval_s: float = setting(5.0, "how often the planner reads the figures and may move a node, seconds")
    planner_patience: int = setting(2, "intervals in a row an SLO must be missed the same way before a move")
    planner_min_dwell_s: float = setting(30.0, "the least time a node stays in a role the planner gave it, seconds")
    planner_migrate: bool = setting(
        False,
        "a decode node the planner moves hands its streams back to be resumed elsewhere instead of finishing them",
    )

    def __post_init__(self) -> None:
        if not -1 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535] (or -1: no gRPC), got {self.port}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be -1 (off) or in [0, 65535], got {self.metrics_port}")
        if not -1 <= self.admin_port < 65536:
            raise ValueError(f"admin_port must be -1 (Admin on the gRPC port) or in [0, 65535], got {self.admin_port}")
        for a, b in combinations(("port", "http_port", "metrics_port", "admin_port"), 2):
            if getattr(self, a) == getattr(self, b) > 0:
                raise ValueError(f"{a} and {b} are both {getattr(self, a)}")
        # Any fleet is allowed, none included: nodes can be added at run time (Admin.AddNode), and
        # the router's health stays NOT_SERVING while no request could be routed.
        for flag, addrs in (("colocated", self.colocated), ("prefill", self.prefill), ("decode", self.decode)):
            for addr in addrs:
                parse_address(addr, flag)
        for spec in self.discover:
            parse_target(spec)
        if not 0 < self.discover_interval_s < float("inf"):
            raise ValueError(f"discover_interval_s must be > 0 and finite, got {self.discover_interval_s}")
        seen: set[tuple[str, str]] = set()
        for node in self.nodes:
            if node in seen:
                raise ValueError(f"a {node[0]} node is listed twice: {node[1]!r}")
            seen.add(node)
        for name in ("request_timeout_s", "health_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("retry_backoff_s", "first_token_timeout_s", "idle_stream_timeout_s"):
            if not 0 <= getattr(self, name) < float("inf"):  # NaN fails too
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.startup_wait_s >= 0:
            raise ValueError(f"startup_wait_s must be >= 0, got {self.startup_wait_s}")
        for name in ("max_concurrent_requests", "max_body_bytes", "max_answer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_body_bytes > 7 << 20:  # a body's prompt goes to the nodes in one gRPC message of at most 8 MiB
            raise ValueError(f"max_body_bytes must be <= {7 << 20}, got {self.max_body_bytes}")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_keep_alive_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        if self.client_cert_reqs not in CLIENT_CERT_REQS:
            raise ValueError(
                f"client_cert_reqs must be one of {', '.join(CLIENT_CERT_REQS)}, got {self.client_cert_reqs!r}"
            )
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if not 1 <= self.balance_rel_threshold < float("inf"):
            raise ValueError(f"balance_rel_threshold must be >= 1 and finite, got {self.balance_rel_threshold}")
        LocalPrefill(self.local_prefill_max_tokens, self.local_prefill_ratio)  # (raises on a bad value)
        if self.planner not in ("off", "slo"):
            raise ValueError(f"planner must be off or slo, got {self.planner!r}")
        for name in ("slo_ttft_ms", "slo_itl_ms", "planner_interval_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        if self.planner_patience < 1:
            raise ValueError(f"planner_patience must be >= 1, got {self.planner_patience}")
        if not 0 <= self.planner_min_dwell_s < float("inf"):
            raise ValueError(f"planner_min_dwell_s must be >= 0 and finite, got {self.planner_min_dwell_s}")
        if self.http_keep_alive_s > self.http_header_timeout_s:  # the header timeout would cut it short
            raise ValueError(
                f"http_keep_alive_s ({self.http_keep_alive_s}) must not exceed http_header_timeout_s "
                f"({self.http_header_timeout_s}): a connection's next headers are due that long after its last response"
            )

    @property
    def policy(self) -> Policy:
        return Policy(self.routing, self.balance_abs_threshold, self.balance_rel_threshold)

    @property
    def local_prefill(self) -> LocalPrefill:
        return LocalPrefill(self.local_prefill_max_tokens, self.local_prefill_ratio)

    @property
    def nodes(self) -> list[tuple[str, str]]:
        """(role, address) of every backend."""
        return (
            [("colocated", a) for a in self.colocated]
            + [("prefill", a) for a in self.prefill]
            + [("decode", a) for a in self.decode]
        )
