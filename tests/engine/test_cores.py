"""pipeline/cores.py: the host's cores split over the busy kvbridge ranks registered on it (alive,
computed lately); dead registrations are removed; a rank takes a changed share at its next refresh;
cores that other processes keep busy are left to them. The registry is this user's own: anything
else there, or a name in it that is no pid, leaves a rank computing as if alone, with one warning
and no error. (tests/nodes/test_hostile_dev_shm.py plants the same under a real /dev/shm.)"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from kvbridge.common.pids import parse_pid
from kvbridge.pipeline import cores


class Quiet:
    """Stands in for the host's /proc/stat: what other processes use is set by the test."""

    load = 0.0

    def sample(self) -> float:
        return Quiet.load


class Warnings(logging.Handler):
    """The warnings pipeline/cores.py logs, as their event names."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.events: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(record.msg)


@pytest.fixture
def warnings():
    handler, level = Warnings(), cores.log.level
    cores.log.setLevel(logging.WARNING)
    cores.log.addHandler(handler)
    yield handler.events
    cores.log.removeHandler(handler)
    cores.log.setLevel(level)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "directory", lambda: tmp_path / "ranks")
    monkeypatch.setattr(cores, "host_cores", lambda: 4)
    monkeypatch.setattr(cores, "OtherLoad", Quiet)
    monkeypatch.setattr(Quiet, "load", 0.0)
    monkeypatch.setattr(cores, "_warned", False)
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


# ---------------------------------------------------------------- what another local user can plant

NOT_PIDS = ["99999999999999999999", "²", "٣", "-1", "+7", "0", "007", " 12", "12 ", "12\n", "4194304", "1e3", ""]


@pytest.mark.parametrize("name", NOT_PIDS)
def test_a_name_is_a_pid_only_as_ascii_digits_in_the_kernels_range(name):
    assert parse_pid(name) is None


@pytest.mark.parametrize(("name", "pid"), [("1", 1), ("42", 42), ("4194303", 4194303)])
def test_a_pid_name_is_read_as_its_pid(name, pid, monkeypatch):
    monkeypatch.setattr("kvbridge.common.pids.pid_max", lambda: 4194304)
    assert parse_pid(name) == pid


def test_the_registry_is_this_users_own_and_made_private(registry, warnings):
    assert cores.join() == 4
    st = registry.lstat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert warnings == []


def test_the_real_registry_is_named_by_the_effective_user():
    assert cores.directory().name == f"kvbridge-ranks-{os.geteuid()}"


def test_entries_that_are_no_pid_are_ignored_and_left(registry, warnings, monkeypatch):
    registry.mkdir(mode=0o700)
    for name in NOT_PIDS[:-1]:
        (registry / name).touch()
    assert cores.join() == 4 and cores.busy_ranks() == 1
    with ranks(registry, 1):
        assert cores.busy_ranks() == 2  # a real one beside them still counts
    monkeypatch.setattr(cores, "_next_check", 0.0)
    cores.refresh()
    assert torch.get_num_threads() == 4 and warnings == []
    assert sorted(p.name for p in registry.iterdir()) == sorted([*NOT_PIDS[:-1], str(os.getpid())])


def plant_file(path, elsewhere):
    path.write_text("planted")


def plant_symlink(path, elsewhere):
    elsewhere.mkdir(mode=0o700)
    path.symlink_to(elsewhere)


def plant_foreign(path, elsewhere):
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)


def plant_open(path, elsewhere):
    path.mkdir(mode=0o700)
    path.chmod(0o777)  # anyone could add entries


@pytest.mark.parametrize("plant", [plant_file, plant_symlink, plant_foreign, plant_open])
def test_a_registry_that_is_not_this_users_own_directory_is_refused_with_one_warning(
    plant, registry, warnings, monkeypatch, tmp_path
):
    if plant is plant_foreign and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    plant(registry, tmp_path / "elsewhere")
    target = registry.resolve() if registry.is_dir() else None  # what a rank would read through it
    with ranks(target, 2) if target else contextlib.nullcontext():  # 3 ranks, were they counted
        assert cores.join() == 4 and cores.busy_ranks() == 1
        for _ in range(3):
            monkeypatch.setattr(cores, "_next_check", 0.0)
            cores.refresh()
            assert torch.get_num_threads() == 4
        cores.leave()
    assert warnings == ["rank_registry_refused"]  # once, not at every look
    if target is not None:
        assert str(os.getpid()) not in os.listdir(target)  # nothing registered in it


def test_our_entry_is_not_written_through_a_symlink_planted_in_the_registry(registry, warnings, tmp_path):
    registry.mkdir(mode=0o700)
    (registry / str(os.getpid())).symlink_to(tmp_path / "victim")
    assert cores.join() == 4
    assert not (tmp_path / "victim").exists() and warnings == ["rank_registry_refused"]


@pytest.mark.parametrize(
    "error", [OSError(errno.EIO, "I/O error"), PermissionError(errno.EPERM, "no"), ValueError("x"), OverflowError("x")]
)
def test_no_error_reading_the_registry_reaches_the_compute_loop(error, registry, warnings, monkeypatch):
    def fail(pid):
        raise error

    assert cores.join() == 4
    with ranks(registry, 1):
        monkeypatch.setattr(cores, "alive", fail)  # (as os.kill did on a name like 99999999999999999999)
        for _ in range(3):
            monkeypatch.setattr(cores, "_next_check", 0.0)
            cores.refresh()
            assert cores.busy_ranks() == 1 and torch.get_num_threads() == 4
    assert warnings == ["rank_registry_refused"]
