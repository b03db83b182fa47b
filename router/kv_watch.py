"""A node's KV events, watched for the router (`kvbridge.v1.KVEvents/Watch`, on the node's channel):
they keep the node's `BlockIndex` (router/kv_index.py), which cache-aware routing reads.

The first batch of a stream is a snapshot, then changes in seq order. A change batch out of
sequence (a gap) clears the index and re-opens the stream at once (its snapshot resyncs); a failed
or ended stream clears it (the node's state is unknown) and is re-opened after retry_s; a snapshot
on a stream already open (the node dropped changes this watcher was too slow for) replaces the set;
each is counted by `on_resync` ("gap", "error" when the index was synced, "lagged", "overflow" past
its bound). The stream is re-opened every KV_WATCH_DEADLINE_S (a fresh snapshot, not counted). A
node that answers UNIMPLEMENTED has no KV events: it is not watched again, and it caches nothing as
far as routing knows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from kvbridge.router.kv_index import BlockIndex, batch_from_proto
from kvbridge.v1 import kv_events_pb2, kv_events_pb2_grpc

if TYPE_CHECKING:
    from kvbridge.router.pool import Node

KV_WATCH_DEADLINE_S = 300.0  # a KV-event stream is re-opened this often (and starts with a snapshot)
INLINE_HASHES = 1 << 14  # KV batches carrying more hashes than this are applied in a worker thread


async def watch_kv(node: Node, retry_s: float, on_resync: Callable[[str], None]) -> None:
    """Runs until cancelled, or until the node says it has no KV events."""
    stub = kv_events_pb2_grpc.KVEventsStub(node.channel)
    index = node.blocks
    while True:
        pause = retry_s
        stream = stub.Watch(kv_events_pb2.WatchKVEventsRequest(), timeout=KV_WATCH_DEADLINE_S)
        try:
            first = True
            async for msg in stream:
                if msg.snapshot and not first:
                    on_resync("lagged")
                first = False
                verdict = await _apply(index, msg)
                if verdict is not None:  # cleared: a new stream starts with a snapshot
                    on_resync(verdict)
                    pause = 0.0 if verdict == "gap" else retry_s
                    break
            else:  # the node ended the stream: what it holds from now on is unknown
                _lost(index, on_resync)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                node.kv_events = False
                index.clear()
                return
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                continue  # the stream's own deadline: the next one's snapshot replaces the index
            _lost(index, on_resync)
        except ValueError:  # a batch that makes no sense
            _lost(index, on_resync)
        finally:
            stream.cancel()
        await asyncio.sleep(pause)


async def _apply(index: BlockIndex, msg: kv_events_pb2.KVEventBatch) -> str | None:
    if sum(len(e.block_hashes) for e in msg.events) <= INLINE_HASHES:
        return index.apply(batch_from_proto(msg))
    return await asyncio.to_thread(lambda: index.apply(batch_from_proto(msg)))


def _lost(index: BlockIndex, on_resync: Callable[[str], None]) -> None:
    """The stream broke: clear the index; a resync when it was synced."""
    if index.synced:
        on_resync("error")
    index.clear()
