"""An elastic node's ranks switch role at one entry of the log (elastic_node/role.py), with nothing
live, keeping pool and prefix cache; the front's SetRole is answered once they did."""

from __future__ import annotations

import contextlib
import itertools
import queue
import time

import pytest

from kvbridge.common.sampling import SamplingParams
from kvbridge.elastic_node.node import elastic_rank
from kvbridge.engine.config import EngineConfig, PPConfig
from kvbridge.pipeline.group import RankGroup
from kvbridge.pipeline.log import SWITCH, LogEntry, Message, Switched
from kvbridge.pipeline.messages import Answer, Ask, Finish, SetRole, Token

TOKENS = itertools.count(1000)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42, 43, 44]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def elastic(role: str, pp_size: int = 1, faults: str = "") -> RankGroup:
    config = EngineConfig(model="tiny-random", num_pages=256, page_size=4, fault_inject=faults)
    return RankGroup(config, PPConfig(pp_size=pp_size), progress=False, build=elastic_rank, role_args={"role": role})


def ask(group: RankGroup, msg_of, timeout: float = 30, before: list | None = None) -> dict:
    """Send a message that rank 0 answers; its answer's body (the Finish events that came first go
    to `before`, the rest are dropped)."""
    token = next(TOKENS)
    group.inbox.put(msg_of(token))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = group.outbox.get(timeout=0.2)
        except queue.Empty:
            continue
        if isinstance(ev, Answer) and ev.token == token:
            return ev.body
        if isinstance(ev, Finish) and before is not None:
            before.append(ev)
    raise TimeoutError(f"no answer to token {token}")


def set_role(group: RankGroup, role: str, wait_s: float = 10, migrate: bool = False, before=None) -> dict:
    """Rank 0's answer, less how long it waited for nothing to be live (checked where it matters)."""
    answer = ask(group, lambda token: SetRole(role, token, wait_s, migrate), before=before)
    waited = answer.pop("waited_s", None)
    assert waited is None or 0 <= waited < wait_s
    return answer


@pytest.mark.parametrize("pp_size", [1, 2])
def test_every_rank_switches_at_one_entry_and_serves_the_same_tokens_after(pp_size):
    group = elastic("colocated", pp_size)
    try:
        before = [c.output_ids for c in group.generate(PROMPTS, GREEDY)]
        assert set_role(group, "prefill") == {"code": "", "error": "", "epoch": 1}
        assert set_role(group, "prefill") == {"code": "", "error": "", "epoch": 1}  # already: nothing to do
        assert set_role(group, "decode") == {"code": "", "error": "", "epoch": 2}
        assert set_role(group, "colocated") == {"code": "", "error": "", "epoch": 3}
        hits = ask(group, lambda t: Ask("status", t))["prefix_cache"]["hit_tokens"]
        after = [c.output_ids for c in group.generate(PROMPTS, GREEDY)]
        assert after == before
        # the pool and its prefix cache outlived three switches: every full page of both prompts hit
        # (18 tokens: 4 pages of 4; 5 tokens: 1)
        assert ask(group, lambda t: Ask("status", t))["prefix_cache"]["hit_tokens"] - hits == 20
        assert ask(group, lambda t: Ask("check", t))["problems"] == []
    finally:
        reports = group.shutdown()
    assert {r.log_digest for r in reports} == {reports[0].log_digest}  # one log, every rank
    switches = [[(seq, kind) for seq, kind, _ in r.log if kind == SWITCH] for r in reports]
    assert all(s == switches[0] for s in switches) and len(switches[0]) == 3
    assert [r.error for r in reports] == [""] * pp_size and [r.live_requests for r in reports] == [0] * pp_size


def first_token(group: RankGroup, rid: str, timeout: float = 60) -> None:
    """Until the request's first token comes out (it is decoding then)."""
    deadline = time.monotonic() + timeout
    while not any(isinstance(ev, Token) and ev.rid == rid for ev in group.poll(timeout=0.2)):
        assert time.monotonic() < deadline, f"{rid} never produced a token"


def test_a_switch_waits_for_live_requests_or_ends_them_for_migration():
    group = elastic("colocated", faults="step_delay_ms=25")  # 40 tokens: 1 s at least
    try:
        long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        rid = group.add_request(PROMPTS[0], long)
        time.sleep(0.05)
        before: list[Finish] = []
        assert set_role(group, "decode", wait_s=60, before=before) == {"code": "", "error": "", "epoch": 1}
        # the request finished first, whole: its Finish came before the answer
        assert [(f.rid, f.finish_reason, len(f.output_ids), f.error) for f in before] == [(rid, "length", 40, "")]
        rid = group.add_request(PROMPTS[1], long)  # a decode node now: a request without a pairing still runs
        first_token(group, rid)  # decoding: at least 39 steps (~1 s) left when the switch comes
        before = []
        assert set_role(group, "colocated", migrate=True, before=before)["code"] == ""
        # ended at once, for a router to resume elsewhere (its streamed outputs go with its Finish)
        [end] = before
        assert (end.rid, end.code, end.finish_reason) == (rid, "UNAVAILABLE", "abort")
        assert end.error == "the node is switching from decode to colocated: resume it elsewhere"
        assert 0 < len(end.output_ids) < 40
        assert ask(group, lambda t: Ask("check", t))["problems"] == []
    finally:
        group.shutdown()


def test_a_switch_that_cannot_happen_in_time_or_is_bad_is_answered():
    group = elastic("colocated", faults="step_delay_ms=5")
    try:
        rid = group.add_request(PROMPTS[0], SamplingParams(max_new_tokens=900, temperature=0.0, ignore_eos=True))
        time.sleep(0.2)
        late = set_role(group, "prefill", wait_s=0.2)
        assert late["code"] == "DEADLINE_EXCEEDED" and "1 requests still live" in late["error"]
        assert set_role(group, "router")["code"] == "INVALID_ARGUMENT"
        group.abort(rid)
    finally:
        reports = group.shutdown()
    assert SWITCH not in [kind for _, kind, _ in reports[0].log]  # no switch was made


def test_a_switch_entry_rides_the_pipeline_as_data():
    entry = LogEntry(7, SWITCH, "", None, Switched("decode", 2))
    back = Message.decode(Message("control", (entry,)).encode()).decisions[0]
    assert back == entry
    with pytest.raises(ValueError, match=r"Switched\.epoch must be int"):
        Message.decode(Message("control", (entry,)).encode().replace(b'"epoch":2', b'"epoch":"2"'))
    with pytest.raises(TypeError, match="switch entries hold Switched"):
        LogEntry(7, SWITCH, "", None, None)


def test_a_waiting_switch_is_withdrawn_by_asking_for_the_role_the_node_has():
    group = elastic("colocated", faults="step_delay_ms=5")
    try:
        rid = group.add_request(PROMPTS[0], SamplingParams(max_new_tokens=900, temperature=0.0, ignore_eos=True))
        first_token(group, rid)  # live for 4.5 s at least: the switch waits
        switch, back = next(TOKENS), next(TOKENS)
        group.inbox.put(SetRole("prefill", switch, 60, False))
        group.inbox.put(SetRole("colocated", back, 60, False))
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + 30
        while len(answers) < 2 and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                ev = group.outbox.get(timeout=0.2)
                answers |= {ev.token: ev.body} if isinstance(ev, Answer) else {}
        assert answers == {
            switch: {
                "code": "ABORTED",
                "error": "the switch to prefill was withdrawn: asked to stay colocated",
                "epoch": 0,
            },
            back: {"code": "", "error": "", "withdrew": "prefill", "epoch": 0},
        }
        group.abort(rid)
        # idle: a switch is made at once, and the same ask after it is a switch back
        assert set_role(group, "prefill") == {"code": "", "error": "", "epoch": 1}
        assert set_role(group, "colocated") == {"code": "", "error": "", "epoch": 2}
    finally:
        reports = group.shutdown()
    assert [kind for _, kind, _ in reports[0].log].count(SWITCH) == 2  # (none for the withdrawn one)
