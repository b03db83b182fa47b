"""A node's KV event stream (kvbridge.v1.KVEvents): what its prefix cache holds, for routers.

Rank 0 sends its cache's changes to the front after each step (pipeline/messages.py
CacheEvents). `KVEventHub`, on the server's event loop, keeps the set of block hashes they add
up to, numbers each batch (seq, from 1, consecutive) and hands it to every watcher. A watcher
first gets a snapshot (every block, as of the current seq), then each batch in order. One that
falls MAX_LAG batches behind (a slow reader) loses them and gets a fresh snapshot instead: it
never sees a gap, and the node never holds more than MAX_LAG batches for it.

Streams are bounded per caller (its peer host) and in all. A caller with MAX_WATCHERS_PER_CALLER
streams open that opens one more ends its own oldest (RESOURCE_EXHAUSTED, naming the limit): a
router restarted on its host is never shut out by streams its old self left half-open (or by a
client there that only holds streams), and one host cannot take every slot. Past MAX_WATCHERS in
all, a new stream is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvbridge.common.rpc import peer_host
from kvbridge.engine.prefix_cache import CLEARED, REMOVED, STORED
from kvbridge.pipeline.messages import CacheEvents
from kvbridge.v1 import kv_events_pb2, kv_events_pb2_grpc

MAX_LAG = 256  # batches queued for one watcher before it is resynced with a snapshot instead
MAX_WATCHERS = 64  # streams open at once; one more is refused (RESOURCE_EXHAUSTED)
MAX_WATCHERS_PER_CALLER = 8  # streams of one peer host; one more ends its oldest (RESOURCE_EXHAUSTED)
KINDS = {
    STORED: kv_events_pb2.KVEvent.STORED,
    REMOVED: kv_events_pb2.KVEvent.REMOVED,
    CLEARED: kv_events_pb2.KVEvent.CLEARED,
}
RESYNC = None  # queued for a watcher that lagged: its next batch is a snapshot
END = "end"  # queued by close_watchers(): the stream ends
REPLACED = "replaced"  # queued for a caller's oldest stream when it opens one too many: the stream fails


class KVEventHub:
    def __init__(self, page_size: int, role: str):
        self.page_size, self.role = page_size, role
        self.blocks: set[int] = set()  # every block hash rank 0's cache holds, as of `seq`
        self.seq = 0
        self._watchers: dict[asyncio.Queue, str] = {}  # each open stream's queue -> its caller, oldest first

    def apply(self, msg: CacheEvents) -> None:
        """On the loop: rank 0's changes, as one batch to every watcher."""
        self.seq += 1
        batch = kv_events_pb2.KVEventBatch(seq=self.seq, page_size=self.page_size, role=self.role)
        for kind, hashes in msg.events:
            if kind == STORED:
                self.blocks.update(hashes)
            elif kind == REMOVED:
                self.blocks.difference_update(hashes)
            else:
                self.blocks.clear()
            batch.events.add(kind=KINDS[kind], block_hashes=hashes)
        for q in self._watchers:
            if q.full():  # it lags: drop what it missed, it resyncs from a snapshot
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(RESYNC)
            else:
                q.put_nowait(batch)

    def snapshot(self) -> kv_events_pb2.KVEventBatch:
        batch = kv_events_pb2.KVEventBatch(seq=self.seq, snapshot=True, page_size=self.page_size, role=self.role)
        batch.events.add(kind=kv_events_pb2.KVEvent.STORED, block_hashes=sorted(self.blocks))
        return batch

    def close_watchers(self) -> int:
        """End every open stream (its watcher reconnects for a snapshot); how many there were."""
        closed, self._watchers = self._watchers, {}  # (nothing more is queued for them)
        for q in closed:
            _last(q, END)
        return len(closed)

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    def callers(self) -> dict[str, int]:
        """Open streams per caller."""
        counts: dict[str, int] = {}
        for caller in self._watchers.values():
            counts[caller] = counts.get(caller, 0) + 1
        return counts

    async def watch(self, caller: str = "") -> AsyncIterator[kv_events_pb2.KVEventBatch]:
        """A snapshot, then every batch after it (or a snapshot again, after lagging). OverflowError
        when no stream can be opened for `caller` (its peer host), or this one is ended for its newer one."""
        mine = [q for q, c in self._watchers.items() if c == caller]
        if len(mine) >= MAX_WATCHERS_PER_CALLER:
            del self._watchers[mine[0]]
            _last(mine[0], REPLACED)
        elif len(self._watchers) >= MAX_WATCHERS:
            raise OverflowError(
                f"{len(self._watchers)} KV event streams are open, the most a node serves (MAX_WATCHERS)"
            )
        q: asyncio.Queue = asyncio.Queue(MAX_LAG)
        self._watchers[q] = caller
        try:
            snap = self.snapshot()
            seen = snap.seq
            yield snap
            while True:
                batch = await q.get()
                if batch is END:
                    return
                if batch is REPLACED:
                    raise OverflowError(
                        f"{caller} opened a newer KV event stream: one caller may have {MAX_WATCHERS_PER_CALLER} "
                        "(MAX_WATCHERS_PER_CALLER); its oldest is ended"
                    )
                if batch is RESYNC:
                    batch = self.snapshot()
                elif batch.seq <= seen:  # (queued while it lagged: the snapshot has it)
                    continue
                seen = batch.seq
                yield batch
        finally:
            self._watchers.pop(q, None)


def _last(q: asyncio.Queue, item) -> None:
    """`item` is all `q` holds now: what its stream reads next."""
    while not q.empty():
        q.get_nowait()
    q.put_nowait(item)


class KVEventsService(kv_events_pb2_grpc.KVEventsServicer):
    def __init__(self, server):
        self.server = server  # serving/server.py NodeServer
        self._tokenizer: kv_events_pb2.TokenizerInfo | None = None

    async def _loaded(self, context):
        if self.server.node is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.server.role} node is still loading")
        return self.server.node

    async def Watch(self, request, context):
        node = await self._loaded(context)
        try:
            async for batch in node.front.kv_events.watch(peer_host(context.peer())):
                yield batch
        except OverflowError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    async def GetTokenizer(self, request, context):
        node = await self._loaded(context)
        if self._tokenizer is None:
            ranks = node.ranks
            if ranks.model.tokenizer is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the node's model has no tokenizer")
            self._tokenizer = kv_events_pb2.TokenizerInfo(
                tokenizer_json=await asyncio.to_thread(ranks.model.tokenizer.to_json),
                model_fingerprint=ranks.model.fingerprint,
                page_size=ranks.config.page_size,
                max_context=ranks.max_context,
            )
        return self._tokenizer
