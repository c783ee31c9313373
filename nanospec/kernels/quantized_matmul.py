"""Weight-only quantized matmul: ``y = x W^T`` with ``W`` dequantized in registers, never in memory.

    W[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]     int4: two q a byte, even k in the low nibble
    W[n, k] = q[n, k] * scale[n]                                       int8: one group of K, no zero

Shapes: ``x [M, K]``, ``q [N, K / 2]`` uint8 (int4) or ``[N, K]`` int8, ``scale``, ``zero`` ``[N, K / G]``; ``y [M,
N]`` in ``x.dtype``, accumulated in float32. Triton: tiles of ``y``, K in steps of ``BLOCK_K``; for ``M <= 16``
(decode, verify) K may also be split into ``split_k`` slices summed in a fixed order. The reference dequantizes and
calls ``F.linear``; the CPU path uses PyTorch's own weight-only kernels (``nanospec.model.linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanospec.kernels.backend import dispatch, tl, triton


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, out_ptr,
    M, N, K, k_per_split,
    x_row_stride, q_row_stride, scale_row_stride, out_split_stride,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUPS: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``y`` over one K slice. Every load is contiguous along K: int4 reads
    ``BLOCK_K / 2`` whole bytes a row and interleaves their low and high nibbles back into K order; the tile's
    ``TILE_GROUPS`` scales (and zeros) a row are read once and broadcast over their groups. int8's per-channel scale
    multiplies the finished sums."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    w_rows = cols[:, None].to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row_stride + ks[None, :],
                    mask=row_ok[:, None] & (ks < k_end)[None, :], other=0.0)
        if BITS == 4:  # K is even (a multiple of the group): byte j holds k = 2j (low nibble) and 2j + 1
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(q_ptr + w_rows * q_row_stride + half[None, :],
                           mask=col_ok[:, None] & (half < k_end // 2)[None, :], other=0)
            w = tl.interleave(byte & 15, byte >> 4).to(tl.float32) - 8  # [BLOCK_N, BLOCK_K]
            first_k = k0 + tl.arange(0, TILE_GROUPS) * (BLOCK_K // TILE_GROUPS)  # each group's first k in the tile
            at = w_rows * scale_row_stride + (first_k // GROUP)[None, :]
            group_ok = col_ok[:, None] & (first_k < k_end)[None, :]
            w = tl.reshape(w, (BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS))
            w = w * tl.load(scale_ptr + at, mask=group_ok, other=0.0).to(tl.float32)[:, :, None]
            if HAS_ZERO:
                w += tl.load(zero_ptr + at, mask=group_ok, other=0.0).to(tl.float32)[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        else:
            w = tl.load(q_ptr + w_rows * q_row_stride + ks[None, :], mask=col_ok[:, None] & (ks < k_end)[None, :],
                        other=0).to(tl.float32)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # int8 values are exact in bf16 and fp16
    if BITS == 8:
        acc *= tl.load(scale_ptr + cols * scale_row_stride, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * out_split_stride + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


FEW_ROWS = 16  # at most this many rows (decode, verify): the narrow launch shape


def launch_shape(M: int, N: int, K: int) -> dict:
    """Block sizes and the K split for ``M`` rows (only which side of ``FEW_ROWS`` ``M`` falls on counts): a few rows
    read each weight once, in narrow tiles over long K steps (a split of K measured slower, benchmarks/RESULTS.md)."""
    if M <= FEW_ROWS:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, split_k=1, num_warps=4)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, split_k=1, num_warps=8)


def quantized_matmul_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                            group_size: int, bits: int, shape: dict | None = None) -> torch.Tensor:
    """``shape``: override :func:`launch_shape` (tests: small blocks, several K slices)."""
    M, K = x.shape
    N = q.shape[0]
    if K == 0:  # an empty sum
        return torch.zeros(M, N, dtype=x.dtype, device=x.device)
    shape = dict(shape or launch_shape(M, N, K))
    split_k = shape.pop("split_k")
    block_k = shape["BLOCK_K"]
    if bits == 4 and block_k % group_size and group_size % block_k:
        raise ValueError(f"BLOCK_K={block_k} and the group size {group_size} must divide one another")
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    # one K slice writes y itself; several write float32 partial sums, added in a fixed order
    partial = torch.empty((split_k, M, N), dtype=torch.float32 if split_k > 1 else x.dtype, device=x.device)
    if M and N:
        x = x.contiguous()
        grid = (triton.cdiv(M, shape["BLOCK_M"]), triton.cdiv(N, shape["BLOCK_N"]), split_k)
        _quantized_matmul_kernel[grid](
            x, q, scale, zero if zero is not None else scale, partial, M, N, K, k_per_split,
            x.stride(0), q.stride(0), scale.stride(0), M * N,
            GROUP=group_size, BITS=bits, HAS_ZERO=zero is not None, DOT_FP32=x.dtype == torch.float32,
            TILE_GROUPS=max(block_k // group_size, 1) if bits == 4 else 1, **shape)
    return partial[0] if split_k == 1 else partial.sum(dim=0).to(x.dtype)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
                   bits: int) -> torch.Tensor:
    """The float32 ``W [N, K]`` that ``q``, ``scale``, ``zero`` stand for."""
    if q.shape[1] == 0:  # K = 0: no groups
        return torch.zeros(q.shape[0], 0, device=q.device)
    if bits == 4:
        q = torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1).float() - 8
    else:
        q = q.float()
    N, K = q.shape
    w = q.view(N, K // group_size, group_size) * scale.float().view(N, -1, 1)
    if zero is not None:
        w = w + zero.float().view(N, -1, 1)
    return w.view(N, K)


def quantized_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                         group_size: int, bits: int) -> torch.Tensor:
    return F.linear(x.float(), dequantize_ref(q, scale, zero, group_size, bits)).to(x.dtype)


quantized_matmul = dispatch(quantized_matmul_triton, quantized_matmul_ref)
