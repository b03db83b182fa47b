"""The prefill rank's side: one Sender per (rank process, backend), with one worker thread.

The daemon's calls return at once; the worker runs them in order, so a room's pushes land
before its TransferDone notices go out. Backends (kv_transfer/backends/) subclass Sender and
fill in how to open a connection to one decode rank and how to write pages through it.

A revoked room (revoke(): the decode node gave up on it and will hand its pages to other
requests) is written no more: the worker checks, under the lock revoke() takes, that a room is
still connected before each write to each decode rank, and revoke() reports the room revoked
(`then`) only once no write into it is under way.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from kvbridge.common import tracing
from kvbridge.common.rpc import KV_MESSAGE_BYTES, make_channel
from kvbridge.engine.kv_pool import KVPool
from kvbridge.kv_transfer.layers import overlap
from kvbridge.kv_transfer.layout import NodeLayout, PageGeometry, RankInfo
from kvbridge.kv_transfer.poll import IllegalTransition, KVPoll, StatusBoard, StatusChange
from kvbridge.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)


MAX_STUBS = 64  # KVReceiver channels one sender keeps (decode ranks it writes to, across its rooms)


@dataclass(frozen=True)
class SenderConfig:
    deadline_s: float = 30.0  # every gRPC call: notices, first tokens, page streams
    grpc_chunk_bytes: int = 4 << 20  # page bytes per PageChunk message (grpc backend)
    torch_chunk_bytes: int = 64 << 20  # page bytes per torch message; <= the receivers' max_chunk_bytes
    torch_timeout_s: float = 120.0  # a torch pair's send/recv timeout; idle pairs are pinged well within it
    peer_idle_s: float = 300.0  # connections that no room used for this long are closed
    tick_s: float = 1.0  # how often the worker looks after idle connections


@dataclass(frozen=True)
class Target:
    """A decode rank that this prefill rank feeds in one room."""

    info: RankInfo  # the decode rank and its endpoints
    lo: int  # model layers [lo, hi) this rank writes there: the overlap of both ranges
    hi: int


@dataclass
class SenderRoom:
    """A room as the worker sees it."""

    room: int  # pairing key of the request
    decode: NodeLayout  # the decode node's layout, as registered
    targets: tuple[Target, ...]  # overlapping decode ranks, in rank order
    first_rank: RankInfo  # decode rank 0: where the first token goes
    dst_pages: frozenset[int]  # destination page ids the decode node registered
    secret: bytes  # the room's write key, minted by the decode node: every write and notice carries it
    bytes_sent: dict[int, int] = field(default_factory=dict)  # decode rank -> page bytes written so far
    first_token: int | None = None  # held for the TransferNotice to decode rank 0 (when it is a target)
    first_logprob: object = None  # and its kvbridge.v1.TokenLogprob (the request asked for logprobs)
    trace: str = ""  # the request's trace context: a push span per target, under it (common/tracing.py)
    push_ns: dict[int, int] = field(default_factory=dict)  # decode rank -> time spent writing to it
    spans: dict[int, object] = field(default_factory=dict)  # decode rank -> its push span (traced rooms)


@dataclass
class _Peer:
    conn: object  # the backend's connection to one decode rank
    rooms: set[int]  # rooms using it
    last_used: float  # time.monotonic() of the last write or ping


class Sender:
    """Pushes one prefill rank's pages to the decode ranks of each room. Call from one thread."""

    name = "base"  # the backend's name in make_sender

    def __init__(
        self,
        pool: KVPool,
        rank: int,
        config: SenderConfig | None = None,
        on_change: Callable[[StatusChange], None] | None = None,
    ):
        self.pool = pool
        self.rank = rank
        self.config = config or SenderConfig()
        self.layers = (pool.layer_start, pool.layer_end)
        self.geometry = PageGeometry.of_pool(pool)
        self.board = StatusBoard(on_change)
        self._rooms: dict[int, SenderRoom] = {}  # read by the worker, written by the caller under _lock
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._peers: dict[str, _Peer] = {}  # worker only: backend key -> connection
        self._stubs: dict[str, tuple[grpc.Channel, kv_transfer_pb2_grpc.KVReceiverStub]] = {}  # worker only
        self._writing: SenderRoom | None = None  # the room a write is copying into now (under _lock)
        self._after_write: list[Callable[[], None]] = []  # revoke()'s reports waiting for that write (under _lock)
        self.writes = 0  # writes started (one per decode rank a push reached); worker only
        self.writes_dropped = 0  # writes not made: their room was revoked (or forgotten) first; worker only
        self._last_maintain = time.monotonic()
        self._scratch_buf = torch.empty(0, dtype=torch.uint8, device=pool.buffer.device)  # worker only
        self._worker = threading.Thread(target=self._run, name=f"kv-sender-{self.name}-{rank}", daemon=True)
        self._worker.start()

    # ---- the daemon's calls (non-blocking) ----

    def connect(
        self, room: int, decode: NodeLayout, page_ids: Sequence[int], secret: bytes, rid: str = "", trace: str = ""
    ) -> None:
        """The decode node registered `room`: its layout, destination pages and write key. The room starts
        BOOTSTRAPPING and becomes WAITING_FOR_INPUT once every overlapping decode rank is reachable.
        `trace`: the request's traceparent (a span per decode rank pushed to goes under it)."""
        targets = tuple(
            Target(info, *both) for info in decode.ranks if (both := overlap(self.layers, info.layers)) is not None
        )
        self.board.add(room, rid)
        with self._lock:
            first = decode.ranks[0] if decode.ranks else RankInfo(0, 0, 0)
            r = self._rooms[room] = SenderRoom(room, decode, targets, first, frozenset(page_ids), secret, trace=trace)
        problem = self._registration_problem(decode, page_ids, targets)
        if problem:
            self.board.fail(room, problem)
            self._jobs.put(("notify_error", r, problem))  # the decode ranks would wait in vain
        else:
            self._jobs.put(("connect", r))
        self.board.flush()

    def push(self, room: int, src_page_ids: Sequence[int], dst_page_ids: Sequence[int], num_tokens: int) -> None:
        """Copy this rank's layers of pages src -> dst (pairwise) to every overlapping decode rank.
        num_tokens: prompt tokens now in the pages (for progress). A no-op once the room is terminal."""
        r = self._room(room)
        if len(src_page_ids) != len(dst_page_ids):
            raise ValueError(f"push of room {room}: {len(src_page_ids)} source pages, {len(dst_page_ids)} destinations")
        bad = [p for p in src_page_ids if not 0 <= p < self.pool.num_pages]
        if bad:
            raise ValueError(f"push of room {room}: source page {bad[0]} out of range [0, {self.pool.num_pages})")
        unknown = [q for q in dst_page_ids if q not in r.dst_pages]
        if unknown:
            raise ValueError(f"push of room {room}: destination page {unknown[0]} was not registered")
        self._jobs.put(("push", r, tuple(src_page_ids), tuple(dst_page_ids), num_tokens))

    def finish(self, room: int, num_tokens: int) -> None:
        """All pushes of the room are queued: once they landed, send TransferDone to every overlapping
        decode rank; SUCCESS when every one acknowledged."""
        self._jobs.put(("finish", self._room(room), num_tokens))

    def send_first_token(self, room: int, token: int, prompt_tokens: int, logprob=None) -> None:
        """Last prefill rank only, before finish(): the sampled first token, to decode rank 0. When
        this rank writes layers of decode rank 0 the token rides that rank's TransferNotice (one
        message on the critical path); otherwise it goes at once in a FirstToken call. `logprob`: its
        kvbridge.v1.TokenLogprob, when the request asked for logprobs."""
        self._jobs.put(("first_token", self._room(room), token, prompt_tokens, logprob))

    def abort(self, room: int, reason: str) -> None:
        """Fail the room here now, and tell its decode ranks (TransferDone with the error)."""
        r = self._room(room)
        if self.board.fail(room, reason):
            self._jobs.put(("notify_error", r, reason))
        self.board.flush()

    def forget(self, room: int) -> None:
        """The daemon is done with the room (it is terminal): revoke() without waiting. Jobs of the
        old room still queued are skipped (every job carries its SenderRoom), except an error
        notice, which still goes out."""
        self.revoke(room)

    def revoke(self, room: int, then: Callable[[], None] | None = None) -> None:
        """The decode node gave up on the room (or this node did): drop it, so that no write into its
        pages starts from now on, and call `then()` once none is under way: at once, or on the worker
        right after the write it is making into the room ends. Its pushes still queued are dropped
        (`writes_dropped`); its number may be connected again at once. A room not connected here is
        revoked already."""
        self.board.remove(room)
        with self._lock:
            r = self._rooms.pop(room, None)
            if r is not None and then is not None and self._writing is r:
                self._after_write.append(then)
                then = None
        if r is not None:
            self._jobs.put(("forget", r))
        if then is not None:
            if r is not None:
                self._settle()
            then()

    def push_seconds(self, room: int) -> float:
        """Time this rank spent writing the room's pages, over every decode rank (0 once forgotten)."""
        with self._lock:
            r = self._rooms.get(room)
        return sum(r.push_ns.values()) / 1e9 if r is not None else 0.0

    def poll(self, room: int) -> KVPoll:
        return self.board.poll(room)

    def reason(self, room: int) -> str:
        return self.board.reason(room)

    def pop_changes(self) -> list[StatusChange]:
        return self.board.pop_changes()

    def close(self) -> None:
        """Stop the worker after the queued jobs (a revoked room's are dropped), and close every connection."""
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- backend hooks ----

    def _key(self, info: RankInfo) -> str:
        """Connections are shared by every room that goes to the same decode rank endpoint."""
        return info.receiver_addr

    def _open(self, info: RankInfo, decode: NodeLayout) -> object:
        raise NotImplementedError

    def _write(self, conn, r: SenderRoom, target: Target, src: Sequence[int], dst: Sequence[int]) -> int:
        """Write layers [target.lo, target.hi) of room r's pages src -> dst; returns the page bytes written."""
        raise NotImplementedError

    def _sync(self, conn) -> None:
        """Make every write visible to the decode rank (before its notice goes out)."""

    def _settle(self) -> None:
        """Make every write issued so far land (revoke(), from the daemon's thread): for a backend
        whose writes return before their copy ends."""

    def _ping(self, conn) -> None:
        """Keep an idle connection alive."""

    def _close(self, conn) -> None:
        pass

    # ---- the worker ----

    def _registration_problem(self, decode: NodeLayout, page_ids: Sequence[int], targets) -> str:
        if decode.geometry != self.geometry:
            return f"page geometry differs: prefill {self.geometry}, decode {decode.geometry}"
        if not targets:
            return f"no decode rank overlaps prefill rank {self.rank}'s layers {self.layers}"
        bad = [q for q in page_ids if not 0 <= q < decode.num_pages]
        if bad:
            return f"destination page id {bad[0]} out of range [0, {decode.num_pages})"
        if any(not t.info.receiver_addr for t in targets):
            return "a decode rank has no receiver address"
        return ""

    def _room(self, room: int) -> SenderRoom:
        with self._lock:
            if room not in self._rooms:
                raise KeyError(f"room {room} is not connected on prefill rank {self.rank}")
            return self._rooms[room]

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.config.tick_s)
            except queue.Empty:
                job = ()
            if job is None:
                break
            try:
                if job:
                    self._do(job)
                self._maintain()
            except Exception:  # the worker must outlive any one job: later rooms depend on it
                log.exception("kv sender %s rank %d: job %s", self.name, self.rank, job[:2] if job else "maintain")
        for key in list(self._peers):
            self._drop_peer(key)
        for channel, _ in self._stubs.values():
            channel.close()

    def _do(self, job: tuple) -> None:
        kind, r = job[0], job[1]
        room = r.room
        with self._lock:
            current = self._rooms.get(room) is r  # (not forgotten, nor its number connected anew)
        if kind == "forget":
            self._forget(r)
            return
        if kind == "notify_error":  # sent even when the daemon forgot the room right after abort()
            self._notify(r, 0, job[2])
            return
        if not current:
            if kind == "push":
                self.writes_dropped += len(r.targets)
            return
        try:
            if room in self.board and not self.board.poll(room).is_terminal:
                getattr(self, f"_do_{kind}")(r, *job[2:])
        except Exception as e:
            # one line: a gRPC error's own str() is a multi-line dump
            reason = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
            if self._fail(room, reason):
                self._notify(r, 0, reason)
        self.board.flush()

    def _do_connect(self, r: SenderRoom) -> None:
        for t in r.targets:
            self._peer(t.info, r)
        self._advance(r.room, KVPoll.WAITING_FOR_INPUT)

    def _do_push(self, r: SenderRoom, src: tuple, dst: tuple, num_tokens: int) -> None:
        self._advance(r.room, KVPoll.TRANSFERRING)
        for t in r.targets:
            key, rank = self._key(t.info), t.info.rank
            conn = self._peer(t.info, r)
            if r.trace and rank not in r.spans:
                where = {"kvbridge.rank": self.rank, "kvbridge.decode_rank": rank, "kvbridge.backend": self.name}
                r.spans[rank] = tracing.start(
                    "kv push", r.trace, attributes=where | {"server.address": t.info.receiver_addr}
                )
            began = time.perf_counter_ns()
            with self._lock:  # (revoke() takes it: it drops the room before this, or waits for the write)
                if self._rooms.get(r.room) is not r:
                    self.writes_dropped += len(r.targets) - r.targets.index(t)
                    return
                self._writing = r
            try:
                n = self._write(conn, r, t, src, dst)
            except Exception:
                self._drop_peer(key)  # a broken connection is reopened by the next room
                raise
            finally:
                self._written()
            r.push_ns[rank] = r.push_ns.get(rank, 0) + time.perf_counter_ns() - began
            r.bytes_sent[rank] = r.bytes_sent.get(rank, 0) + n
            self._peers[key].last_used = time.monotonic()

    def _written(self) -> None:
        """A write ended (or failed): if revoke() waited for it, make it land (an asynchronous copy,
        cuda_ipc) and report the room revoked."""
        with self._lock:
            self._writing = None
            waiting, self._after_write = self._after_write, []
        self.writes += 1
        if waiting:
            self._settle()
            for then in waiting:
                then()

    def _do_finish(self, r: SenderRoom, num_tokens: int) -> None:
        for t in r.targets:
            self._sync(self._peer(t.info, r))
        errors = self._notify(r, num_tokens, "")
        for rank, span in r.spans.items():  # (each target's push span: its bytes, the time spent writing them)
            nbytes, seconds = r.bytes_sent.get(rank, 0), r.push_ns.get(rank, 0) / 1e9
            span.set_attribute("kvbridge.bytes", nbytes)
            span.set_attribute("kvbridge.push_seconds", seconds)
            span.set_attribute("kvbridge.gb_per_s", nbytes / seconds / 1e9 if seconds else 0.0)
            span.end()
        if errors:
            self._fail(r.room, "; ".join(errors))
        else:
            self._advance(r.room, KVPoll.SUCCESS)

    def _do_first_token(self, r: SenderRoom, token: int, prompt_tokens: int, logprob=None) -> None:
        if any(t.info == r.first_rank for t in r.targets):
            r.first_token, r.first_logprob = token, logprob  # its prompt_tokens are the notice's num_tokens
            return
        msg = kv_transfer_pb2.FirstTokenNotice(
            room=r.room, token=token, prompt_tokens=prompt_tokens, secret=r.secret, logprob=logprob
        )
        self._stub(r.first_rank.receiver_addr).FirstToken(msg, timeout=self.config.deadline_s)

    def _notify(self, r: SenderRoom, num_tokens: int, error: str) -> list[str]:
        """TransferDone to every target; returns the failures (empty when every one acknowledged)."""
        errors = []
        for t in r.targets:
            notice = kv_transfer_pb2.TransferNotice(
                room=r.room,
                src_rank=self.rank,
                layer_start=t.lo,
                layer_end=t.hi,
                num_tokens=num_tokens,
                bytes=r.bytes_sent.get(t.info.rank, 0),
                error=error,
                first_token=r.first_token if t.info == r.first_rank and not error else None,
                first_logprob=r.first_logprob if t.info == r.first_rank and not error else None,
                secret=r.secret,
                push_seconds=r.push_ns.get(t.info.rank, 0) / 1e9,
                traceparent=tracing.traceparent(r.spans[t.info.rank]) if t.info.rank in r.spans else "",
            )
            try:
                self._stub(t.info.receiver_addr).TransferDone(notice, timeout=self.config.deadline_s)
            except grpc.RpcError as e:
                errors.append(f"decode rank {t.info.rank} ({t.info.receiver_addr}): {e.code().name}: {e.details()}")
            except Exception as e:  # e.g. an address the channel cannot parse
                errors.append(f"decode rank {t.info.rank} ({t.info.receiver_addr!r}): {type(e).__name__}: {e}")
        return errors

    def _advance(self, room: int, state: KVPoll) -> None:
        with contextlib.suppress(IllegalTransition, KeyError):  # the daemon aborted or forgot it meanwhile
            self.board.advance(room, state)

    def _fail(self, room: int, reason: str) -> bool:
        try:
            return self.board.fail(room, reason)
        except KeyError:
            return False  # forgotten meanwhile

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A reusable uint8 buffer of at least nbytes on the pool's device (fresh memory would fault in)."""
        if self._scratch_buf.numel() < nbytes:
            self._scratch_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.pool.buffer.device)
        return self._scratch_buf

    def _stub(self, addr: str) -> kv_transfer_pb2_grpc.KVReceiverStub:
        """The KVReceiver at `addr` (an address a registration named): at most MAX_STUBS channels
        are kept, the least recently used closed first (the worker is done with it by then)."""
        if addr in self._stubs:
            self._stubs[addr] = self._stubs.pop(addr)  # the most recently used goes last
        else:
            channel = make_channel(addr, KV_MESSAGE_BYTES)
            self._stubs[addr] = (channel, kv_transfer_pb2_grpc.KVReceiverStub(channel))
            while len(self._stubs) > MAX_STUBS:
                self._stubs.pop(next(iter(self._stubs)))[0].close()
        return self._stubs[addr][1]

    def _peer(self, info: RankInfo, r: SenderRoom):
        key = self._key(info)
        if key not in self._peers:
            self._peers[key] = _Peer(self._open(info, r.decode), set(), time.monotonic())
        peer = self._peers[key]
        peer.rooms.add(r.room)
        return peer.conn

    def _drop_peer(self, key: str) -> None:
        peer = self._peers.pop(key, None)
        if peer is not None:
            with contextlib.suppress(Exception):  # closing a broken connection may fail too; it is gone anyway
                self._close(peer.conn)

    def _forget(self, r: SenderRoom) -> None:
        with self._lock:
            reused = r.room in self._rooms  # a new room of the same number uses the connections now
        if not reused:
            for peer in self._peers.values():
                peer.rooms.discard(r.room)

    def _maintain(self) -> None:
        """Ping connections idle for a quarter of the torch timeout; close unused ones."""
        now = time.monotonic()
        if now - self._last_maintain < self.config.tick_s:
            return
        self._last_maintain = now
        for key, peer in list(self._peers.items()):
            if not peer.rooms and now - peer.last_used > self.config.peer_idle_s:
                self._drop_peer(key)
            elif now - peer.last_used > self.config.torch_timeout_s / 4:
                try:
                    self._ping(peer.conn)
                    peer.last_used = now
                except Exception:
                    self._drop_peer(key)
