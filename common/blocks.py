"""Block hashes: the names of full KV pages, the same on every node and the router.

Block i of a sequence is tokens [i * page_size, (i + 1) * page_size). Its hash chains its
parent's (the block before it; for block 0, a root derived from the request's cache salt) with
its token ids, so equal hashes mean equal whole prefixes, not only equal pages:

    h(0) = H(root(salt) || tokens of block 0),   h(i) = H(h(i - 1) || tokens of block i)

H is BLAKE2b with an 8-byte digest; hashes are unsigned 64-bit ints (KVEvents block_hashes).
Only full blocks have hashes: a partial last page is never shared.
"""

from __future__ import annotations

import hashlib
from array import array

MAX_SALT_BYTES = 256  # a cache_salt longer than this is refused at the fronts (salt_problem)


def salt_problem(salt: str) -> str:
    """Why a request's cache_salt is refused ("" when it is not): the one rule of router and nodes."""
    size = len(salt.encode())
    return f"cache_salt is {size} UTF-8 bytes; at most {MAX_SALT_BYTES}" if size > MAX_SALT_BYTES else ""


def root(salt: str = "") -> bytes:
    """The parent of block 0 for requests with this cache salt."""
    return hashlib.blake2b(salt.encode(), digest_size=8, person=b"kvb-root").digest()


def extend(hashes: list[int], token_ids: list[int], page_size: int, salt: str = "") -> list[int]:
    """Append the hashes of the full blocks of `token_ids` that `hashes` (its first blocks, already
    hashed) lacks; returns `hashes`. Incremental: a growing sequence hashes each block once."""
    parent = hashes[-1].to_bytes(8, "little") if hashes else root(salt)
    for i in range(len(hashes), len(token_ids) // page_size):
        block = array("I", token_ids[i * page_size : (i + 1) * page_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


def block_hashes(token_ids: list[int], page_size: int, salt: str = "") -> list[int]:
    """The hashes of every full block of `token_ids`."""
    return extend([], token_ids, page_size, salt)
