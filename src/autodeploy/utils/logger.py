"""The autodeploy logger.

Every line logged while a transform runs carries the prefix ``[stage=<stage>, transform=<key>]``
(see :func:`transform_logging`). The level comes from ``AUTO_DEPLOY_LOG_LEVEL`` (default INFO);
in multi-process runs only rank 0 logs below WARNING.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
from typing import Iterator

LOG_LEVEL_ENV = "AUTO_DEPLOY_LOG_LEVEL"

_transform_prefix: contextvars.ContextVar[str] = contextvars.ContextVar("ad_transform_prefix", default="")


def get_rank() -> int:
    """Rank of this process: torch.distributed when initialized, else the RANK environment variable."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _PrefixFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = _transform_prefix.get()
        message = super().format(record)
        rank = get_rank()
        where = f"[rank {rank}] " if rank else ""  # only warnings and errors get here from other ranks
        return f"[autodeploy] {where}{record.levelname} {prefix + ' ' if prefix else ''}{message}"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (redirections, test capture)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _configured_level() -> int:
    name = os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper()
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.INFO


def _make_logger() -> logging.Logger:
    logger = logging.getLogger("autodeploy")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_PrefixFormatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    refresh_level(logger)
    return logger


def refresh_level(logger: logging.Logger | None = None) -> None:
    """(Re)apply AUTO_DEPLOY_LOG_LEVEL and the rank rule to the autodeploy logger."""
    logger = logger or ad_logger
    level = _configured_level()
    if get_rank() != 0:
        level = max(level, logging.WARNING)
    logger.setLevel(level)


ad_logger = _make_logger()


@contextlib.contextmanager
def transform_logging(stage: str, key: str) -> Iterator[None]:
    """Prefix every autodeploy log line emitted inside the block with the running transform."""
    token = _transform_prefix.set(f"[stage={stage}, transform={key}]")
    try:
        yield
    finally:
        _transform_prefix.reset(token)
