"""The host's cores split over the kvbridge ranks that compute on it (`--threads 0`, the default).

A prefill and a decode node on one 2-core host each took torch's default of 2 threads and
fought over the cores (P+D at 32 streams: 0.64 req/s; 1 thread each: 0.91). Each rank process
registers itself in a directory shared by the host's processes (/dev/shm/kvbridge-ranks: one
file per rank, named by its pid, touched while it computes) and computes with
cores // (busy ranks) threads, at least 1: a rank is busy when it computed within ACTIVE_S (an
idle node beside a busy one leaves it every core). Each rank looks again at most every REFRESH_S,
from its compute loop before a step, so a neighbour's load changes its share within seconds. A pod
(its own /dev/shm) counts only its own ranks. `--threads N` sets N and registers nothing.

The share also leaves out the cores that other processes keep busy: a load generator beside the
server, the node's own front and router. A rank's threads meet at a barrier after every parallel
op (hundreds a step), so one thread descheduled for another process stalls them all: under
AIPerf (whose timing process alone takes ~0.7 of a core) colocated output went from 20 to 41
tok/s at 8 streams with 1 thread instead of 2. The load of the others is read from /proc/stat on
this process's cores, less this process's own CPU time, over the time since the last look; it
counts as a whole core once it passes TAKE of one and stops counting under RELEASE (so a load near
the line does not flip the thread count at every look).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import torch

REFRESH_S = 2.0
ACTIVE_S = 2.5 * REFRESH_S  # a rank that computes touches its file every REFRESH_S
TAKE, RELEASE = 0.5, 0.35  # another process's load counts as a core above TAKE, no longer below RELEASE

_mine: Path | None = None  # this process's registration
_next_check = 0.0
_taken = 0  # cores other processes keep busy, as last counted
_load: OtherLoad | None = None


def directory() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "kvbridge-ranks"


def cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def host_cores() -> int:
    return len(cpus())


def busy_ranks() -> int:
    """Registered ranks whose process is alive and computed within ACTIVE_S, this one always
    counted (registrations of dead processes are removed)."""
    count, since = 0, time.time() - ACTIVE_S
    with contextlib.suppress(FileNotFoundError):
        for entry in directory().iterdir():
            if not entry.name.isdigit():
                continue
            try:
                os.kill(int(entry.name), 0)
            except ProcessLookupError:
                entry.unlink(missing_ok=True)
                continue
            except PermissionError:  # another user's live process
                pass
            with contextlib.suppress(FileNotFoundError):
                if entry == _mine or entry.stat().st_mtime >= since:
                    count += 1
    return max(1, count)


class OtherLoad:
    """CPU used on this process's cores by every other process, in cores, between two looks."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self) -> None:
        self.cpus = {f"cpu{c}" for c in cpus()}  # /proc/stat's names
        self.last = self._now()

    def _now(self) -> tuple[float, float, float]:
        busy = 0
        with contextlib.suppress(OSError), open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                name, *ticks = line.split()
                if name in self.cpus:  # user nice system idle iowait irq softirq steal (guest is in user)
                    t = [int(x) for x in ticks[:8]]
                    busy += sum(t) - t[3] - t[4]
        own = os.times()
        return busy / self.TICK, own.user + own.system, time.monotonic()

    def sample(self) -> float:
        (busy0, own0, at0), (busy1, own1, at1) = self.last, self._now()
        self.last = (busy1, own1, at1)
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(at1 - at0, 1e-3)


def cores_taken(load: float, taken: int) -> int:
    """Whole cores that other processes' `load` takes, `taken` counted before: a core more once the
    load passes TAKE of it, a core less once it falls under RELEASE."""
    more = int(load + 1 - TAKE)
    return more if more > taken else min(taken, int(load + 1 - RELEASE))


def share() -> int:
    cores = host_cores()
    return max(1, min(cores // busy_ranks(), cores - _taken))


def join() -> int:
    """Register this process as a computing rank and take its share; returns the threads set."""
    global _mine, _next_check, _taken, _load
    d = directory()
    d.mkdir(mode=0o1777, exist_ok=True)
    _mine = d / str(os.getpid())
    _mine.touch()
    _taken, _load = 0, OtherLoad()  # (the others' load is known from the first refresh)
    threads = share()
    torch.set_num_threads(threads)
    _next_check = time.monotonic() + REFRESH_S
    return threads


def refresh() -> None:
    """From the compute thread, between steps: take the current share if it changed (no-op
    unless join() was called; looks at most every REFRESH_S)."""
    global _next_check, _taken
    if _mine is None or time.monotonic() < _next_check:
        return
    _next_check = time.monotonic() + REFRESH_S
    _mine.touch()  # computing (recreated if removed by hand)
    if _load is not None:  # (set by join(), as _mine is)
        _taken = cores_taken(_load.sample(), _taken)
    threads = share()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def leave() -> None:
    global _mine, _load, _taken
    if _mine is not None:
        _mine.unlink(missing_ok=True)
        _mine, _load, _taken = None, None, 0
