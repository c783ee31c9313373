"""The ``nanospec`` logger: one line per start-up phase, to stderr (its own handler, no propagation);
``NANOSPEC_LOG_LEVEL=WARNING`` quiets it."""

from __future__ import annotations

import logging
import os
import sys


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (so a redirected or captured stderr gets it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


logger = logging.getLogger("nanospec")
if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("nanospec: %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
    _level = os.environ.get("NANOSPEC_LOG_LEVEL", "INFO").upper()
    logger.setLevel(_level if isinstance(logging.getLevelName(_level), int) else logging.INFO)


def set_level(level: str | int) -> None:
    """``"warning"`` (or ``logging.WARNING``) keeps nanospec quiet but for problems; ``"info"``: the phases."""
    logger.setLevel(level.upper() if isinstance(level, str) else level)
