"""Where nightshift keeps what outlives a run: checkouts, models, compile caches, profiles."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The one rule for the cache's place, which every reader takes from here: `$NIGHTSHIFT_CACHE`, unless it is
    unset or empty, else `~/.cache/nightshift` (as the shell scripts' `${NIGHTSHIFT_CACHE:-...}` read it)."""
    return Path(os.environ.get("NIGHTSHIFT_CACHE") or Path.home() / ".cache" / "nightshift").expanduser()
