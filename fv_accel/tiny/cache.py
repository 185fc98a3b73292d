"""Where the tiny world's generated files are cached (the tiny datasets and their tiny models)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$FV_ACCEL_CACHE`, else `$XDG_CACHE_HOME/fv_accel`, else `~/.cache/fv_accel`."""
    root = os.environ.get("FV_ACCEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fv_accel"
    )
    return Path(root)
