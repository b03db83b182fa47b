"""Process ids read from names that any local user can create (/dev/shm entries): parsed defensively.

A name is a pid only when it is ASCII digits without a leading zero and within the kernel's pid
range; anything else ('²', which str.isdigit() accepts and int() refuses; 99999999999999999999,
which os.kill refuses with OverflowError; '-1', which os.kill takes for "every process") is no pid.
"""

from __future__ import annotations

import functools
import os
import re

PID_MAX_LIMIT = 4_194_304  # 2**22: the kernel's ceiling for /proc/sys/kernel/pid_max
_DIGITS = re.compile(r"[1-9][0-9]{0,6}")  # (at most 7 digits: PID_MAX_LIMIT has 7)


@functools.cache
def pid_max() -> int:
    """One more than the highest pid this host hands out (/proc/sys/kernel/pid_max, else 2**22)."""
    try:
        with open("/proc/sys/kernel/pid_max", "rb") as f:
            value = int(f.read(16).strip() or b"0")
    except (OSError, ValueError):
        return PID_MAX_LIMIT
    return value if 1 < value <= PID_MAX_LIMIT else PID_MAX_LIMIT


def parse_pid(text: str) -> int | None:
    """The pid that `text` names, in [1, pid_max()); None for anything else."""
    if not _DIGITS.fullmatch(text):
        return None
    pid = int(text)
    return pid if pid < pid_max() else None


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts: signal 0 to it is refused, not missing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
