"""Where a kvbridge process keeps files of its own: one per-user cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$KVBRIDGE_CACHE, else ~/.cache/kvbridge: dequantized weights, fingerprints, the default fleet key."""
    return Path(os.environ.get("KVBRIDGE_CACHE", Path.home() / ".cache" / "kvbridge"))
