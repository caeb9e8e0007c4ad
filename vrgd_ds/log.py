"""Logging helpers of the package: the one place for warn-once and rank filtering."""
from __future__ import annotations

import logging

_warned: set[str] = set()


def warn_once(logger: logging.Logger, key: str, msg: str, *args: object) -> None:
    """Logs ``msg`` at WARNING the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(msg, *args)
