"""Where autodeploy keeps what it builds once per machine (the demo checkpoint, native kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autodeploy``, by default ``~/.cache/autodeploy``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autodeploy"
