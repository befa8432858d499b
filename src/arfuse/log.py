"""The ``arfuse`` logger, and ``once``: a message logged once per key (decisions per group)."""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("arfuse")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_seen: set[tuple[str, object]] = set()
_seen_lock = threading.Lock()
_configured = False


def configure(level: str) -> None:
    """Apply ``ARFUSE_LOG``; adds a stderr handler only if the application configured none."""
    global _configured
    logger.setLevel(_LEVELS[level])
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[arfuse %(levelname)s] %(message)s"))
        logger.addHandler(handler)
    _configured = True


def configure_once() -> None:
    """``configure`` from ``ARFUSE_LOG`` alone, unless that already ran in this process: for
    what logs before any op exists (the compile pass, which runs before the op it makes). A bad
    ``ARFUSE_LOG`` configures nothing here; creating the op reports it."""
    if _configured:
        return
    from . import settings

    name = settings.ENV_VARS["log_level"]
    try:
        conf = settings.from_env({name: os.environ[name]} if name in os.environ else {})
    except ValueError:
        return
    configure(conf.log_level)


def once(level: int, key: object, message: str, *args: object) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    with _seen_lock:
        marker = (message, key)
        if marker in _seen:
            return
        _seen.add(marker)
    logger.log(level, message, *args)
