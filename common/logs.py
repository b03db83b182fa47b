"""Structured logs: one logfmt line per event on stderr, e.g.

    ts=2026-11-30T22:50:01.123456Z level=info logger=kvbridge.prefill event=phase rid=9f2c room=812 phase=prefilling

`setup(level)` configures the process (and is called again in each rank process with the
front's level); `log_event(logger, event, **fields)` writes one line. Values with spaces or
quotes are quoted, so a line splits back into its fields unambiguously.
"""

from __future__ import annotations

import logging
import os
import time

LEVELS = ("debug", "info", "warning", "error")
_ENV = "KVBRIDGE_LOG_LEVEL"  # rank processes inherit the front's level through it


def _value(v: object) -> str:
    s = f"{v:.6g}" if isinstance(v, float) else str(v)
    if s == "" or any(c in s for c in ' "=\n\t'):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return s


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        micros = int(record.created % 1 * 1e6)  # (timelines across processes need better than ms)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{micros:06d}Z"
        head = f"ts={ts} level={record.levelname.lower()} logger={record.name}"
        fields = getattr(record, "fields", None)
        if fields is not None:
            body = " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        else:
            body = f"msg={_value(record.getMessage())}"
        if record.exc_info:
            body += f" exc={_value(self.formatException(record.exc_info))}"
        return f"{head} {body}"


def setup(level: str | None = None) -> None:
    """Log kvbridge's loggers at `level` (default: $KVBRIDGE_LOG_LEVEL, else info) to stderr."""
    level = (level or os.environ.get(_ENV) or "info").lower()
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    os.environ[_ENV] = level
    root = logging.getLogger("kvbridge")
    root.setLevel(level.upper())
    if not any(getattr(h, "_kvbridge", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(LogfmtFormatter())
        handler._kvbridge = True
        root.addHandler(handler)
        root.propagate = False


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": {"event": event, **fields}})


def parse_line(line: str) -> dict[str, str]:
    """A logfmt line back into its fields (tests, and tools reading the logs)."""
    out, i, n = {}, 0, len(line)
    while i < n:
        while i < n and line[i] == " ":
            i += 1
        eq = line.find("=", i)
        if eq < 0:
            break
        key, i = line[i:eq], eq + 1
        if i < n and line[i] == '"':
            i += 1
            buf = []
            while i < n and line[i] != '"':
                if line[i] == "\\" and i + 1 < n:
                    i += 1
                    buf.append("\n" if line[i] == "n" else line[i])
                else:
                    buf.append(line[i])
                i += 1
            out[key], i = "".join(buf), i + 1
        else:
            end = line.find(" ", i)
            end = n if end < 0 else end
            out[key], i = line[i:end], end
    return out
