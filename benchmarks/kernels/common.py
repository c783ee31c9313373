"""What the kernel micro-benchmarks share: they time compiled Triton kernels, so each needs a CUDA GPU.

Imported by the bench_*.py scripts beside it (run as ``python benchmarks/kernels/bench_NAME.py``, this folder
is on sys.path).
"""

from __future__ import annotations

import sys

import torch

NO_GPU_STATUS = 2


def require_cuda(script: str) -> None:
    """Return if a CUDA GPU is available; otherwise print one line on stderr and exit with status 2."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU; none is available here (on a CPU Triton kernels only run "
              "interpreted, so their timings would mean nothing)", file=sys.stderr)
        sys.exit(NO_GPU_STATUS)
