"""pipeline/cores.py: the host's cores split over the busy kvbridge ranks registered on it (alive,
computed lately); dead registrations are removed; a rank takes a changed share at its next refresh."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pipeline import cores


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "directory", lambda: tmp_path / "ranks")
    monkeypatch.setattr(cores, "host_cores", lambda: 4)
    threads = torch.get_num_threads()
    yield tmp_path / "ranks"
    cores.leave()
    torch.set_num_threads(threads)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


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
    idle = sleeper()
    try:
        registry.mkdir()
        (registry / str(idle.pid)).touch()
        assert cores.join() == 2  # the other computed just now (its file is fresh)
        old = time.time() - cores.ACTIVE_S - 1
        os.utime(registry / str(idle.pid), (old, old))  # then it computed nothing for a while
        monkeypatch.setattr(cores, "_next_check", 0.0)
        cores.refresh()
        assert torch.get_num_threads() == 4
    finally:
        idle.kill()
        idle.wait()


def test_more_ranks_than_cores_still_compute_with_one_thread_each(registry):
    procs = [sleeper() for _ in range(5)]
    try:
        registry.mkdir()
        for p in procs:
            (registry / str(p.pid)).touch()
        assert cores.join() == 1  # 4 cores over 6 ranks
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_refresh_does_nothing_for_a_process_that_did_not_join(registry):
    torch.set_num_threads(3)
    cores.refresh()
    assert torch.get_num_threads() == 3 and not registry.exists()
