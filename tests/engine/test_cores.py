"""pipeline/cores.py: the host's cores split over the busy kvbridge ranks registered on it (alive,
computed lately); dead registrations are removed; a rank takes a changed share at its next refresh;
cores that other processes keep busy are left to them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch

from kvbridge.pipeline import cores


class Quiet:
    """Stands in for the host's /proc/stat: what other processes use is set by the test."""

    load = 0.0

    def sample(self) -> float:
        return Quiet.load


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "directory", lambda: tmp_path / "ranks")
    monkeypatch.setattr(cores, "host_cores", lambda: 4)
    monkeypatch.setattr(cores, "OtherLoad", Quiet)
    monkeypatch.setattr(Quiet, "load", 0.0)
    threads = torch.get_num_threads()
    yield tmp_path / "ranks"
    cores.leave()
    torch.set_num_threads(threads)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@contextlib.contextmanager
def ranks(registry, n: int):
    """n live processes registered as ranks that computed just now; ended on exit."""
    procs = [sleeper() for _ in range(n)]
    try:
        registry.mkdir(exist_ok=True)
        for p in procs:
            (registry / str(p.pid)).touch()
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_cores_are_split_over_the_live_ranks_and_the_dead_are_forgotten(registry, monkeypatch):
    assert cores.join() == 4  # alone: every core
    assert torch.get_num_threads() == 4 and (registry / str(os.getpid())).exists()
    other, gone = sleeper(), sleeper()
    gone.kill()
    gone.wait()
    try:
        for p in (other, gone):
            (registry / str(p.pid)).touch()
        (registry / "notes.txt").touch()  # not a rank
        assert cores.busy_ranks() == 2 and not (registry / str(gone.pid)).exists()
        assert cores.share() == 2
        monkeypatch.setattr(cores, "_next_check", 0.0)  # as REFRESH_S later
        cores.refresh()
        assert torch.get_num_threads() == 2
    finally:
        other.kill()
        other.wait()
    monkeypatch.setattr(cores, "_next_check", 0.0)
    cores.refresh()  # the other rank ended: every core again
    assert torch.get_num_threads() == 4
    cores.leave()
    assert not (registry / str(os.getpid())).exists() and cores.busy_ranks() == 1  # (itself, always)


def test_a_rank_idle_for_longer_than_active_s_leaves_its_cores_to_the_busy(registry, monkeypatch):
    with ranks(registry, 1) as [idle]:
        assert cores.join() == 2  # the other computed just now (its file is fresh)
        old = time.time() - cores.ACTIVE_S - 1
        os.utime(registry / str(idle.pid), (old, old))  # then it computed nothing for a while
        monkeypatch.setattr(cores, "_next_check", 0.0)
        cores.refresh()
        assert torch.get_num_threads() == 4


def test_more_ranks_than_cores_still_compute_with_one_thread_each(registry):
    with ranks(registry, 5):
        assert cores.join() == 1  # 4 cores over 6 ranks


def test_refresh_does_nothing_for_a_process_that_did_not_join(registry):
    torch.set_num_threads(3)
    cores.refresh()
    assert torch.get_num_threads() == 3 and not registry.exists()


def test_cores_that_other_processes_keep_busy_are_left_to_them(registry, monkeypatch):
    assert cores.join() == 4
    for load, threads in [(0.7, 3), (0.45, 3), (0.3, 4), (1.6, 2), (1.4, 2), (1.3, 3), (9.0, 1), (0.0, 4)]:
        Quiet.load = load  # e.g. a load generator on the host, then a second one, then none
        monkeypatch.setattr(cores, "_next_check", 0.0)
        cores.refresh()
        assert torch.get_num_threads() == threads, load


def test_the_fewer_of_the_rank_share_and_the_free_cores_is_taken(registry, monkeypatch):
    with ranks(registry, 1):
        assert cores.join() == 2  # two ranks on 4 cores
        for load, threads in [(1.0, 2), (2.6, 1)]:  # the other rank computing takes a core; then 2 more go
            Quiet.load = load
            monkeypatch.setattr(cores, "_next_check", 0.0)
            cores.refresh()
            assert torch.get_num_threads() == threads


@pytest.mark.parametrize(
    ("load", "taken", "now"),
    [(0.0, 0, 0), (0.49, 0, 0), (0.5, 0, 1), (0.36, 1, 1), (0.34, 1, 0), (1.5, 1, 2), (1.2, 2, 1), (3.7, 0, 4)],
)
def test_a_load_counts_as_a_core_above_take_and_stops_below_release(load, taken, now):
    assert cores.cores_taken(load, taken) == now


def test_other_load_reads_what_another_process_burns_and_not_this_ones():
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        load, t0, start = cores.OtherLoad(), os.times(), time.monotonic()
        while time.monotonic() < start + 1.0:  # this process burns too: not counted
            pass
        other, t1 = load.sample(), os.times()
        own = (t1.user + t1.system - t0.user - t0.system) / (time.monotonic() - start)
    finally:
        burner.kill()
        burner.wait()
    # the burner had a core for most of the second (on a loaded host, at least half of one); what
    # this process used is left out of the host's busy time
    assert 0.5 <= other <= cores.host_cores() - own + 0.1, (other, own)
