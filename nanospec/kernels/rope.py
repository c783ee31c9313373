"""Rotary position embedding, HF Llama ("rotate_half" / neox) layout. For a head vector x of size D at position p:

    inv_freq[i]  = theta ** (-2i / D),  i in [0, D/2)    (rescaled as HF ``rope_scaling`` asks: linear or llama3)
    out[i]       = x[i] * c - x[i + D/2] * s              c, s = cos, sin of p * inv_freq[i]
    out[i + D/2] = x[i + D/2] * c + x[i] * s

computed in fp32, stored in the input dtype, out of place. The cache holds ``[cos(p * inv_freq) | sin(p * inv_freq)]``
for every position (fp32 ``[P, D]``). The Triton helpers here serve :mod:`nanospec.kernels.rope_store_kv`.
"""

from __future__ import annotations

import math

import torch

from nanospec.kernels.backend import tl, triton

# The RoPE scalings rope_inv_freq computes, each with the numbers it reads from ``rope_scaling`` (besides "rope_type").
ROPE_SCALING_KEYS = {"default": (), "linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None, device=None) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 inverse frequencies. ``linear`` scaling divides each by ``factor``; ``llama3`` divides
    the low frequencies by ``factor``, keeps the high ones and interpolates smoothly in between."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        factor, low_freq_factor, high_freq_factor, original_max = (scaling[k] for k in ROPE_SCALING_KEYS[rope_type])
        wavelength = 2 * math.pi / inv_freq
        # 0 where the frequency is kept (short wavelengths), 1 where it is divided by factor (long ones).
        smooth = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
        is_high = wavelength < original_max / high_freq_factor
        is_low = wavelength > original_max / low_freq_factor
        smooth = torch.where(is_high, 1.0, torch.where(is_low, 0.0, smooth))
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_SCALING_KEYS)})")


def build_rope_cache(head_dim: int, max_position: int, theta: float, rope_scaling: dict | None = None,
                     device=None) -> torch.Tensor:
    """``[max_position, head_dim]`` fp32: cos(p * inv_freq) in the first half, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling, device)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@triton.jit
def rotate_heads(in_row_ptr, out_row_ptr, in_head_stride, out_head_stride, num_heads, half_dim, cos, sin,
                 BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the ``num_heads`` head vectors of one token (``in_row_ptr``: its first head) into
    ``out_row_ptr`` (fp32 math, stored in the output's dtype)."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half_dim)
    in_first = in_row_ptr + heads * in_head_stride + cols
    x1 = tl.load(in_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(in_first + half_dim, mask=mask, other=0.0).to(tl.float32)
    out_first = out_row_ptr + heads * out_head_stride + cols
    dtype = out_row_ptr.dtype.element_ty
    tl.store(out_first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_first + half_dim, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def load_cos_sin(positions_ptr, cos_sin_ptr, token, half_dim, BLOCK_HALF: tl.constexpr):
    """``cos, sin`` ``[1, BLOCK_HALF]`` (fp32) at the position of ``token``."""
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half_dim
    cache_row = cos_sin_ptr + position * (2 * half_dim)
    cos = tl.load(cache_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_row + half_dim + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return cos, sin


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope(q), rope(k))`` at ``positions``: the formula above in fp32, stored in the inputs' dtypes."""
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[positions, None, :half], cos_sin_cache[positions, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
