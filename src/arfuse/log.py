"""The ``arfuse`` logger, and ``once``: a message logged once per key (decisions per group)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("arfuse")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_seen: set[tuple[str, object]] = set()
_seen_lock = threading.Lock()


def configure(level: str) -> None:
    """Apply ``ARFUSE_LOG``; adds a stderr handler only if the application configured none."""
    logger.setLevel(_LEVELS[level])
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[arfuse %(levelname)s] %(message)s"))
        logger.addHandler(handler)


def once(level: int, key: object, message: str, *args: object) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    with _seen_lock:
        marker = (message, key)
        if marker in _seen:
            return
        _seen.add(marker)
    logger.log(level, message, *args)
