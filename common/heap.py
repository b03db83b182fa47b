"""What glibc's malloc keeps of the memory a process frees, and how to have it back: a request of a
few MiB (a body at the limit, a long prompt tokenized, a large answer) leaves its freed blocks in
the heap otherwise, where they stay counted in the process's resident memory. No-ops where the C
library is not glibc.

- `map_large_blocks`: from start-up on, every block of MMAP_THRESHOLD_BYTES or more gets a mapping
  of its own, unmapped the moment it is freed (glibc starts at 128 KiB but raises this threshold,
  up to 32 MiB, each time such a block is freed: after the first body of 4 MiB, later ones come
  from the heap and stay in it).
- `release_freed_heap`: hand back what is free in every arena now (after a large transient).

The environment's MALLOC_ARENA_MAX bounds the arenas (one per thread that allocates, up to 8 per
core): the threads that expand client input are few (common/text/prompts.py), so it need not be set.
"""

from __future__ import annotations

import ctypes

MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_libc = ctypes.CDLL(None)
_mallopt = getattr(_libc, "mallopt", None)
_malloc_trim = getattr(_libc, "malloc_trim", None)


def map_large_blocks() -> bool:
    """Blocks of MMAP_THRESHOLD_BYTES and more mapped on their own from now on (process-wide: call it
    at start-up); False where it could not be set."""
    return _mallopt is not None and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1


def release_freed_heap() -> None:
    """Hand the heap that the process freed back to the system (malloc_trim: every arena)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
