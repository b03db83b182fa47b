"""Rank 0 of a decode node: the role its loop runs (pipeline/roles.py), and the queues around the
scheduler (decode_node/queues.py).

A handed-off request's prompt is never recomputed here (but choices i > 0 of an n > 1 request, local
requests without a room that share its pages once they arrive, compute their last partial page: see
engine/scheduler.py; and a local prefill, a request the router sent without a prefill node, is
computed here as on a colocated node, its chunks beside the decodes): its pages are preallocated,
every rank expects the room, the prefill node writes the KV straight into them, and the request
joins decoding with the first token the prefill node sampled. The prompt's first pages may be found
in this node's prefix cache: those are shared, not preallocated, and the prefill node moves only the
pages after them.
Out of pages, the scheduler retracts instead of recomputing: the newest running request's KV goes
to host memory on every rank and comes back when pages free up. A failure on any rank (consensus
FAILED), a failed registration, a prefill node gone, or an abort ends the request on every rank
and frees its pages: at once, unless the prefill node may be writing into them (the hand-off was
under way). Those rest in the quarantine until the prefill node says that no rank of it writes
there any more: the front asks it (Quarantined; Bootstrap.Revoke) and tells rank 0 (Revoked).
"""

from __future__ import annotations

import logging
import time

from kvbridge.common.limits import room_tag
from kvbridge.common.logs import log_event
from kvbridge.consensus import Stream as S
from kvbridge.consensus import Verdict
from kvbridge.decode_node.queues import PreallocQueue, Quarantine, RetractedQueue, TransferQueue
from kvbridge.engine.logits import logprob_from_proto
from kvbridge.engine.pages import PageAllocator
from kvbridge.engine.request import Handoff, Phase, Request
from kvbridge.kv_transfer.handoff import Destination
from kvbridge.pipeline.control import ControlChannel
from kvbridge.pipeline.log import ABORT, APPEND, FINISH, RESUME, RETRACT, Appended, Pages
from kvbridge.pipeline.messages import Add, Fail, PeerDown, Preallocated, Quarantined, Revoked, Token
from kvbridge.pipeline.rank0 import Rank0Loop
from kvbridge.pipeline.roles import Deadlines, live_rulings

# A failed hand-off's pages rest until the prefill node revoked the room on every rank. One that is
# alive but never confirms (a rank stuck, the node unreachable without dying) gets this long, then
# they are released with an error (event=quarantine_timeout) and counted: well past the prefill
# node's own transfer timeout (its request ends then, every rank revoking the room) and a sender's
# longest call (kv_transfer/sender.py SenderConfig.deadline_s).
QUARANTINE_MAX_S = 300.0
# The prefill node's process died (PrefillPeers saw its health stream break): a rank whose front is
# gone drops its rooms and exits within 5 s (pipeline/group.py _exit_with_parent); then nothing writes.
PREFILL_GONE_GRACE_S = 6.0
AWAITING_KV = (Phase.PREALLOC, Phase.TRANSFERRING)  # phases that still need the prefill node
log = logging.getLogger("kvbridge.decode")


def destination_problem(alloc: PageAllocator, owner: str, pages: list[int]) -> str:
    """Why `pages` may not be a hand-off's destination ("" when they may): the prefill node
    overwrites them, so each must be held by `owner` alone and indexed by no prefix cache entry
    (a cached page is KV that other requests read)."""
    shared = [p for p in pages if alloc.holders(p) != {owner}]
    cached = [p for p in pages if alloc.cache is not None and alloc.cache.indexed(p)]
    if shared or cached:
        return f"{owner}: destination pages held by others {shared[:8]} or cached {cached[:8]}"
    return ""


class DecodeRole:
    name = "decode"

    def __init__(self, chan: ControlChannel, receiver, reserve_tokens: int = 64):
        self.chan = chan
        self.receiver = receiver  # rank 0's KV receiver: where the first token arrives
        self.reserve_tokens = reserve_tokens  # free room kept for decoding when preallocating
        self.prealloc = PreallocQueue()
        self.transfer = TransferQueue()
        self.retracted = RetractedQueue()
        self.quarantine = Quarantine()
        self.deadlines = Deadlines()

    def bind(self, loop: Rank0Loop) -> None:
        self.loop = loop
        self.config = loop.scheduler.config
        assert loop.scheduler.evict == "retract", "a decode node cannot recompute a prompt it never had"

    # ---------------------------------------------------------------- inputs

    def admit(self, req: Request, add: Add) -> None:
        # no pairing: a local prefill (the router's choice: the prompt is computed here, chunked beside the
        # decodes, from this node's cached prefix) or a choice of an n > 1 request (add.fork_of: from its
        # parent's pages)
        if add.pairing is None:
            self.loop.move(req, Phase.WAITING)
            self.loop.scheduler.add(req)
            return
        p = add.pairing
        req.handoff = Handoff(p.room, p.peer, p.sources, p.backend, p.secret)
        if any(r.handoff and r.handoff.room == p.room for r in self.loop.requests.values() if r is not req):
            req.finish_reason = "error"
            error = f"room {p.room} is in use by another request"
            self.loop.retire(req, ABORT, error=error, code="ALREADY_EXISTS")
            return
        req.handoff.expires(req.arrival_s, self.config.prealloc_timeout_s, "prealloc")
        self.loop.move(req, Phase.PREALLOC)
        self.prealloc.admit(req)

    def handle(self, msg: object) -> bool:
        match msg:
            case Fail(rid, code, error):
                if rid in self.loop.requests:  # (else: the request ended already)
                    self.fail(self.loop.requests[rid], error, code)
            case PeerDown(addr):  # the prefill node died: requests still waiting for its KV cannot get it
                for req in [r for r in self.loop.requests.values() if r.handoff and r.handoff.peer == addr]:
                    if req.phase in AWAITING_KV:
                        self._end(req, f"the prefill node {addr} is unreachable", "UNAVAILABLE", ask=False)
                self.quarantine.prefill_gone(addr, time.perf_counter() + PREFILL_GONE_GRACE_S)
            case Revoked(rid, room):  # no rank of the prefill node writes into its pages any more
                if (req := self.quarantine.revoked(rid, room)) is not None:
                    self._release(req, "revoked")
            case _:
                return False
        return True

    # ---------------------------------------------------------------- consensus, queues, timeouts

    def undecided(self) -> bool:
        return self.chan.has_changes

    def tick(self, now: float) -> None:
        for req, ruling in live_rulings(self.chan, self.loop):
            if ruling.verdict in (Verdict.FAILED, Verdict.ABORTED):
                self.fail(req, "the KV transfer failed on a decode rank", "UNAVAILABLE")
            elif ruling.stream == S.DECODE_PREALLOCATED:
                # every rank expects the room: the front may now register it with the prefill node
                req.handoff.preallocated_s = time.perf_counter()
                h = req.handoff
                h.kv_pages = len(req.page_table.pages) - h.held_pages
                h.kv_bytes = h.kv_pages * self.loop.page_bytes_all_layers()
                self.loop.outbox.put(Preallocated(req.rid, tuple(req.page_table.pages[h.held_pages :]), h.held_pages))
            elif self.transfer.on_verdict(req, ruling):
                self._join(req)
            elif self.retracted.on_verdict(req, ruling):  # every rank has its KV back
                self.loop.scheduler.running.append(req)
                self.loop.move(req, Phase.DECODING)
        for rest in self.quarantine.due(now):
            self._release(rest.req, "shutdown" if self.loop.stopping else rest.why)
        self._resume()
        self._preallocate()
        if self.deadlines.time_to_look(now):
            for req in self.deadlines.overdue(self.loop, now):
                self._time_out(req)

    def _time_out(self, req: Request) -> None:
        config = self.config
        if req.handoff.timeout == "prealloc":
            why = f"no KV pages for the request within {config.prealloc_timeout_s:g} s"
            self.fail(req, why, "RESOURCE_EXHAUSTED", timeout="prealloc")
        else:
            why = f"the KV cache did not arrive within {config.transfer_timeout_s:g} s"
            self.fail(req, why, "DEADLINE_EXCEEDED", timeout="transfer")

    def evicted(self, req: Request, pages: list[int]) -> None:
        """The scheduler freed a running request's pages: every rank copies them out first (the
        RETRACT entry reaches each rank before any step that could reuse them)."""
        self.loop.decide(RETRACT, req.rid, info=Pages(tuple(pages)))
        self.loop.move(req, Phase.RETRACTED, pages=len(pages))
        self.retracted.admit(req)
        self.loop.recorder.retracted()

    def _resume(self) -> None:
        """Retracted requests get pages back before new ones are preallocated (they are older)."""
        alloc = self.loop.scheduler.allocator
        while (req := self.retracted.next_to_resume()) is not None:
            need = req.page_table.num_pages_needed(req.num_computed)
            if not alloc.can_allocate(need + 1):  # and room to grow, or it would be retracted again at once
                return
            req.page_table.pages = alloc.allocate(req.rid, need)
            self.loop.move(req, Phase.RESUMING)
            self.loop.decide(RESUME, req.rid, info=Pages(tuple(req.page_table.pages)))

    def _preallocate(self) -> None:
        scheduler, ps = self.loop.scheduler, self.loop.pool.page_size
        alloc = scheduler.allocator
        while (req := self.prealloc.first()) is not None:
            held = scheduler.cached_prefix(req, full_hit=True)  # (the whole prompt may be here)
            need = -(-len(req.prompt_ids) // ps) - len(held)
            reserve = -(-min(self.reserve_tokens, req.params.max_new_tokens) // ps)
            reserve = min(
                reserve, alloc.num_pages - need - len(held)
            )  # never more than the pool: it would wait for ever
            if not alloc.can_take(need + reserve, held):
                return
            self.prealloc.remove(req)
            scheduler.reuse(req, held, len(req.prompt_ids))
            moved = alloc.allocate(req.rid, need)
            if problem := destination_problem(alloc, req.rid, moved):  # (the prefill node writes these)
                raise AssertionError(problem)
            req.page_table.pages += moved
            h = req.handoff
            h.held_pages = len(held)
            self.loop.recorder.pages_skipped(len(held))
            h.expires(time.perf_counter(), self.config.transfer_timeout_s, "transfer")
            destination = Destination(h.room, tuple(moved), len(held), h.sources, h.backend, h.secret)
            self.loop.announce(req, destination, first_sample_index=req.resumed + 1)  # (P sampled the one before)
            self.loop.move(req, Phase.TRANSFERRING)
            self.transfer.admit(req)

    def _join(self, req: Request) -> None:
        """The request's KV is here on every rank: it starts decoding after its first token."""
        req.handoff.no_deadline()
        token, _ = self.receiver.first_token(req.handoff.room)
        vocab = self.loop.stage.config.vocab_size
        if not 0 <= token < vocab:  # from the network: a broken peer must not crash the model
            error = f"the prefill node sent first token {token}, outside the vocabulary [0, {vocab})"
            self.fail(req, error, "DATA_LOSS")
            return
        logprob = None
        if req.params.logprobs is not None:
            try:
                msg = self.receiver.first_logprob(req.handoff.room)
                if msg is None:
                    raise ValueError("none came")
                logprob = logprob_from_proto(msg, vocab, req.params.logprobs)
            except ValueError as e:
                self.fail(req, f"the prefill node sent no usable logprobs with the first token: {e}", "DATA_LOSS")
                return
        req.num_computed = len(req.prompt_ids)
        req.num_sampled = req.resumed + 1
        req.output_ids.append(token)
        if req.params.needs_history and self.loop.sampler is None:  # the last rank samples: it needs the token
            self.loop.decide(APPEND, req.rid, info=Appended((token,)))
        req.first_token_s = time.perf_counter()
        kv_seconds = req.first_token_s - (req.handoff.preallocated_s or req.first_token_s)
        self.loop.outbox.put(Token(req.rid, token, req.resumed, kv_seconds, req.handoff.held_pages, logprob))
        scheduler = self.loop.scheduler
        scheduler.add_prebuilt(req)
        self.loop.move(req, Phase.DECODING, kv_seconds=round(kv_seconds, 6))
        reason = scheduler.stop_reason(req, token)
        if reason:  # the first token already ends it (EOS, max_new_tokens == 1, a stop string)
            scheduler.conclude(req, reason, req.first_token_s)
            self.loop.retire(req, FINISH)

    # ---------------------------------------------------------------- endings

    def finished(self, req: Request) -> bool:
        """Retracted while its last token was in flight: it ends from the retracted queue."""
        if self.retracted.remove(req) and req.phase is Phase.RESUMING:
            self.loop.scheduler.release(req)  # the pages it was given back
        return False

    def fail(self, req: Request, error: str, code: str, reason: str = "error", **event) -> None:
        self._end(req, error, code, reason, **event)

    def _end(self, req: Request, error: str, code: str, reason: str = "error", ask: bool = True, **event) -> None:
        """fail(); `ask`: whether the prefill node is there to revoke the room (not when its process died)."""
        self.prealloc.remove(req)
        self.retracted.remove(req)
        receiving = self.transfer.remove(req)
        self.chan.abort(req.rid)
        # a prefill rank may be writing into these pages right now (shared memory, GPU IPC): they are
        # handed out again only once the prefill node revoked the room on every rank (every rank of
        # this node forgets it on the ABORT: a write through it, grpc or torch, is refused from then)
        resting = receiving and bool(req.page_table.pages)
        if resting:
            now, h = time.perf_counter(), req.handoff
            if ask:
                self.quarantine.add(req, now + QUARANTINE_MAX_S)
                self.loop.outbox.put(Quarantined(req.rid, h.room, h.peer))
            else:
                self.quarantine.add(req, now + PREFILL_GONE_GRACE_S, "prefill_gone")
        self.loop.end(req, error, code, reason, release=not resting, **event)

    def _release(self, req: Request, why: str) -> None:
        """A failed hand-off's pages leave the quarantine (`why`: Quarantine's reasons, or "shutdown")."""
        if why == "timeout":
            h = req.handoff
            held = round(time.perf_counter() - req.finish_s, 3)
            log_event(
                log, "quarantine_timeout", logging.ERROR, rid=req.rid, room=room_tag(h.room), peer=h.peer, held_s=held,
                error=f"the prefill node never confirmed that no rank of it writes into the room; its pages are "
                f"reused after {QUARANTINE_MAX_S:g} s",
            )  # fmt: skip
        self.loop.recorder.quarantine_released(why)
        self.loop.scheduler.release(req)

    # ---------------------------------------------------------------- what the loop and checks see

    def queues(self) -> dict[str, list[str]]:
        return {"prealloc": self.prealloc.rids(), "transfer": self.transfer.rids(), "retracted": self.retracted.rids()}

    def sizes(self) -> dict[str, int]:
        return {"prealloc": len(self.prealloc), "transfer": len(self.transfer), "retracted": len(self.retracted)}

    def problems(self) -> list[str]:
        return self.prealloc.check_invariants() + self.transfer.check_invariants() + self.retracted.check_invariants()

    def holders(self) -> list[Request]:
        """Live requests (and quarantined ones) holding pages outside the scheduler's running list."""
        return [*self.transfer, *self.retracted.resuming(), *self.quarantine.requests()]

    def resting(self) -> set[str]:
        return self.quarantine.rids()

    def transfers_in_flight(self) -> int:
        return len(self.transfer)
