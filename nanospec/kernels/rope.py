"""Rotary position embedding, HF Llama ("rotate_half" / neox) layout.

Inverse frequencies, for i in [0, D/2):

    inv_freq[i] = theta ** (-2i / D)

optionally rescaled (HF ``rope_scaling``): ``linear`` divides every frequency by ``factor``; ``llama3``
divides the low frequencies (wavelength 2*pi/inv_freq above original_max / low_freq_factor) by
``factor``, keeps the high ones (wavelength below original_max / high_freq_factor) and interpolates
smoothly in between.

The cache holds, for every position p, ``[cos(p * inv_freq) | sin(p * inv_freq)]`` (fp32, ``[P, D]``).
Rotating one head vector x of size D at position p, for i < D/2 (c, s = cos, sin of p * inv_freq[i]):

    out[i]       = x[i] * c - x[i + D/2] * s
    out[i + D/2] = x[i + D/2] * c + x[i] * s

computed in fp32, stored in the input dtype, out of place. ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]``
may be strided views of a fused qkv projection (the last dim must be contiguous); ``positions``
``[T]`` int64 index the cache and must be below its length. The Triton kernel runs one program per
token and rotates all its q and k heads.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nanospec.kernels.backend import use_triton


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None, device=None) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 inverse frequencies, rescaled as ``rope_scaling`` asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))

    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        original_max = rope_scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        # 0 where the frequency is kept (short wavelengths), 1 where it is divided by factor (long ones).
        smooth = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
        is_high = wavelength < original_max / high_freq_factor
        is_low = wavelength > original_max / low_freq_factor
        smooth = torch.where(is_high, 1.0, torch.where(is_low, 0.0, smooth))
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


def build_rope_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    rope_scaling: dict | None = None,
    device=None,
) -> torch.Tensor:
    """``[max_position, head_dim]`` fp32: cos(p * inv_freq) in the first half, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling, device)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@triton.jit
def _rotate_heads(
    in_row_ptr,
    out_row_ptr,
    in_head_stride,
    out_head_stride,
    num_heads,
    half_dim,
    cos,
    sin,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
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
def _cos_sin(positions_ptr, cos_sin_ptr, token, half_dim, BLOCK_HALF: tl.constexpr):
    """``cos, sin`` ``[1, BLOCK_HALF]`` (fp32) at the position of ``token``."""
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half_dim
    cache_row = cos_sin_ptr + position * (2 * half_dim)
    cos = tl.load(cache_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_row + half_dim + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    num_q_heads,
    num_k_heads,
    half_dim,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(positions_ptr, cos_sin_ptr, token, half_dim, BLOCK_HALF)
    _rotate_heads(q_ptr + token * q_token_stride, q_out_ptr + token * num_q_heads * 2 * half_dim, q_head_stride,
                  2 * half_dim, num_q_heads, half_dim, cos, sin, BLOCK_Q_HEADS, BLOCK_HALF)
    _rotate_heads(k_ptr + token * k_token_stride, k_out_ptr + token * num_k_heads * 2 * half_dim, k_head_stride,
                  2 * half_dim, num_k_heads, half_dim, cos, sin, BLOCK_K_HEADS, BLOCK_HALF)


class RopeTables:
    """The torch reference's per-batch work: ``cos`` and a signed ``sin`` over the whole head,

        cos = [c | c],   sin = [-s | s],   rope(x) = x * cos + [x2 | x1] * sin

    (the two halves of the formula above in three ops). Built once per forward and shared by every
    layer. ``head_scale`` ``[H]`` optionally multiplies head ``h``'s rows by ``head_scale[h]``: the
    engine's torch path folds the softmax scale into the query heads this way.
    """

    def __init__(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_scale: torch.Tensor | None = None):
        half_dim = cos_sin_cache.shape[-1] // 2
        cos_sin = cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin[:, :half_dim], cos_sin[:, half_dim:]
        self.cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [T, 1, D]
        self.sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1)
        if head_scale is not None:  # [T, H, D]
            self.cos = self.cos * head_scale[:, None]
            self.sin = self.sin * head_scale[:, None]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` rotated (fp32 math, stored in x's dtype), out of place."""
        x32 = x if x.dtype == torch.float32 else x.float()
        swapped = torch.roll(x32, x.shape[-1] // 2, dims=-1)  # [x2 | x1]
        out = torch.addcmul(x32 * self.cos, swapped, self.sin)
        return out if out.dtype == x.dtype else out.to(x.dtype)


def apply_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    tables = RopeTables(positions, cos_sin_cache)
    qk = _adjacent_heads(q, k)
    if qk is not None:  # q and k are neighbouring slices of one fused qkv output: rotate them in one pass
        rotated = tables.rotate(qk)
        return rotated[:, : q.shape[1]], rotated[:, q.shape[1]:]
    return tables.rotate(q), tables.rotate(k)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``[T, Hq + Hk, D]`` view over q and k when k's heads directly follow q's in memory, else None."""
    if (q.dtype != k.dtype or q.stride() != k.stride() or q.stride(-1) != 1 or q.stride(1) != q.shape[-1]
            or q.shape[0] != k.shape[0] or k.data_ptr() != q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size()):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def apply_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half_dim = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_sin_cache.contiguous(),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        num_q_heads,
        num_k_heads,
        half_dim,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_K_HEADS=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half_dim),
    )
    return q_out, k_out


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return apply_rope_triton(q, k, positions, cos_sin_cache)
    return apply_rope_ref(q, k, positions, cos_sin_cache)
