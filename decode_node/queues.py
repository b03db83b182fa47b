"""The queues a decode request waits in around the scheduler (pipeline/roles.py PhaseQueue).

    prealloc --(pages for the prompt + a reserve: an ADMIT entry; every rank expects the room:
    consensus DECODE_PREALLOCATED, the front registers it with the prefill node)--> transfer
    --(every rank holds its layers' pages and the first token arrived: consensus
    DECODE_TRANSFERRED)--> the scheduler, decoding, as a prebuilt request

    running --(out of pages: retracted, its KV copied to host memory)--> retracted
    --(pages again: RESUME, copied back; consensus DECODE_RETRACTED)--> running

Pages of a hand-off that failed while the KV may still have been landing rest in the quarantine.
"""

from __future__ import annotations

from kvbridge.consensus import Ruling, Verdict
from kvbridge.consensus import Stream as S
from kvbridge.engine.request import Phase, Request
from kvbridge.pipeline.roles import PhaseQueue


class PreallocQueue(PhaseQueue):
    """Waiting for pages, oldest first."""

    phases = frozenset({Phase.PREALLOC})


class TransferQueue(PhaseQueue):
    """Pages reserved, the KV on its way."""

    phases = frozenset({Phase.TRANSFERRING})

    def on_verdict(self, req: Request, ruling: Ruling) -> bool:
        """True when every rank holds its KV (it leaves the queue: it may join decoding)."""
        done = ruling.verdict == Verdict.READY and ruling.stream == S.DECODE_TRANSFERRED
        return done and self.remove(req)


class RetractedQueue(PhaseQueue):
    """KV in host memory: waiting for pages (RETRACTED, oldest first), then being copied back into
    the new ones on every rank (RESUMING: those pages are held)."""

    phases = frozenset({Phase.RETRACTED, Phase.RESUMING})

    def next_to_resume(self) -> Request | None:
        return next((r for r in self if r.phase is Phase.RETRACTED), None)

    def resuming(self) -> list[Request]:
        return [r for r in self if r.phase is Phase.RESUMING]

    def on_verdict(self, req: Request, ruling: Ruling) -> bool:
        """True when every rank has its KV back (it leaves the queue: it decodes again)."""
        done = ruling.verdict == Verdict.READY and ruling.stream == S.DECODE_RETRACTED
        return done and self.remove(req)


class Quarantine:
    """Pages of failed hand-offs, each request's held until its time: a prefill rank may still be
    writing into them (shared memory, GPU IPC), so they are handed out again only once every push
    that had started has landed."""

    def __init__(self) -> None:
        self._until: dict[str, tuple[float, Request]] = {}  # rid -> (free at, the request)

    def add(self, req: Request, until: float) -> None:
        self._until[req.rid] = (until, req)

    def due(self, now: float) -> list[Request]:
        """The requests whose time is up (no longer held here): free their pages."""
        out = [req for at, req in self._until.values() if now >= at]
        for req in out:
            del self._until[req.rid]
        return out

    def requests(self) -> list[Request]:
        return [req for _, req in self._until.values()]

    def rids(self) -> set[str]:
        return set(self._until)
