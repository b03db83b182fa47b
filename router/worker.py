"""The router's one worker thread, for CPU work too large for its event loop: a request body over
INLINE_BODY_BYTES parsed (router/http.py), a node's response over INLINE_RESPONSE_BYTES made into
its part of the answer (router/answer.py: 1,000 prompt tokens' logprobs with 20 alternatives are
~0.2 s of Python and JSON). One job at a time: a large job's objects take ~10 times its bytes
while they live (4 MiB of empty chat messages: ~35 MB).

The loop serves meanwhile (/health, other requests' tokens): the job's Python gives the GIL up
every switch interval (1 ms in a router process: router/cli.py GIL_SWITCH_S), and JSON it writes is
encoded in slices (`json_pieces`), never one long C call that would hold the GIL throughout.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from kvbridge.common.heap import release_freed_heap

SLICE_ITEMS = 64  # items of a long JSON list encoded in one call (20-alternative logprobs: ~1 ms)
_thread = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-worker")


async def offloaded(job: Callable, *args):
    """job(*args) in the worker thread, after the jobs before it; the heap it freed goes back to the
    system once it is done."""
    return await asyncio.get_running_loop().run_in_executor(_thread, _released, job, *args)


def _released(job: Callable, *args):
    try:
        return job(*args)
    finally:
        release_freed_heap()  # (the job's transient objects)


def json_pieces(obj) -> Iterator[str]:
    """json.dumps(obj) in pieces (joined: the same text), for JSON-able objects with string keys: a
    list longer than SLICE_ITEMS goes SLICE_ITEMS items a piece, each piece one C call (its items
    small: a token's logprobs), and the dicts and shorter lists around such lists are walked."""
    if isinstance(obj, dict):
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield (", " if i else "") + json.dumps(key) + ": "
            yield from json_pieces(value)
        yield "}"
    elif isinstance(obj, list) and len(obj) > SLICE_ITEMS:
        yield "["
        for start in range(0, len(obj), SLICE_ITEMS):
            yield (", " if start else "") + json.dumps(obj[start : start + SLICE_ITEMS])[1:-1]
        yield "]"
    elif isinstance(obj, list):
        yield "["
        for i, item in enumerate(obj):
            if i:
                yield ", "
            yield from json_pieces(item)
        yield "]"
    else:
        yield json.dumps(obj)
