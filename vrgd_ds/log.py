"""Logging helpers of the package: the one place for warn-once and rank filtering."""
from __future__ import annotations

import itertools
import logging
import weakref

_warned: set[str] = set()
_serials = itertools.count()
_names: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()


def warn_once(logger: logging.Logger, key: str, msg: str, *args: object) -> None:
    """Logs ``msg`` at WARNING the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(msg, *args)


def name_of(obj: object) -> int:
    """A number naming ``obj`` in warn-once keys for as long as it lives: an ``id()`` is reused by
    a later object, whose warning its key would then take for already said."""
    if obj not in _names:
        _names[obj] = next(_serials)
    return _names[obj]
