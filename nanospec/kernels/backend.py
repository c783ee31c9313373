"""How every op in `nanospec.kernels` runs: ``NANOSPEC_BACKEND`` or :func:`set_backend` / :func:`backend`.

* ``triton``: the Triton kernel (on CPU tensors only under ``TRITON_INTERPRET=1``, how kernels are tested here);
* ``torch``: the plain-PyTorch reference (attention: the CPU backend, :mod:`nanospec.kernels.cpu_attention`);
* ``auto`` (default): Triton for CUDA tensors, torch for the rest.

Every op module declares its op once: ``<op> = dispatch(<op>_triton, <op>_ref)``, and takes ``triton`` and ``tl``
from here: the real modules where a kernel can launch (a CUDA GPU, or ``TRITON_INTERPRET=1``), else a stand-in, so a
CPU process does not import Triton.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable

import torch


class _NoTriton:
    """``triton`` and ``triton.language`` where no kernel can launch: ``jit`` keeps the function, inert; any other
    name, and a kernel's launch, raise."""

    def jit(self, fn):
        return _Unlaunchable(fn)

    def __getattr__(self, name: str):
        _no_triton(f"triton.{name}")


class _Unlaunchable:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        _no_triton(f"the Triton kernel {self.fn.__name__}")


def _no_triton(what: str):
    raise RuntimeError(f"{what}: Triton kernels run on a CUDA GPU, or on a CPU with TRITON_INTERPRET=1 set before "
                       f"nanospec is imported")


if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    import triton
    import triton.language as tl
else:
    triton = tl = _NoTriton()

_VALID = ("auto", "triton", "torch")


def set_backend(name: str) -> None:
    global _backend
    if name.lower() not in _VALID:
        raise ValueError(f"backend {name!r} (NANOSPEC_BACKEND or set_backend) is not one of {_VALID}")
    _backend = name.lower()


set_backend(os.environ.get("NANOSPEC_BACKEND", "auto"))


@contextlib.contextmanager
def backend(name: str):
    """Temporarily run every op with the given backend: ``with backend("triton"): ...``."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op whose main input is ``t`` should run its Triton kernel."""
    if _backend == "torch":
        return False
    if _backend == "triton":
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            _no_triton("the triton backend on a CPU tensor")
        return True
    return t.is_cuda


def dispatch(triton_op: Callable, ref_op: Callable) -> Callable:
    """The op: ``triton_op`` when its first tensor argument should run Triton, else ``ref_op`` (whose name and docstring
    it carries)."""
    first = next(iter(inspect.signature(ref_op).parameters))

    @functools.wraps(ref_op)
    def op(*args, **kwargs):
        return (triton_op if use_triton(args[0] if args else kwargs[first]) else ref_op)(*args, **kwargs)

    op.__name__ = op.__qualname__ = ref_op.__name__.removesuffix("_ref")
    return op
