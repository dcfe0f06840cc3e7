"""The one logger of ProTrain, and warnings printed once."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("protrain")
_warned: set[str] = set()


def setup_logging(level: int = logging.INFO) -> None:
    """Send `protrain` records to stderr in a compact format (idempotent)."""
    if not any(getattr(h, "_protrain", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[protrain %(levelname)s] %(message)s"))
        handler._protrain = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def warn_once(message: str) -> None:
    """Log a warning the first time this exact message is seen in the process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
