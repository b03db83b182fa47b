"""Rank 0 of a prefill node: the role its loop runs (pipeline/roles.py), and the queues after the
scheduler (prefill_node/queues.py).

Registration overlaps prefill: a request is scheduled as soon as it arrives, and the decode
node's registration (where its KV goes) may come at any point, before its request or after. It
becomes a ROUTE entry of the node's log: each rank then pushes what it computed before the route
as soon as it learns it, and every later chunk right after its forward; the last rank holds the
first token until then. A failure on any rank (consensus FAILED) or an abort ends the request on
every rank.

A decode node that gives up on a room (Bootstrap.Revoke: a Revoke message) ends its request here
too, and is answered only once no rank writes into the room: a routed request's ABORT makes every
rank's sender drop the room and report it (prefill_node/agent.py revocation_key), and the
decode node keeps the room's pages out of use until then.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from kvbridge.common.limits import room_tag
from kvbridge.common.logs import log_event
from kvbridge.consensus import Stream as S
from kvbridge.consensus import Verdict
from kvbridge.engine.request import Handoff, Phase, Request
from kvbridge.kv_transfer.handoff import Registration
from kvbridge.pipeline.control import ControlChannel
from kvbridge.pipeline.log import ABORT, FINISH, ROUTE
from kvbridge.pipeline.messages import Add, Answer, Register, Revoke
from kvbridge.pipeline.rank0 import Rank0Loop
from kvbridge.pipeline.roles import Deadlines
from kvbridge.prefill_node.agent import revocation_key
from kvbridge.prefill_node.queues import BootstrapQueue, InflightQueue, Registrations, Revocations

log = logging.getLogger("kvbridge.prefill")


class PrefillRole:
    name = "prefill"

    def __init__(self, chan: ControlChannel):
        self.chan = chan
        self.bootstrap = BootstrapQueue()
        self.inflight = InflightQueue()
        self.rooms: dict[int, str] = {}  # room -> rid of every live request (one request per room)
        self.revoking = Revocations()  # rooms of routed requests that ended early, until every rank dropped them
        self.deadlines = Deadlines()

    def bind(self, loop: Rank0Loop) -> None:
        self.loop = loop
        self.config = loop.scheduler.config
        assert loop.scheduler.hold_finished, "a prefill node's pages must outlive the forward: they are still to move"
        self.registrations = Registrations(self.config.max_pending_requests, self.config.bootstrap_timeout_s)
        # room -> the verdict of its request, which ended before the decode node registered: a late
        # registration gets it (or the decode node would hold its pages until its transfer timeout)
        self.ended = Registrations(self.config.max_pending_requests, self.config.bootstrap_timeout_s)
        loop.scheduler.admissible = self._may_prefill
        self._held_key: tuple = ()  # (pass, running, bootstrap) the memo below holds for
        self._held: dict[str, set[int]] = {}  # caller -> pages of its unregistered requests

    # ---------------------------------------------------------------- inputs

    def admit(self, req: Request, add: Add) -> None:
        # a prefill node samples the first token only (its index: resumed, 0 unless migrated; held
        # back from EOS when min_tokens is not reached by it)
        first = req.resumed + 1
        req.params = replace(req.params, max_new_tokens=first, min_tokens=min(req.params.min_tokens, first))
        room = add.pairing.room  # (the Prefill service sends every request with its room)
        req.handoff = Handoff(room, caller=add.pairing.caller)
        if room in self.rooms or room in self.revoking:  # its registration would route this KV to another's pages
            req.finish_reason = "error"
            error = f"room {room} is in use by another request"
            self.loop.retire(req, ABORT, error=error, code="ALREADY_EXISTS")
            return
        registration = self.registrations.pop(room)
        req.handoff.expires(req.arrival_s, self.config.bootstrap_timeout_s, "bootstrap")
        self.rooms[room] = req.rid
        self.ended.pop(room)  # (a room's earlier request's end is not this one's)
        if registration is not None and self._route(req, registration):
            return  # (refused: the two halves disagree on the prompt)
        self.loop.move(req, Phase.WAITING)
        self.loop.scheduler.add(req)

    def handle(self, msg: object) -> bool:
        if isinstance(msg, Register):
            self.loop.outbox.put(Answer(msg.token, self._register(msg.registration)))
        elif isinstance(msg, Revoke):
            self._revoke(msg)
        else:
            return False
        return True

    def _register(self, registration: Registration) -> dict:
        """A decode node's registration of a room: routes its request, or waits for it; the verdict."""
        room = registration.room
        rid = self.rooms.get(room)
        if rid is not None and not self.loop.requests[rid].handoff.routed:
            if error := self._route(self.loop.requests[rid], registration):
                return {"code": "FAILED_PRECONDITION", "error": error}
        elif rid is not None or room in self.registrations or room in self.revoking:  # (it would redirect its KV)
            return {"code": "ALREADY_EXISTS", "error": f"room {room} is registered already"}
        elif (verdict := self.ended.pop(room)) is not None:
            return verdict
        elif self.registrations.full():
            return {"code": "RESOURCE_EXHAUSTED", "error": f"{len(self.registrations)} rooms wait for their requests"}
        else:
            self.registrations.add(room, registration, time.perf_counter())
        return {"code": "", "error": ""}

    def _revoke(self, msg: Revoke) -> None:
        """A decode node gave up on a room: its request here ends; answered once no rank writes into
        the room (at once when no rank was ever told where its KV goes)."""
        room = msg.room
        rid = self.rooms.get(room)
        if rid is not None:
            why = f"the decode node gave up on room {room} (Bootstrap.Revoke)"
            self.fail(self.loop.requests[rid], why, "CANCELLED", reason="abort")
        if self.revoking.wait(room, msg.token):  # routed: every rank drops the room on its ABORT (tick answers)
            return
        answer = {"code": "", "error": ""}
        if rid is None and self.registrations.pop(room) is None:
            answer = {"code": "NOT_FOUND", "error": f"room {room} is not known here: nothing of this node writes it"}
            if room not in self.ended:  # a registration of it still on its way is refused
                self._remember(room, "FAILED_PRECONDITION", f"room {room} was revoked by its decode node")
        self.loop.outbox.put(Answer(msg.token, answer))

    def _route(self, req: Request, registration: Registration) -> str:
        """Every rank learns where the KV goes (a ROUTE entry), connects and pushes what it has. A
        registration for another number of pages than the prompt's fails the request: the error."""
        pages = -(-len(req.prompt_ids) // self.loop.pool.page_size)
        registered = registration.held_pages + len(registration.page_ids)
        if registered != pages:  # (a prompt, or resumed outputs, that differ between the two halves)
            error = (
                f"room {req.handoff.room}: the decode node registered {registered} pages; the prompt here "
                f"({len(req.prompt_ids)} tokens, {req.resumed} of them resumed outputs) needs {pages}"
            )
            self.fail(req, error, "FAILED_PRECONDITION")
            return error
        h = req.handoff
        h.peer, h.routed, h.backend = registration.decode_addr, True, registration.backend
        h.held_pages = registration.held_pages
        h.kv_pages = pages - h.held_pages
        h.kv_bytes = h.kv_pages * self.loop.page_bytes_all_layers()
        h.no_deadline()  # no bootstrap deadline any more; the transfer's starts at the first token
        self.loop.announce(req)  # (registered before its first chunk ran)
        self.loop.decide(ROUTE, req.rid, info=registration)
        if self.bootstrap.remove(req):  # prefilled already: its pushes start now
            self._await_transfer(req)
        return ""

    # ---------------------------------------------------------------- consensus, timeouts

    def undecided(self) -> bool:
        return self.chan.has_changes

    def tick(self, now: float) -> None:
        for ruling in self.chan.take_decisions():
            if ruling.rid in self.revoking.keys:
                self._revoked(ruling.rid)
                continue
            req = self.loop.requests.get(ruling.rid)
            if req is None:  # (ended here already)
                continue
            if ruling.verdict in (Verdict.FAILED, Verdict.ABORTED):
                self.fail(req, "the KV transfer failed on a prefill rank", "UNAVAILABLE")
            elif self.inflight.on_verdict(req, ruling):
                self._transferred(req)
            elif ruling.verdict == Verdict.READY and ruling.stream == S.PREFILL_TRANSFERRED:
                # before rank 0 post-processed its first token: its pushes were that fast
                req.handoff.transferred = True
        if self.deadlines.time_to_look(now):
            self.registrations.expire(now)  # registrations whose Prefill call never came
            self.ended.expire(now)
            for req in self.deadlines.overdue(self.loop, now):
                self._time_out(req)

    def _revoked(self, key: str) -> None:
        """Every rank reported the room revoked: no write into it is under way or to come."""
        room, tokens = self.revoking.done(key)
        log_event(log, "revoked", room=room_tag(room), waiting=len(tokens))
        for token in tokens:
            self.loop.outbox.put(Answer(token, {"code": "", "error": ""}))

    def _time_out(self, req: Request) -> None:
        h, config = req.handoff, self.config
        if h.timeout == "bootstrap":
            why = f"the decode node did not register room {h.room} within {config.bootstrap_timeout_s:g} s"
        elif h.timeout == "unregistered":
            why = (
                f"the decode node did not register room {h.room} within {config.unregistered_timeout_s:g} s "
                "of its prefill (--unregistered-timeout-s)"
            )
        else:
            why = f"the KV transfer did not finish within {config.transfer_timeout_s:g} s of the first token"
        self.fail(req, why, "DEADLINE_EXCEEDED", timeout=h.timeout)

    # ---------------------------------------------------------------- endings

    def finished(self, req: Request) -> bool:
        """Its first token is out: its pages stay for the pushes, until they are agreed done."""
        if not req.handoff.routed:  # where its KV goes is not known yet
            self._await_registration(req)
        elif req.handoff.transferred:
            self._transferred(req)
        else:
            self._await_transfer(req)
        return True

    def _await_registration(self, req: Request) -> None:
        """Prefilled, with no registration yet: it holds its pages for a while, within its caller's share."""
        if error := self._unregistered_problem(req):  # (admitted within it, but a cached prefix may have gone)
            self.fail(req, error, "RESOURCE_EXHAUSTED")
            return
        h, now, hold_s = req.handoff, time.perf_counter(), self.config.unregistered_timeout_s
        if now + hold_s < h.deadline:
            h.expires(now, hold_s, "unregistered")
        self.loop.move(req, Phase.BOOTSTRAP)
        self.bootstrap.admit(req)

    def _may_prefill(self, req: Request) -> bool:
        """The scheduler's say on a waiting request: one its decode node has not registered yet starts
        only within its caller's share of the pool; past it, it waits (holding no page) for the
        registration, for the caller's other requests to move on, or for its bootstrap timeout."""
        if req.handoff.routed:
            return True
        held = self._held_by(req.handoff.caller)
        if held and len(held) >= self._share_pages():  # (a caller with thousands waiting: no per-request scan)
            return False
        return not self._unregistered_problem(req, held)

    def _held_by(self, caller: str) -> set[int]:
        """Pages held by `caller`'s unregistered requests (prefilled, or being prefilled), computed
        once per scheduling pass and admission (the scheduler asks once per waiting request)."""
        scheduler = self.loop.scheduler
        key = (scheduler.passes, len(scheduler.running), len(self.bootstrap))
        if key != self._held_key:
            self._held_key, self._held = key, {}
            for r in [*self.bootstrap, *(r for r in scheduler.running if not r.handoff.routed)]:
                self._held.setdefault(r.handoff.caller, set()).update(r.page_table.pages)
        return self._held.get(caller, set())

    def _share_pages(self) -> int:
        return int(self.config.unregistered_page_share * self.loop.pool.num_pages)

    def _unregistered_problem(self, req: Request, held_by_caller: set[int] | None = None) -> str:
        """Why `req`, prefilled or waiting to be, may not hold its pages without a registration: with
        its caller's other unregistered requests (prefilled, or being prefilled) it would hold more
        than the caller's share of the pool ("" when it may). Pages are counted once however many
        requests share them (a cached prefix). A caller that holds none may always go on with one (a
        prompt larger than the share is still served). `held_by_caller`: _held_by's answer, for a
        waiting request (which holds no page of its own)."""
        caller, pool, scheduler = req.handoff.caller, self.loop.pool.num_pages, self.loop.scheduler
        if held_by_caller is not None and not req.page_table.pages:
            held = held_by_caller
        else:
            others = [*self.bootstrap, *(r for r in scheduler.running if not r.handoff.routed)]
            held = {p for r in others if r is not req and r.handoff.caller == caller for p in r.page_table.pages}
        if req.page_table.pages:  # prefilled
            mine = len(set(req.page_table.pages) - held)
        else:  # waiting: the pages it will take, less the cached ones its caller holds already
            need = req.page_table.num_pages_needed(req.num_tokens)
            mine = need - len(held.intersection(scheduler.cached_prefix(req)))
        share, limit = self.config.unregistered_page_share, self._share_pages()
        if not held or len(held) + mine <= limit:
            return ""
        return (
            f"{caller or 'this caller'} holds {len(held)} KV pages of requests whose decode node has not "
            f"registered; with this request's {mine} it would hold {len(held) + mine}: one caller may hold "
            f"{limit}, {share:g} of the {pool}-page pool (--unregistered-page-share)"
        )

    def _await_transfer(self, req: Request) -> None:
        """Prefilled and routed: only its pushes are left."""
        req.handoff.awaiting_s = time.perf_counter()
        req.handoff.expires(req.handoff.awaiting_s, self.config.transfer_timeout_s, "transfer")
        self.loop.move(req, Phase.TRANSFERRING)
        self.inflight.admit(req)

    def _transferred(self, req: Request) -> None:
        """Every rank's pushes landed: the pages are free again and the request is done here."""
        self._release_room(req)
        h = req.handoff
        # (0 when every push landed before the first token was taken here: nothing after prefill)
        h.handoff_s = time.perf_counter() - h.awaiting_s if h.awaiting_s else 0.0
        log_event(log, "handoff", rid=req.rid, room=room_tag(h.room), decode=h.peer, **h.figures())
        self.loop.recorder.handed_off(h.handoff_s)
        self.loop.scheduler.release(req)
        self.loop.retire(req, FINISH, kv_bytes=h.kv_bytes)

    def fail(self, req: Request, error: str, code: str, reason: str = "error", **event) -> None:
        if not req.handoff.routed:
            self._remember_end(req, error, code)
        else:  # every rank drops the room on the ABORT below and reports it (tick)
            self.revoking.begin(req.handoff.room, revocation_key(req.handoff.room))
        self.bootstrap.remove(req)
        self.inflight.remove(req)
        self._release_room(req)
        self.chan.abort(req.rid)
        self.loop.end(req, error, code, reason, **event)

    def _remember_end(self, req: Request, error: str, code: str) -> None:
        """`req` ends before its decode node registered: a registration of its room (within
        --bootstrap-timeout-s) is answered with this, so the decode node fails the request at once."""
        why = f"room {req.handoff.room}: its request ended on the prefill node before the registration ({error})"
        self._remember(req.handoff.room, code, why)

    def _remember(self, room: int, code: str, why: str) -> None:
        """A registration of `room` within --bootstrap-timeout-s is refused with `code` and `why`."""
        if self.ended.full():
            self.ended.drop_oldest()
        self.ended.add(room, {"code": code, "error": why}, time.perf_counter())

    def evicted(self, req: Request, pages: list[int]) -> None:
        raise AssertionError("a prefill scheduler recomputes what it preempts")

    def _release_room(self, req: Request) -> None:
        if self.rooms.get(req.handoff.room) == req.rid:  # (a request refused for another's room never held it)
            del self.rooms[req.handoff.room]

    # ---------------------------------------------------------------- what the loop and checks see

    def queues(self) -> dict[str, list[str]]:
        return {"bootstrap": self.bootstrap.rids(), "inflight": self.inflight.rids()}

    def sizes(self) -> dict[str, int]:
        return {"bootstrap": len(self.bootstrap), "inflight": len(self.inflight)}

    def problems(self) -> list[str]:
        return self.bootstrap.check_invariants() + self.inflight.check_invariants()

    def holders(self) -> list[Request]:
        return []  # its queues' pages are the scheduler's held ones

    def resting(self) -> set[str]:
        """The keys of rooms being revoked (they hold no page): an elastic node switches only without them."""
        return set(self.revoking.keys)

    def transfers_in_flight(self) -> int:
        return len(self.inflight)
