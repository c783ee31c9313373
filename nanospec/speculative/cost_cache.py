"""The target's measured forward costs, kept between runs in ``$NANOSPEC_CACHE_DIR/forward_costs.json`` (default
``~/.cache/nanospec``; empty: off). An entry's key is everything a forward's time depends on (:func:`cost_key`); it
holds one time per forward shape (sequences x new tokens each), so engines of one target share the shapes they have
in common. JSON, written atomically; a file that cannot be read is ignored and rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from nanospec.cpu_threads import BUSY_WAIT, Contention
from nanospec.log import logger

FORMAT = 3  # bumped when what is measured, or how, changes
MAX_ENTRIES = 64
FILE_NAME = "forward_costs.json"


def cache_path() -> Path | None:
    """Where the costs are kept; None when ``NANOSPEC_CACHE_DIR`` is set empty (no cache)."""
    directory = os.environ.get("NANOSPEC_CACHE_DIR")
    if directory is None:
        directory = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanospec"
    elif not directory:
        return None
    return Path(directory) / FILE_NAME


def device_name(device: torch.device) -> str:
    """The device as its timings depend on it: a GPU's name, or the CPU's model name and core count."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu: {model}, {os.cpu_count()} cores"


def weights_kind(model) -> dict:
    """How the model's weights are stored: its dtype, its ``quantization``, and for every kind of layer object its
    class and the dtypes of the tensors it holds."""
    def tensors(obj) -> list:
        return sorted((name, str(v.dtype)) for name, v in vars(obj).items() if isinstance(v, torch.Tensor))

    parts = [model.lm_head] + [v for layer in model.layers for v in vars(layer).values()
                               if hasattr(v, "__dict__") and not isinstance(v, torch.Tensor) and tensors(v)]
    kinds = sorted({json.dumps([type(p).__name__, tensors(p)]) for p in parts})
    return {"dtype": str(model.dtype), "quantization": getattr(model, "quantization", None), "layers": kinds}


def cost_key(model, *, runner: str, block_size: int, context: int) -> dict:
    return {"format": FORMAT, "config": dataclasses.asdict(model.config), "weights": weights_kind(model),
            "device": device_name(model.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "runner": runner, "block_size": block_size, "context": context}


def shape_name(shape: tuple[int, int]) -> str:
    """A forward shape as the file names it: ``"4x3"``, four sequences of three new tokens."""
    return f"{shape[0]}x{shape[1]}"


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring the forward-cost cache %s: %s", path, e)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def load_costs(key: dict | None) -> dict[str, float]:
    """The times stored for ``key`` by shape name, those that are times (none: no key, no cache or no entry)."""
    path = cache_path()
    if path is None or key is None:
        return {}
    entry = _read(path).get(_digest(key))
    if not isinstance(entry, dict) or entry.get("key") != json.loads(json.dumps(key, default=str)):
        return {}
    costs = entry.get("costs")
    if not isinstance(costs, dict):
        return {}
    return {name: c for name, c in costs.items() if isinstance(c, float) and math.isfinite(c) and c > 0}


def store_costs(key: dict | None, costs: dict[str, float]) -> Path | None:
    """Keep ``costs`` (shape name -> seconds) as ``key``'s entry, the newest ``MAX_ENTRIES`` in all; the file's path,
    or None if there is no key, no cache, or it cannot be written (a warning says why)."""
    path = cache_path()
    if path is None or key is None:
        return None
    entries = _read(path)
    entries[_digest(key)] = {"key": key, "costs": {n: float(c) for n, c in costs.items()}, "measured": time.time()}
    newest = sorted(entries.items(), key=lambda item: item[1].get("measured", 0) if isinstance(item[1], dict) else 0)
    data = {"format": FORMAT, "entries": dict(newest[-MAX_ENTRIES:])}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".forward_costs.", delete=False) as f:
            json.dump(data, f, default=str)
        os.replace(f.name, path)
    except OSError as e:
        logger.warning("could not write the forward-cost cache %s: %s", path, e)
        return None
    return path


def cached_forward_costs(key: Callable[[], dict | None], shapes: list[tuple[int, int]],
                         measure: Callable[[list[tuple[int, int]]], list[float]], probe: Callable[[], object],
                         device: torch.device) -> tuple[list[float], bool]:
    """(the time of each of ``shapes``, whether any was measured now): read for ``key()`` (None: not cached), and the
    shapes it lacks ``measure``d and kept. On a CPU where ``probe()`` (one small forward) finds the threads waiting for
    a core beyond ``BUSY_WAIT`` (``nanospec.cpu_threads``), the costs are read or measured at one thread; times
    measured while they waited beyond it are not kept. Torch's thread count is the same after as before."""
    def lacking(known: dict[str, float]) -> list[tuple[int, int]]:
        return sorted({shape for shape in shapes if shape_name(shape) not in known})

    known = load_costs(key())
    threads = torch.get_num_threads()
    try:
        missing = lacking(known)
        if missing and device.type == "cpu" and threads > 1:
            with Contention() as probed:
                probe()
            if probed.waiting is not None and probed.waiting > BUSY_WAIT:
                logger.warning("the machine is busy (this process's threads waited %.0f%% of the time for a core): "
                               "forward costs are timed at one thread", 100 * probed.waiting)
                torch.set_num_threads(1)
                known = load_costs(key())
                missing = lacking(known)
        if not missing:
            logger.info("forward costs: read from %s", cache_path())
            return [known[shape_name(shape)] for shape in shapes], False
        logger.info("measuring the costs of %d forward shapes (%d read from the cache) ...", len(missing),
                    len(set(shapes)) - len(missing))
        with Contention() as measured:
            known = {**known, **{shape_name(shape): seconds for shape, seconds in zip(missing, measure(missing))}}
        path = None
        if measured.waiting is not None and measured.waiting > BUSY_WAIT:
            logger.warning("the machine was busy while timing (the threads waited %.0f%% of the time for a core): "
                           "these costs serve this run and are not kept", 100 * measured.waiting)
        else:
            path = store_costs(key(), known)
        logger.info("forward costs measured in %.1f s%s", measured.seconds,
                    f", kept in {path}" if path is not None else "")
        return [known[shape_name(shape)] for shape in shapes], True
    finally:
        torch.set_num_threads(threads)
