"""Which device and dtype a model runs in: ``None`` / ``"auto"`` pick CUDA and bfloat16 when a GPU is
present, the CPU and float32 otherwise. Bad names fail here, with the accepted ones."""

from __future__ import annotations

import ctypes

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name (cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported (cpu or cuda)")
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def cpu_has_fast_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX-512 BF16 or AMX); without, a bfloat16 ``F.linear``
    converts on the fly and runs slower than float32."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def fix_malloc_mmap_threshold(nbytes: int = 4 << 20) -> None:
    """On glibc, serve every allocation of ``nbytes`` or more from its own memory map, so the load's freed buffers go
    back to the system (glibc's own threshold rises after the first). Process-wide: for entry points."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, nbytes)
