"""Counter-based random numbers, bit-identical in Triton and in PyTorch: ``uniform(seed, offset, index)``.

    h = mix32(mix32(mix32(mix32(seed_lo ^ K0) ^ seed_hi) ^ offset) ^ index)      (all uint32, wrapping)
    u = ((h >> 9) + 0.5) / 2**23 = (2j + 1) / 2**24,  j = h >> 9 in [0, 2**23)

so u is one of 2**23 exact float32 values strictly inside (0, 1). ``mix32`` is "lowbias32"; ``seed`` a request's
64-bit seed, ``offset`` its step (the position drawn), ``index`` the number within a step (a vocabulary entry). Each
input is mixed in alone, so no two seeds share a stream at shifted offsets.
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import tl, triton

_MASK32 = 0xFFFFFFFF


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def uniform(seed, offset, index):
    """Uniform float32 in (0, 1) from int64 seed, offset and index (tensors or ints, broadcasting)."""
    seed64 = tl.cast(seed, tl.int64)
    seed_lo = (seed64 & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed64 >> 32) & 0xFFFFFFFF).to(tl.uint32)
    off = (tl.cast(offset, tl.int64) & 0xFFFFFFFF).to(tl.uint32)
    idx = (tl.cast(index, tl.int64) & 0xFFFFFFFF).to(tl.uint32)
    h = _mix32(seed_lo ^ 0x9E3779B9)
    h = _mix32(h ^ seed_hi)
    h = _mix32(h ^ off)
    h = _mix32(h ^ idx)
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


def _mix32_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    return x


def uniform_ref(seed, offset, index) -> torch.Tensor:
    """Torch: the same numbers as the Triton ``uniform`` (int64 tensors or ints, broadcasting)."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    offset = torch.as_tensor(offset, dtype=torch.int64, device=seed.device)
    index = torch.as_tensor(index, dtype=torch.int64, device=seed.device)
    seed_lo = seed & _MASK32
    seed_hi = (seed >> 32) & _MASK32
    h = _mix32_ref(seed_lo ^ 0x9E3779B9)
    h = _mix32_ref(h ^ seed_hi)
    h = _mix32_ref(h ^ (offset & _MASK32))
    h = _mix32_ref(h ^ (index & _MASK32))
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
