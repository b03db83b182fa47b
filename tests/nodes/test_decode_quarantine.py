"""The decode node's quarantine on its own: a failed hand-off's pages leave it when the prefill node
revoked that room, when the prefill node's process is gone (after a grace), or at their bound."""

from __future__ import annotations

from kvbridge.common.sampling import SamplingParams
from kvbridge.decode_node.queues import Quarantine
from kvbridge.engine.pages import PageTable
from kvbridge.engine.request import Handoff, Request

P1, P2 = "10.0.0.1:7001", "10.0.0.2:7001"


def make_request(rid: str, room: int, peer: str) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(), PageTable(4))
    req.handoff = Handoff(room, peer)
    return req


def make_quarantine() -> tuple[Quarantine, list[Request]]:
    """Three failed hand-offs, each resting until 300 (the bound): two from P1, one from P2."""
    quarantine = Quarantine()
    reqs = [make_request("a", 11, P1), make_request("b", 12, P1), make_request("c", 13, P2)]
    for req in reqs:
        quarantine.add(req, 300.0)
    return quarantine, reqs


def test_a_revoked_room_leaves_at_once_and_only_its_own():
    quarantine, (a, _, _) = make_quarantine()
    assert quarantine.revoked("a", 12) is None  # (another room's number: a request that reused the rid)
    assert quarantine.revoked("a", 11) is a
    assert quarantine.revoked("a", 11) is None  # (released already)
    assert quarantine.rids() == {"b", "c"} and quarantine.due(299.0) == []


def test_rooms_of_a_prefill_node_that_is_gone_leave_after_the_grace_the_others_at_their_bound():
    quarantine, _ = make_quarantine()
    quarantine.prefill_gone(P1, 10.0)
    assert quarantine.due(9.9) == []
    assert [(rest.req.rid, rest.why) for rest in quarantine.due(10.0)] == [("a", "prefill_gone"), ("b", "prefill_gone")]
    quarantine.prefill_gone(P2, 400.0)  # (never later than its bound)
    assert quarantine.due(299.9) == []
    assert [(rest.req.rid, rest.why) for rest in quarantine.due(300.0)] == [("c", "timeout")]
    assert quarantine.requests() == []


def test_a_rest_added_for_a_prefill_node_known_gone_says_so():
    quarantine = Quarantine()
    quarantine.add(make_request("d", 14, P1), 6.0, "prefill_gone")
    assert [(rest.req.rid, rest.why) for rest in quarantine.due(6.0)] == [("d", "prefill_gone")]
