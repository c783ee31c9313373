"""This checkout, for tests that start Python in a subprocess."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout first on ``PYTHONPATH`` (what was there stays after it), and ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
