"""Progress lines on stderr for long operations (model load, profiling, benchmarks)."""

from __future__ import annotations

import sys
import time


class Progress:
    """`with Progress("loading", total) as p: p.advance()` draws a bar on a terminal, or a
    line every 10% otherwise (logs stay readable)."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.done = label, max(total, 1), 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last_decile = -1
        self._t0 = time.perf_counter()

    def __enter__(self) -> Progress:
        self._draw()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
        if self.enabled and exc[0] is None:
            self.done = self.total
            if not self.tty:
                self._draw()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        frac = self.done / self.total
        elapsed = time.perf_counter() - self._t0
        if self.tty:
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {elapsed:.1f}s")
            sys.stderr.flush()
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            sys.stderr.write(f"{self.label}: {self.done}/{self.total} ({frac:.0%}) {elapsed:.1f}s\n")
            sys.stderr.flush()
