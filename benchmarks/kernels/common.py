"""What the kernel micro-benchmarks share: they time compiled Triton kernels, so each needs a CUDA GPU, whose clocks
they raise before the first timing.

Imported by the bench_*.py scripts beside it (run as ``python benchmarks/kernels/bench_NAME.py``, this folder
is on sys.path).
"""

from __future__ import annotations

import sys
import time

import torch

NO_GPU_STATUS = 2


def require_cuda(script: str) -> None:
    """Return if a CUDA GPU is available; otherwise print one line on stderr and exit with status 2."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU; none is available here (on a CPU Triton kernels only run "
              "interpreted, so their timings would mean nothing)", file=sys.stderr)
        sys.exit(NO_GPU_STATUS)


def warm_up_gpu(seconds: float = 0.5) -> None:
    """Keep the GPU busy with bf16 matrix products for ``seconds``: an idle GPU runs at a fraction of its clock, and
    the first kernels timed after it would be priced at that clock."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()
