"""The KVReceiver gRPC service of a decode rank: the thin adapter between kvbridge.v1 messages
and the receiver (kv_transfer/receiver.py). Checks are the room table's; a TransferError
becomes its gRPC status with the message naming the bad value.

It serves on the rank's event loop (grpc.aio, common/rpc.py AioServer): a stream costs a
coroutine, never a worker thread, so no number of open streams keeps a TransferDone or
FirstToken from landing. Room-table calls and page copies run on worker threads
(asyncio.to_thread): the table's lock is shared with the torch engine's threads and the
daemon, and a copy into the pool moves up to a chunk (MiBs).

A WritePages stream must show its key at once and keep moving:
- its first PageChunk must come within the idle limit (ReceiverConfig.stream_idle_s,
  `--kv-stream-idle-s`) and, like every chunk, carry its room's write key (a wrong one is
  PERMISSION_DENIED before a byte moves); each later chunk must follow within the same limit.
  A stream that waits longer ends with DEADLINE_EXCEEDED.
- Streams still waiting for their first chunk are few: at most MAX_UNKEYED_STREAMS_PER_PEER per
  peer host (context.peer()) and MAX_UNKEYED_STREAMS in all. One more ends the oldest waiting
  stream (of its host; in all) with RESOURCE_EXHAUSTED, naming the limit. The newest one wins
  because a prefill rank's first chunk follows its stream's start at once: a host's silent
  streams cannot shut out a sender, even one on the same host (all local processes share
  127.0.0.1), unless they keep opening that many streams within that moment.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from kvbridge.common import tracing
from kvbridge.common.rpc import peer_host
from kvbridge.common.rpc_parse import rejected
from kvbridge.kv_transfer.rooms import Notice, TransferError
from kvbridge.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

STREAM_IDLE_S = 10.0  # default of ReceiverConfig.stream_idle_s (a sender's chunks come milliseconds apart)
MAX_UNKEYED_STREAMS_PER_PEER = 16  # WritePages streams of one peer host waiting for their first chunk
MAX_UNKEYED_STREAMS = 256  # ... of every peer together


@dataclass(eq=False)
class Waiting:
    """A WritePages stream waiting for its first chunk."""

    peer: str  # its peer host
    deadline: asyncio.Timeout | None = None  # the timeout of its wait, once it waits
    why: str = ""  # set when newer streams pushed it out: the message it ends with

    def end(self, why: str) -> None:
        self.why = why
        if self.deadline is not None:
            self.deadline.reschedule(asyncio.get_running_loop().time())  # (its wait ends now, as timed out)


class WaitingStreams:
    """The WritePages streams waiting for their first chunk, oldest first, per peer host and in
    all; one past a limit ends the oldest. Used on the event loop only."""

    def __init__(self, per_peer: int = MAX_UNKEYED_STREAMS_PER_PEER, total: int = MAX_UNKEYED_STREAMS):
        self.per_peer, self.total = per_peer, total
        self._all: dict[Waiting, None] = {}  # oldest first
        self._by_peer: dict[str, dict[Waiting, None]] = {}  # peer host -> its waiting streams, oldest first

    def add(self, peer: str) -> Waiting:
        w = Waiting(peer)
        self._all[w] = None
        mine = self._by_peer.setdefault(peer, {})
        mine[w] = None
        if len(mine) > self.per_peer:
            self._end(
                next(iter(mine)),
                f"{peer} opened a newer KV stream: a peer host may have at most {self.per_peer} waiting for "
                "their first chunk (MAX_UNKEYED_STREAMS_PER_PEER); its oldest is ended",
            )
        if len(self._all) > self.total:
            self._end(
                next(iter(self._all)),
                f"at most {self.total} KV streams may wait for their first chunk (MAX_UNKEYED_STREAMS); "
                "the oldest is ended",
            )
        return w

    def remove(self, w: Waiting) -> None:
        if w in self._all:
            del self._all[w]
            mine = self._by_peer[w.peer]
            del mine[w]
            if not mine:
                del self._by_peer[w.peer]

    def count(self, peer: str | None = None) -> int:
        return len(self._all) if peer is None else len(self._by_peer.get(peer, ()))

    def _end(self, w: Waiting, why: str) -> None:
        self.remove(w)
        w.end(why)


class KVReceiverServicer(kv_transfer_pb2_grpc.KVReceiverServicer):
    def __init__(self, receiver, idle_s: float = STREAM_IDLE_S, waiting: WaitingStreams | None = None):
        self._receiver = receiver  # a KVReceiverEndpoint
        self.idle_s = idle_s  # the longest wait for a stream's next chunk, seconds
        self.waiting = waiting or WaitingStreams()

    async def WritePages(self, request_iterator, context):
        waiting = self.waiting.add(peer_host(context.peer()))
        try:
            chunk = await self._next(context, "of the stream's start", waiting)
        finally:
            self.waiting.remove(waiting)
        landed = 0
        while chunk is not None:
            landed += await self._call(context, self._write, chunk)
            chunk = await self._next(context, "of the last one")
        return kv_transfer_pb2.TransferAck(bytes=landed)

    async def _next(self, context, since: str, waiting: Waiting | None = None):
        """The stream's next PageChunk (None at its end); or the call ends, when none comes within
        the idle limit or newer streams push this one out while it waits for its first."""
        try:
            async with asyncio.timeout(self.idle_s) as deadline:
                if waiting is not None:
                    waiting.deadline = deadline
                    if waiting.why:
                        deadline.reschedule(asyncio.get_running_loop().time())
                # (awaited in the handler's own task: made a task of its own, grpc.aio's read was seen
                # to complete only when the loop next woke for something else)
                chunk = await context.read()
        except TimeoutError:
            if waiting is not None and waiting.why:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, waiting.why)
            why = f"no PageChunk within {self.idle_s:g} s {since} (the KV stream idle limit, --kv-stream-idle-s)"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)
        await rejected(chunk, context)  # (one that does not parse: INVALID_ARGUMENT)
        return None if chunk is grpc.aio.EOF else chunk

    def _write(self, c: kv_transfer_pb2.PageChunk) -> int:
        page_ids = list(c.page_ids)
        return self._receiver.write_bytes(c.room, c.secret, c.src_rank, c.layer_start, c.layer_end, page_ids, c.data)

    async def TransferDone(self, request, context):
        await self._call(context, self._done, request)
        return kv_transfer_pb2.TransferAck(bytes=request.bytes)

    def _done(self, n: kv_transfer_pb2.TransferNotice) -> None:
        first = n.first_token if n.HasField("first_token") else None
        logprob = n.first_logprob if n.HasField("first_logprob") else None
        notice = Notice(n.src_rank, n.layer_start, n.layer_end, n.num_tokens, n.bytes, n.error, first, logprob)
        expected_ns = self._receiver.rooms.done(notice, n.room, n.secret)
        if n.traceparent and not n.error:  # (a child of the source's push span: the trace crosses the hand-off)
            rank, layers = self._receiver.rooms.rank, [n.layer_start, n.layer_end]
            where = {"kvbridge.rank": rank, "kvbridge.prefill_rank": n.src_rank, "kvbridge.layers": layers}
            where |= {"kvbridge.bytes": n.bytes, "kvbridge.push_seconds": n.push_seconds}
            tracing.record("kv landed", n.traceparent, expected_ns, time.time_ns(), where)

    async def FirstToken(self, request, context):
        await self._call(context, self._first_token, request)
        return kv_transfer_pb2.TransferAck()

    def _first_token(self, r: kv_transfer_pb2.FirstTokenNotice) -> None:
        logprob = r.logprob if r.HasField("logprob") else None
        self._receiver.rooms.set_first_token(r.room, r.secret, r.token, r.prompt_tokens, logprob)

    @staticmethod
    async def _call(context, fn, message):
        """fn(message) on a worker thread; a TransferError ends the call with its status."""
        try:
            return await asyncio.to_thread(fn, message)
        except TransferError as e:
            await context.abort(grpc.StatusCode[e.code], str(e))
