"""The host's cores split over the kvbridge ranks that compute on it (`--threads 0`, the default).

A prefill and a decode node on one 2-core host each took torch's default of 2 threads and
fought over the cores (P+D at 32 streams: 0.64 req/s; 1 thread each: 0.91). Each rank process
registers itself in a registry shared by the host's processes of its user
(/dev/shm/kvbridge-ranks-<euid>: one file per rank, named by its pid, touched while it computes)
and computes with cores // (busy ranks) threads, at least 1: a rank is busy when it computed within
ACTIVE_S (an idle node beside a busy one leaves it every core). Each rank looks again at most every
REFRESH_S, from its compute loop before a step, so a neighbour's load changes its share within
seconds. A pod (its own /dev/shm) counts only its own ranks. `--threads N` sets N and registers
nothing.

Any local user can create a name in /dev/shm first, so the registry is trusted only when it is a
directory (not a symlink) owned by this user and writable by no one else; it is created 0700 and
checked on the descriptor opened, and entries are opened without following symlinks. An entry
counts only when its name is a pid (common/pids.py: ASCII digits in the kernel's range); any
other name is ignored. A registry that is anything else, or fails to read, is refused with one
warning per process, and the rank computes as if alone: nothing here raises into a compute loop.

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
import errno
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kvbridge.common.logs import log_event
from kvbridge.common.pids import alive, parse_pid

REFRESH_S = 2.0
ACTIVE_S = 2.5 * REFRESH_S  # a rank that computes touches its file every REFRESH_S
TAKE, RELEASE = 0.5, 0.35  # another process's load counts as a core above TAKE, no longer below RELEASE
log = logging.getLogger("kvbridge.cores")

_mine: str | None = None  # this process's registration: its entry's name (its pid), once joined
_next_check = 0.0
_taken = 0  # cores other processes keep busy, as last counted
_load: OtherLoad | None = None
_warned = False  # the registry was refused and said so (once per process)


def directory() -> Path:
    """The registry: this user's own (another user's ranks are not counted, nor can they plant entries)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"kvbridge-ranks-{os.geteuid()}"


def cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def host_cores() -> int:
    return len(cpus())


@contextlib.contextmanager
def _registry(create: bool) -> Iterator[int]:
    """The registry's directory as an open descriptor, created (mode 0700) first when `create`.
    Raises OSError when it is missing (FileNotFoundError), a symlink or not a directory, or not
    this user's alone."""
    path = directory()
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)  # (fails on anything already there, a symlink included)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        kind = "a symlink" if stat.S_ISLNK(os.lstat(path).st_mode) else "not a directory"
        raise NotADirectoryError(e.errno, f"{path} is {kind}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            mode = stat.S_IMODE(st.st_mode)
            raise PermissionError(f"{path} has owner uid {st.st_uid} and mode {mode:o}: not this user's alone")
        yield fd
    finally:
        os.close(fd)


def _refused(error: Exception) -> None:
    """The registry cannot be used: say so once per process; the caller computes as if alone."""
    global _warned
    if not _warned:
        _warned = True
        reason = f"{type(error).__name__}: {error}"
        log_event(log, "rank_registry_refused", logging.WARNING, pid=os.getpid(), error=reason)


def _register() -> None:
    """Create or touch this rank's entry (computing now)."""
    try:
        with _registry(create=True) as d:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (a FIFO: no wait)
            fd = os.open(_mine, flags, 0o600, dir_fd=d)
            try:
                os.utime(fd)
            finally:
                os.close(fd)
    except Exception as e:
        _refused(e)


def busy_ranks() -> int:
    """Registered ranks whose process is alive and computed within ACTIVE_S, this one always
    counted (registrations of dead processes are removed); 1 when the registry is refused."""
    count, since = 0, time.time() - ACTIVE_S
    try:
        with _registry(create=False) as d, os.scandir(d) as entries:
            for entry in entries:
                pid = parse_pid(entry.name)
                if pid is None:  # not a rank's entry
                    continue
                if not alive(pid):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=d)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if entry.name == _mine or entry.stat(follow_symlinks=False).st_mtime >= since:
                        count += 1
    except FileNotFoundError:  # nobody registered
        return 1
    except Exception as e:
        _refused(e)
        return 1
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
    _mine = str(os.getpid())
    _register()
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
    _register()  # computing (recreated if removed by hand)
    if _load is not None:  # (set by join(), as _mine is)
        _taken = cores_taken(_load.sample(), _taken)
    threads = share()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def leave() -> None:
    global _mine, _load, _taken
    if _mine is not None:
        try:
            with _registry(create=False) as d:
                os.unlink(_mine, dir_fd=d)
        except FileNotFoundError:
            pass
        except Exception as e:
            _refused(e)
        _mine, _load, _taken = None, None, 0
