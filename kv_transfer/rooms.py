"""The decode rank's bookkeeping: which rooms it expects, from which prefill ranks, into which
pages, and what has landed. Every write and notice is checked here before a byte moves; a bad
one fails its room (never the process) and raises a TransferError whose code is the gRPC status.
Each carries the room's write key first: one without it is refused (PERMISSION_DENIED) and
changes nothing, so a party that knows a room's number but is not its prefill node can neither
write its pages nor fail it. No torch, no sockets."""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from kvbridge.kv_transfer.layers import LayerRange, overlap
from kvbridge.kv_transfer.poll import KVPoll, StatusBoard


class TransferError(Exception):
    code = "INTERNAL"  # the grpc.StatusCode name the KVReceiver service answers with


class RoomNotFound(TransferError):
    code = "NOT_FOUND"


class BadTransfer(TransferError):
    code = "INVALID_ARGUMENT"


class RoomClosed(TransferError):
    code = "FAILED_PRECONDITION"


class WrongKey(TransferError):
    code = "PERMISSION_DENIED"


@dataclass(frozen=True)
class Source:
    """A prefill rank that may write a room's pages here."""

    rank: int  # prefill rank
    layer_start: int  # its whole layer range [layer_start, layer_end)
    layer_end: int


@dataclass(frozen=True)
class Notice:
    """A prefill rank's TransferDone."""

    src_rank: int  # prefill rank
    layer_start: int  # the layers it wrote here: [layer_start, layer_end)
    layer_end: int
    num_tokens: int  # prompt tokens in the pages
    bytes: int  # page bytes it wrote here
    error: str = ""  # non-empty: it failed
    first_token: int | None = None  # the last prefill rank to decode rank 0: the sampled first token
    first_logprob: object = None  # and its kvbridge.v1.TokenLogprob, when the request asked for logprobs


@dataclass
class SourceProgress:
    lo: int  # model layers [lo, hi) this source writes here: its overlap with this rank
    hi: int
    covered: np.ndarray  # [room pages, hi - lo] bool: (page, layer) blocks landed via this rank's data path
    bytes_landed: int = 0  # page bytes landed via this rank's data path (grpc, torch)
    notice: Notice | None = None  # its TransferDone, once arrived


@dataclass
class Room:
    room: int  # pairing key
    rid: str  # request id, for messages
    direct: bool  # the backend writes into the pool itself (shm, cuda_ipc): its notices count the bytes
    page_ids: tuple[int, ...]  # destination pages, in prompt order (after the held ones)
    position: dict[int, int]  # page id -> index in page_ids
    sources: dict[int, SourceProgress]  # prefill rank -> progress
    secret: bytes  # its write key (16 bytes, minted by the decode node, known to its prefill node)
    held_pages: int = 0  # the prompt's first pages, held here already (the prefix cache): nobody writes them
    first_token: tuple[int, int] | None = None  # (token, prompt_tokens), rank 0 only
    first_logprob: object = None  # its kvbridge.v1.TokenLogprob (as received: the decode role checks it)
    writers: int = 0  # copies into its pages in flight; forget() waits for none
    expected_ns: int = field(default_factory=time.time_ns)  # when this rank began to expect its KV


@dataclass(frozen=True)
class WriteTicket:
    """A checked write, between begin_write and end_write."""

    room: Room  # the room written
    src: int  # prefill rank
    lo: int  # model layers [lo, hi)
    hi: int
    page_ids: tuple[int, ...]  # destination pages
    nbytes: int  # bytes of the write


class RoomTable:
    def __init__(
        self,
        rank: int,
        layers: LayerRange,
        num_pages: int,
        page_size: int,
        layer_block_bytes: int,
        awaits_first_token: bool,
        board: StatusBoard,
    ):
        self.rank = rank  # this decode rank
        self.layers = layers  # its model layers [start, end)
        self.num_pages = num_pages  # page ids are [0, num_pages)
        self.page_size = page_size  # tokens per page
        self.layer_block_bytes = layer_block_bytes  # bytes of one layer of one page
        self.awaits_first_token = awaits_first_token  # rank 0: SUCCESS also needs the first token
        self.board = board
        self._rooms: dict[int, Room] = {}
        self._cv = threading.Condition()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            with self._cv:
                yield
        finally:
            self.board.flush()

    # ---- the daemon ----

    def expect(
        self,
        room: int,
        rid: str,
        page_ids: Sequence[int],
        sources: Sequence[Source],
        direct: bool,
        secret: bytes,
        held_pages: int = 0,
    ) -> None:
        """Register a room: its destination pages (the prompt's pages after its first `held_pages`,
        which this node holds already), the prefill ranks (any; those overlapping this rank are kept)
        that will write them, and its write key. ValueError on a bad registration."""
        if held_pages < 0 or not (page_ids or held_pages):
            raise ValueError(f"room {room}: no pages ({len(page_ids)} to write, {held_pages} held)")
        if len(secret) != 16:
            raise ValueError(f"room {room}: a write key has 16 bytes, got {len(secret)}")
        bad = [p for p in page_ids if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"room {room}: page id {bad[0]} out of range [0, {self.num_pages})")
        if len(set(page_ids)) != len(page_ids):
            raise ValueError(f"room {room}: repeated page ids")
        progress = {}
        for s in sources:
            both = overlap((s.layer_start, s.layer_end), self.layers)
            if both is not None:
                progress[s.rank] = SourceProgress(*both, np.zeros((len(page_ids), both[1] - both[0]), bool))
        if not progress:
            raise ValueError(f"room {room}: no source overlaps decode rank {self.rank}'s layers {self.layers}")
        ids = tuple(page_ids)
        with self._locked():
            self.board.add(room, rid, KVPoll.WAITING_FOR_INPUT)
            position = {p: i for i, p in enumerate(ids)}
            self._rooms[room] = Room(room, rid, direct, ids, position, progress, secret, held_pages=held_pages)

    def forget(self, room: int, timeout_s: float = 30.0) -> None:
        """Drop a room, once no copy into its pages is in flight (its pages may then be reused)."""
        with self._locked():
            r = self._rooms.pop(room, None)
            if r is not None and not self._cv.wait_for(lambda: r.writers == 0, timeout_s):
                raise TimeoutError(f"room {room}: {r.writers} copies still in flight after {timeout_s}s")
            self.board.remove(room)

    def fail(self, room: int, reason: str) -> bool:
        with self._locked():
            return room in self._rooms and self.board.fail(room, reason)

    def first_token(self, room: int) -> tuple[int, int] | None:
        with self._cv:
            return self._get(room).first_token

    def first_logprob(self, room: int):
        with self._cv:
            return self._get(room).first_logprob

    def authentic(self, room: int, secret: bytes) -> bool:
        """`secret` is the write key of `room`, a room expected here."""
        with self._cv:
            r = self._rooms.get(room)
            return r is not None and hmac.compare_digest(r.secret, secret)

    # ---- the data path (grpc, torch) ----

    def begin_write(
        self, room: int, secret: bytes, src: int, lo: int, hi: int, page_ids: Sequence[int], nbytes: int
    ) -> WriteTicket:
        """Check a write before its bytes are copied into the pool."""
        with self._locked():
            r = self._open_room(room, secret)
            problem = self._write_problem(r, src, lo, hi, page_ids, nbytes)
            if problem:
                self.board.fail(room, problem)
                raise BadTransfer(problem)
            r.writers += 1
            self.board.advance(room, KVPoll.TRANSFERRING)
            return WriteTicket(r, src, lo, hi, tuple(page_ids), nbytes)

    def end_write(self, t: WriteTicket, error: str = "") -> None:
        """The ticket's copy finished (or failed with `error`)."""
        with self._locked():
            t.room.writers -= 1
            self._cv.notify_all()
            if t.room.room not in self._rooms or self.board.poll(t.room.room).is_terminal:
                return
            if error:
                self.board.fail(t.room.room, error)
                return
            s = t.room.sources[t.src]
            s.bytes_landed += t.nbytes
            s.covered[[t.room.position[p] for p in t.page_ids], t.lo - s.lo : t.hi - s.lo] = True
            self._try_complete(t.room)

    # ---- notices ----

    def done(self, n: Notice, room: int, secret: bytes) -> int:
        """A prefill rank's TransferDone; returns when this rank began to expect the room (time.time_ns())."""
        with self._locked():
            r = self._open_room(room, secret)
            s = r.sources.get(n.src_rank)
            if n.error:
                self.board.fail(room, f"prefill rank {n.src_rank}: {n.error}")
                return r.expected_ns
            problem = self._notice_problem(r, s, n)
            if problem:
                self.board.fail(room, problem)
                raise BadTransfer(problem)
            if n.first_token is not None:
                self._take_first_token(r, n.first_token, n.num_tokens, n.first_logprob)
            s.notice = n
            self._try_complete(r)
            if self.board.poll(room) == KVPoll.FAILED:  # the accounting failed: tell the sender why
                raise BadTransfer(self.board.reason(room))
            return r.expected_ns

    def set_first_token(self, room: int, secret: bytes, token: int, prompt_tokens: int, logprob=None) -> None:
        with self._locked():
            if not self.awaits_first_token:
                raise RoomClosed(f"decode rank {self.rank} takes no first tokens (rank 0 does)")
            r = self._open_room(room, secret)
            self._take_first_token(r, token, prompt_tokens, logprob)
            self._try_complete(r)
            if self.board.poll(room) == KVPoll.FAILED:
                raise BadTransfer(self.board.reason(room))

    def _take_first_token(self, r: Room, token: int, prompt_tokens: int, logprob=None) -> None:
        if not self.awaits_first_token:
            raise RoomClosed(f"decode rank {self.rank} takes no first tokens (rank 0 does)")
        if r.first_token not in (None, (token, prompt_tokens)):
            problem = f"second first token {(token, prompt_tokens)} after {r.first_token} for room {r.room}"
            self.board.fail(r.room, problem)
            raise BadTransfer(problem)
        r.first_token, r.first_logprob = (token, prompt_tokens), logprob

    # ---- checks (called under the lock) ----

    def _get(self, room: int) -> Room:
        if room not in self._rooms:
            raise RoomNotFound(f"room {room} is not expected on decode rank {self.rank}")
        return self._rooms[room]

    def _open_room(self, room: int, secret: bytes) -> Room:
        r = self._get(room)
        if not hmac.compare_digest(r.secret, secret):  # before anything that could change the room
            raise WrongKey(f"room {room}: the write key is not the room's (only its prefill node has it)")
        state = self.board.poll(room)
        if state.is_terminal:
            why = f": {self.board.reason(room)}" if state == KVPoll.FAILED else ""
            raise RoomClosed(f"room {room} is already {state.name}{why}")
        return r

    def _write_problem(self, r: Room, src: int, lo: int, hi: int, page_ids: Sequence[int], nbytes: int) -> str:
        s = r.sources.get(src)
        if s is None:
            return f"prefill rank {src} is not a source of room {r.room} on decode rank {self.rank}"
        if not s.lo <= lo < hi <= s.hi:
            return (
                f"layers [{lo}, {hi}) are outside prefill rank {src}'s overlap [{s.lo}, {s.hi}) "
                f"with decode rank {self.rank}"
            )
        if not page_ids:
            return "a write with no pages"
        for p in page_ids:
            if not 0 <= p < self.num_pages:
                return f"page id {p} out of range [0, {self.num_pages})"
            if p not in r.position:
                return f"page id {p} is not registered for room {r.room}"
        expected = len(page_ids) * (hi - lo) * self.layer_block_bytes
        if nbytes != expected:
            return f"{nbytes} bytes for {len(page_ids)} pages x {hi - lo} layers; expected {expected}"
        return ""

    def _notice_problem(self, r: Room, s: SourceProgress | None, n: Notice) -> str:
        if s is None:
            return f"prefill rank {n.src_rank} is not a source of room {r.room} on decode rank {self.rank}"
        if (n.layer_start, n.layer_end) != (s.lo, s.hi):
            return (
                f"notice for layers [{n.layer_start}, {n.layer_end}) from prefill rank {n.src_rank}; "
                f"its overlap with decode rank {self.rank} is [{s.lo}, {s.hi})"
            )
        held, capacity = r.held_pages * self.page_size, (r.held_pages + len(r.page_ids)) * self.page_size
        low = held if not r.page_ids else held + 1  # (a prompt held whole fills exactly its held pages)
        if not max(low, 1) <= n.num_tokens <= capacity:
            return f"num_tokens {n.num_tokens} outside [{max(low, 1)}, {capacity}] (the room's pages)"
        if s.notice is not None and s.notice != n:
            return f"second notice from prefill rank {n.src_rank} differs: {n} after {s.notice}"
        return ""

    def _try_complete(self, r: Room) -> None:
        """SUCCESS once every source's notice arrived and its bytes are accounted for."""
        notices = [s.notice for s in r.sources.values()]
        if any(n is None for n in notices):
            return
        tokens = {n.num_tokens for n in notices}
        if len(tokens) > 1:
            self.board.fail(r.room, f"prefill ranks disagree on num_tokens: {sorted(tokens)}")
            return
        num_tokens = tokens.pop()
        need = -(-num_tokens // self.page_size) - r.held_pages  # pages holding the prompt, less the held ones
        for src, s in r.sources.items():
            problem, waiting = self._accounting(r, src, s, need)
            if problem:
                self.board.fail(r.room, problem)
                return
            if waiting:
                return
        if self.awaits_first_token:
            if r.first_token is None:
                return
            if r.first_token[1] != num_tokens:
                self.board.fail(r.room, f"first token says {r.first_token[1]} prompt tokens, notices {num_tokens}")
                return
        self.board.advance(r.room, KVPoll.SUCCESS)

    def _accounting(self, r: Room, src: int, s: SourceProgress, need: int) -> tuple[str, bool]:
        """(problem, still waiting) for one source whose notice arrived."""
        n, block = s.notice, (s.hi - s.lo) * self.layer_block_bytes
        if r.direct and s.bytes_landed == 0:
            if n.bytes < need * block or n.bytes % self.layer_block_bytes:
                return f"prefill rank {src} reports {n.bytes} bytes; {need} pages need {need * block}", False
            return "", False
        if s.bytes_landed > n.bytes:
            return f"prefill rank {src}: {s.bytes_landed} bytes landed, its notice says {n.bytes}", False
        if s.bytes_landed < n.bytes:
            return "", True  # bytes still on the way (torch data can overtake the gRPC notice)
        if not s.covered[:need].all():
            missing = [r.page_ids[i] for i in np.flatnonzero(~s.covered[:need].all(axis=1))]
            return f"prefill rank {src} never wrote pages {missing[:8]} of the prompt", False
        return "", False
