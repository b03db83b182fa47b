"""What a boundary accepts from the network, checked the same way at the router and at every
node's front (a node is reachable directly, not only through the router)."""

from __future__ import annotations

import re

from kvbridge.common.rpc import shown
from kvbridge.v1 import common_pb2

MAX_CLIENT_RID_CHARS = 128  # a request id a client chose (the router's check)
MAX_RID_CHARS = MAX_CLIENT_RID_CHARS + 32  # at a node: a client's rid and the router's ":retryN"
RID_CHARS = "A-Za-z0-9._:-"
_RID = re.compile(f"[{RID_CHARS}]+")


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


# ---------------------------------------------------------------- prompt sizes
# What a text or chat prompt may cost before it is expanded (rendered by the chat template,
# tokenized): checked on its size alone, by the router and by every node's front alike.

# a text or chat prompt over max_context * this many UTF-8 bytes cannot fit the context: it is
# refused before the tokenizer spends time on it (real text runs at 2-8 bytes per token)
PROMPT_BYTES_PER_TOKEN = 32
MAX_CHAT_MESSAGES = 4096  # messages of one chat prompt; more are refused before any is rendered


def prompt_bytes_limit(max_context: int) -> int:
    """The most UTF-8 bytes of a text or chat prompt (and of a chat as its template renders it)
    that could fit a context of `max_context` tokens."""
    return max_context * PROMPT_BYTES_PER_TOKEN


def prompt_size_problem(prompt: common_pb2.Prompt, max_context: int | None) -> str:
    """Why a prompt is refused by its size, before it is rendered, tokenized or looked at token by
    token ("" when it is not): a chat of over MAX_CHAT_MESSAGES messages, a text or chat (its
    contents and roles) over prompt_bytes_limit(max_context) UTF-8 bytes, token ids that fill the
    context (as the engine says it). `max_context` None (not known yet): the message count only."""
    kind = prompt.WhichOneof("kind")
    if kind == "chat" and len(prompt.chat.messages) > MAX_CHAT_MESSAGES:
        return f"prompt.chat has {len(prompt.chat.messages)} messages; at most {MAX_CHAT_MESSAGES}"
    if max_context is None or kind is None:
        return ""
    if kind == "token_ids":
        n = len(prompt.token_ids.ids)
        return f"prompt has {n} tokens; the context holds {max_context}" if n >= max_context else ""
    if kind == "text":
        return text_size_problem(prompt.text, max_context)
    size = sum(len(m.content.encode()) + len(m.role.encode()) for m in prompt.chat.messages)
    return _over(f"prompt.chat has {size} bytes", size, max_context)


def text_size_problem(text: str, max_context: int) -> str:
    """prompt_size_problem of a text prompt (its lone surrogates, refused elsewhere, count 3 bytes)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    return _over(f"prompt.text has {size} bytes", size, max_context)


def rendered_size_problem(text: str, max_context: int | None) -> str:
    """Why a chat as the chat template rendered it is refused before it is tokenized ("" when it is
    not): over prompt_bytes_limit(max_context) UTF-8 bytes (the template adds to every message)."""
    if max_context is None:
        return ""
    size = len(text.encode())
    return _over(f"prompt.chat renders to {size} bytes through the chat template", size, max_context)


def _over(what: str, size: int, max_context: int) -> str:
    limit = prompt_bytes_limit(max_context)
    if size <= limit:
        return ""
    return f"{what}; a prompt that fits the context of {max_context} tokens has at most {limit}"
