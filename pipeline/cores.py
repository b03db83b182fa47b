"""The host's cores split over the kvbridge ranks that compute on it (`--threads 0`, the default).

A prefill and a decode node on one 2-core host each took torch's default of 2 threads and
fought over the cores (P+D at 32 streams: 0.64 req/s; 1 thread each: 0.91). Each rank process
registers itself in a directory shared by the host's processes (/dev/shm/kvbridge-ranks: one
file per rank, named by its pid, touched while it computes) and computes with
cores // (busy ranks) threads, at least 1: a rank is busy when it computed within ACTIVE_S (an
idle node beside a busy one leaves it every core). Each rank looks again at most every REFRESH_S,
from its compute loop before a step, so a neighbour's load changes its share within seconds. A pod
(its own /dev/shm) counts only its own ranks. `--threads N` sets N and registers nothing.
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

_mine: Path | None = None  # this process's registration
_next_check = 0.0


def directory() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "kvbridge-ranks"


def host_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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


def share() -> int:
    return max(1, host_cores() // busy_ranks())


def join() -> int:
    """Register this process as a computing rank and take its share; returns the threads set."""
    global _mine, _next_check
    d = directory()
    d.mkdir(mode=0o1777, exist_ok=True)
    _mine = d / str(os.getpid())
    _mine.touch()
    threads = share()
    torch.set_num_threads(threads)
    _next_check = time.monotonic() + REFRESH_S
    return threads


def refresh() -> None:
    """From the compute thread, between steps: take the current share if it changed (no-op
    unless join() was called; looks at most every REFRESH_S)."""
    global _next_check
    if _mine is None or time.monotonic() < _next_check:
        return
    _next_check = time.monotonic() + REFRESH_S
    _mine.touch()  # computing (recreated if removed by hand)
    threads = share()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def leave() -> None:
    global _mine
    if _mine is not None:
        _mine.unlink(missing_ok=True)
        _mine = None
