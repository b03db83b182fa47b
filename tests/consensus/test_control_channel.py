"""Consensus on real processes: the ring over torch.distributed gloo, in background threads.

Every rank follows the same seeded schedule of local readiness flips, failures (one rank
each) and aborts, at real times; the test checks the decision logs the ranks applied.
"""

from __future__ import annotations

import contextlib
import faulthandler
import random
import time

import pytest
import torch.multiprocessing as mp

from kvbridge.common.net import free_port
from kvbridge.consensus import LocalStatus, Stream, Verdict
from kvbridge.pipeline import dist as pp_dist
from kvbridge.pipeline.control import ControlChannel, GlooTransport

STREAMS = (Stream.DECODE_PREALLOCATED, Stream.DECODE_TRANSFERRED)
# rank 0's fallback round never comes within the test: rounds follow its own changes and the
# other ranks' nudges only (without nudges, rids whose last change is on rank 1+ never decide)
IDLE_POLL_S = 600.0


def make_schedule(seed: int, pp_size: int, num_rids: int = 40):
    """(time_s, rank, action, stream, rid): registrations, READY flips, FAILED on one rank, aborts."""
    rng = random.Random(seed)
    events, fate = [], {}
    for i in range(num_rids):
        rid, stream = f"r{i}", STREAMS[i % 2]
        born = rng.uniform(0, 0.3)
        failing_rank = rng.randrange(pp_size) if rng.random() < 0.25 else None
        for rank in range(pp_size):
            events.append((born, rank, "pending", stream, rid))
            t = born + rng.uniform(0, 0.3)
            events.append((t, rank, "failed" if rank == failing_rank else "ready", stream, rid))
        fate[rid] = (stream, Verdict.FAILED if failing_rank is not None else Verdict.READY)
    for rid in rng.sample(sorted(fate), 5):
        events.append((rng.uniform(0, 0.6), 0, "abort", None, rid))
    return sorted(events, key=lambda e: e[0]), fate


def rank_main(rank, pp_size, addr, seed, out, stop):
    _, control_group = pp_dist.init(rank, pp_size, addr, timeout_s=60)
    chan = ControlChannel(rank, pp_size, GlooTransport(control_group, rank, pp_size), IDLE_POLL_S, keep_log=True)
    events, _ = make_schedule(seed, pp_size)
    t0 = time.monotonic()
    status = {"pending": LocalStatus.PENDING, "ready": LocalStatus.READY, "failed": LocalStatus.FAILED}
    for t, r, action, stream, rid in events:
        if r != rank:
            continue
        time.sleep(max(0.0, t0 + t - time.monotonic()))
        if action == "abort":
            chan.abort(rid)
        else:
            chan.set_local(stream, rid, status[action])
    if rank == 0:  # quiescent: nothing live, nothing left to ship, no round on the ring
        leader = chan.driver.role
        while chan.state.num_live or leader.num_unshipped or leader.round_in_flight is not None:
            assert chan.error is None, chan.error
            time.sleep(0.01)
    else:
        stop.wait(60)
    with chan.lock:
        log = [(d.seq, None if d.stream is None else int(d.stream), d.rid, int(d.verdict)) for d in chan.state.log]
        out.put(
            {"rank": rank, "log": log, "live": chan.state.num_live, "error": repr(chan.error) if chan.error else ""}
        )
    stop.wait(60)


@contextlib.contextmanager
def ranks(n: int, args, target):
    """n spawned rank processes running target(*args(rank, addr, out, stop)); yields (out, stop)
    and stops (then kills) them at the end."""
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=args(r, addr, out, stop), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        yield out, stop
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("pp_size", [2, 3])
def test_gloo_ring_ranks_apply_one_valid_log(pp_size):
    faulthandler.dump_traceback_later(120, exit=True)
    seed = 100 + pp_size
    try:
        with ranks(pp_size, lambda r, addr, out, stop: (r, pp_size, addr, seed, out, stop), rank_main) as (out, stop):
            first = out.get(timeout=60)  # rank 0 reports once quiescent
            stop.set()
            reports = sorted([first] + [out.get(timeout=30) for _ in range(pp_size - 1)], key=lambda r: r["rank"])
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert [r["error"] for r in reports] == [""] * pp_size
    assert [r["live"] for r in reports] == [0] * pp_size  # no orphan on any rank
    log = reports[0]["log"]
    assert all(r["log"] == log for r in reports)  # agreement
    assert [seq for seq, *_ in log] == list(range(len(log)))  # ordered, exactly once
    _, fate = make_schedule(seed, pp_size)
    verdicts: dict[str, tuple] = {}  # rid -> (stream, verdict) of its first decision
    terminal = set()
    for _, stream, rid, verdict in log:
        assert rid not in terminal, f"{rid} decided after it was failed or aborted"
        if verdict in (Verdict.FAILED, Verdict.ABORTED):
            terminal.add(rid)
        else:  # READY moves it on in its stream; only an abort may follow
            assert rid not in verdicts, f"{rid} ready twice"
        verdicts.setdefault(rid, (stream, verdict))
    assert set(verdicts) == set(fate)  # liveness: every rid decided
    for rid, (stream, verdict) in fate.items():
        got_stream, got = verdicts[rid]
        # validity: READY only if all ranks were ready; FAILED when one rank failed; or aborted first
        assert got == Verdict.ABORTED or (got == verdict and got_stream == stream), (rid, got, verdict)
    assert any(v == Verdict.READY for _, v in verdicts.values())
    assert any(v == Verdict.FAILED for _, v in verdicts.values())


def nudged_rank(rank, addr, out, stop):
    _, control_group = pp_dist.init(rank, 2, addr, timeout_s=60)
    chan = ControlChannel(rank, 2, GlooTransport(control_group, rank, 2), IDLE_POLL_S, collect=rank == 0)
    chan.set_local(Stream.DECODE_TRANSFERRED, "late", LocalStatus.PENDING)
    if rank == 0:
        chan.set_local(Stream.DECODE_TRANSFERRED, "late", LocalStatus.READY)
        decided, deadline = [], time.monotonic() + 60
        while not decided and time.monotonic() < deadline:
            decided = chan.take_decisions()
            time.sleep(0.01)
        out.put([(d.rid, d.verdict) for d in decided])
        chan.stop()
        out.put(chan.nudges.is_alive())  # it ended: rank 1 said NUDGE_CLOSE when the ring closed
    else:
        time.sleep(1.0)  # rank 0 is long idle: only a nudge can start the round that decides
        chan.set_local(Stream.DECODE_TRANSFERRED, "late", LocalStatus.READY)
        stop.wait(60)
        chan.thread.join(30)  # ends with the ring's close, once rank 0 stopped
        out.put(("rank 1", chan.thread.is_alive(), chan.nudges.is_alive(), repr(chan.error)))


def test_the_last_change_on_another_rank_nudges_an_idle_rank_zero():
    with ranks(2, lambda r, addr, out, stop: (r, addr, out, stop), nudged_rank) as (out, stop):
        assert out.get(timeout=90) == [("late", Verdict.READY)]
        assert out.get(timeout=30) is False
        stop.set()
        assert out.get(timeout=60) == ("rank 1", False, False, "None")
