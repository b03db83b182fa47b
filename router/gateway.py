"""What a Kubernetes inference gateway tells the router (Gateway API Inference Extension, llm-d).

An endpoint picker that chose the decode pod passes its prefill choice in a header: the GIE P/D
proposal's `x-gateway-prefill-endpoints: ip:port[,ip:port]`, or llm-d's `x-prefiller-host-port`.
A router beside each decode pod takes it, but only as a choice among the prefill nodes it already
knows (the node at that address, or the one prefill node on that host: a picker names a pod by its
IP and the pool's target port): an address a request names is never dialled (a header must not steer the fleet's KV or
its traffic to a host of the client's choosing)."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from kvbridge.router.tokenize import Refused

PREFILL_HEADERS = ("x-gateway-prefill-endpoints", "x-prefiller-host-port")  # GIE's first, then llm-d's
MAX_ADDRESSES = 16  # addresses read from one header


def gateway_prefill(headers: Mapping[str, str], pool) -> tuple:
    """The pool's prefill nodes the gateway chose (router/pool.py Pool.prefill_nodes_at), () when no
    header names any. Refused (INVALID_ARGUMENT: 400) naming the header and the first address that
    is not a known prefill node."""
    for header in PREFILL_HEADERS:
        value = headers.get(header, "").strip()
        if value:
            addresses = [a.strip() for a in value.split(",") if a.strip()][:MAX_ADDRESSES]
            try:
                return tuple(pool.prefill_nodes_at(addresses))
            except ValueError as e:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{header}: {e}") from None
    return ()
