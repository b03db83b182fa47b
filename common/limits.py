"""What a boundary accepts from the network, checked the same way at the router and at every
node's front (a node is reachable directly, not only through the router)."""

from __future__ import annotations

import re

from common.rpc import shown

MAX_CLIENT_RID_CHARS = 128  # a request id a client chose (the router's check)
MAX_RID_CHARS = MAX_CLIENT_RID_CHARS + 32  # at a node: a client's rid and the router's ":retryN"
RID_CHARS = "A-Za-z0-9._:-"
_RID = re.compile(f"[{RID_CHARS}]+")
# a text or chat prompt over max_context * this many UTF-8 bytes cannot fit the context: it is
# refused before the tokenizer spends time on it (real text runs at 2-8 bytes per token)
PROMPT_BYTES_PER_TOKEN = 32


def rid_problem(rid: str, limit: int = MAX_RID_CHARS) -> str:
    """Why `rid` is not acceptable ("" when it is): 1..limit characters of [A-Za-z0-9._:-]."""
    if 1 <= len(rid) <= limit and _RID.fullmatch(rid):
        return ""
    return f"rid must be 1..{limit} characters of [{RID_CHARS}], got {shown(rid)}"


def parse_address(addr: str, flag: str = "address") -> tuple[str, int]:
    """host:port (IPv6 as [::1]:port) -> (host, port); ValueError naming the bad value."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: expected HOST:PORT with a port in [1, 65535], got {shown(addr)}")
    if host.startswith("[") != host.endswith("]") or ("[" not in host and ":" in host):
        raise ValueError(f"{flag}: bad host in {shown(addr)} (write IPv6 as [::1]:PORT)")
    return host, int(port)


def normalized_address(addr: str, flag: str = "address") -> str:
    """The one spelling of host:port that the pool keys nodes by (host lower case, port without
    leading zeros): `Localhost:050051` and `localhost:50051` are one node. ValueError as parse_address."""
    host, port = parse_address(addr, flag)
    if len(host) > 255:
        raise ValueError(f"{flag}: host over 255 characters in {shown(addr)}")
    return f"{host.lower()}:{port}"


ROOM_SHOWN_BITS = 24  # of a room number, in logs and in Admin listings of a process without an admin key


def room_tag(room: int) -> str:
    """A room as logs show it: its low 24 bits in hex, enough to follow one hand-off across the
    processes' logs; the room's number is not a secret (writes need its key), but stays unpublished."""
    return f"{room & ((1 << ROOM_SHOWN_BITS) - 1):06x}" if room else "0"


def listed_room(room: int, full: bool) -> int:
    """A room in an Admin listing: whole where Admin needs the admin key (`full`), else its low 24 bits."""
    return room if full else room & ((1 << ROOM_SHOWN_BITS) - 1)
