"""One thread for the timers of every request in flight (no thread per request).

    watchdog.schedule(due, check)    # at time.monotonic() >= due: again = check(now)

A check does whatever is due and returns when it wants to run next (a time.monotonic() value), or
None when it is done. A request keeps one check scheduled while it lives, so the heap holds one
entry per request; a check that finds nothing due yet simply asks to run again later.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

Check = Callable[[float], "float | None"]
log = logging.getLogger("kvbridge.router")


class Watchdog:
    def __init__(self, name: str = "kvbridge-router-watchdog"):
        self._heap: list[tuple[float, int, Check]] = []
        self._order = itertools.count()  # ties run in the order scheduled (and checks are never compared)
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None  # started by the first schedule()
        self._name = name

    def schedule(self, due: float, check: Check) -> None:
        with self._cond:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (due, next(self._order), check))
            if self._heap[0][2] is check:  # the earliest now: wake the thread to wait for it instead
                self._cond.notify()

    def stop(self) -> None:
        """Drop every scheduled check and end the thread."""
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                _, _, check = heapq.heappop(self._heap)
            try:
                again = check(time.monotonic())
            except Exception:  # a bug in one check must not stop the timers of every other request
                log.exception("a watchdog check failed")
                again = None
            if again is not None:
                self.schedule(again, check)
