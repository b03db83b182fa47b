"""What a server may put of a caller's value in an error: a bounded amount.

A gRPC status message travels in a trailer, and one over the channel's metadata limit (8-16 KiB)
never reaches the client as sent: it sees RESOURCE_EXHAUSTED or INTERNAL instead of the status the
server meant. An HTTP error has no such limit, but a client that sent 10 KB of junk learns nothing
more from getting it back. So a value in a message is `shown` (its repr, cut short), and every
status message and HTTP error message is `clipped` where it leaves the process (common/rpc_parse.py
for gRPC servers, router/openai_api.py `error_body` for the HTTP API) as a backstop.
"""

from __future__ import annotations

MAX_SHOWN_CHARS = 80  # of one value's repr in a message
MAX_MESSAGE_CHARS = 1024  # of a whole status or HTTP error message


def clipped(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text`, or its first `limit` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """A caller's value for an error message: its repr, clipped to `limit` characters."""
    return clipped(repr(value), limit)
