"""Where autodeploy keeps what it builds once per machine (the demo checkpoint, native kernels)."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autodeploy``, by default ``~/.cache/autodeploy``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autodeploy"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of autodeploy's own sources (Python and native): what it builds on disk (compiled decode
    steps, served packages) is keyed by it, so that no change to the code reuses a build made before it."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h", ".yaml")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
