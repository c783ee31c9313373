"""nanospec's messages: the ``nanospec`` logger, one line per start-up phase (loading, the KV pool, speculation,
the forward-cost measurement, ready), to stderr.

Quiet when asked: ``NANOSPEC_LOG_LEVEL=WARNING`` (read once, at import) or
``logging.getLogger("nanospec").setLevel(logging.WARNING)``; ``python -m nanospec.chat --quiet`` and
``python -m nanospec.serve --log-level warning`` do that. The logger has its own stderr handler and does not pass
records on to the root logger, so an application's logging setup neither doubles nor drops them; give the logger
handlers of your own (and ``propagate = True``) to send them elsewhere.
"""

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
