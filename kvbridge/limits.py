"""What a boundary accepts from the network, checked the same way at the router and at every
node's front (a node is reachable directly, not only through the router)."""

from __future__ import annotations

import re

from kvbridge.rpc import shown

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
