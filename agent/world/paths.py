"""Where nightshift keeps what outlives a run: checkouts, models, compile caches, profiles."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_CACHE", Path.home() / ".cache" / "nightshift"))
