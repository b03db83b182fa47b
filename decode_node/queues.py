"""The queues a decode request waits in around the scheduler (pipeline/roles.py PhaseQueue).

    prealloc --(pages for the prompt + a reserve: an ADMIT entry; every rank expects the room:
    consensus DECODE_PREALLOCATED, the front registers it with the prefill node)--> transfer
    --(every rank holds its layers' pages and the first token arrived: consensus
    DECODE_TRANSFERRED)--> the scheduler, decoding, as a prebuilt request

    running --(out of pages: retracted, its KV copied to host memory)--> retracted
    --(pages again: RESUME, copied back; consensus DECODE_RETRACTED)--> running

Pages of a hand-off that failed while the KV may still have been landing rest in the quarantine,
until the prefill node revoked the room on every rank (or its process died, or it never answered).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Resting:
    """A failed hand-off's pages in the quarantine."""

    req: Request  # the request (ended), owner of the pages
    until: float  # perf_counter time they are released at the latest
    why: str = "timeout"  # the release's reason if `until` comes first: "timeout", or "prefill_gone"


class Quarantine:
    """Pages of failed hand-offs, each request's held until the prefill node revoked its room: a
    prefill rank may still be writing into them (shared memory, GPU IPC), so they are handed out
    again only once no prefill rank writes into them (`revoked`), or once the prefill node's process
    is gone (`prefill_gone`: a short grace for its ranks to exit), or at the latest at their `until`."""

    def __init__(self) -> None:
        self._resting: dict[str, Resting] = {}  # rid -> its pages' rest

    def add(self, req: Request, until: float, why: str = "timeout") -> None:
        self._resting[req.rid] = Resting(req, until, why)

    def revoked(self, rid: str, room: int) -> Request | None:
        """The prefill node revoked `room`: its request, no longer held here (None: released already)."""
        rest = self._resting.get(rid)
        if rest is None or rest.req.handoff.room != room:
            return None
        del self._resting[rid]
        return rest.req

    def prefill_gone(self, peer: str, until: float) -> None:
        """The prefill node at `peer` died: its requests' pages are released by `until` (its ranks exit)."""
        for rest in self._resting.values():
            if rest.req.handoff.peer == peer and until < rest.until:
                rest.until, rest.why = until, "prefill_gone"

    def due(self, now: float) -> list[Resting]:
        """The rests whose time is up (no longer held here): free their pages."""
        out = [rest for rest in self._resting.values() if now >= rest.until]
        for rest in out:
            del self._resting[rest.req.rid]
        return out

    def requests(self) -> list[Request]:
        return [rest.req for rest in self._resting.values()]

    def rids(self) -> set[str]:
        return set(self._resting)
