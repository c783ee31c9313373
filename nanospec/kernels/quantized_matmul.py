"""Weight-only quantized matmul: ``y = x W^T`` with ``W`` dequantized in registers, never in memory.

    W[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]     int4: two q a byte, even k in the low nibble
    W[n, k] = q[n, k] * scale[n]                                       int8: one group of K, no zero

Shapes: ``x [M, K]``, ``q [N, K / 2]`` uint8 (int4) or ``[N, K]`` int8, ``scale``, ``zero`` ``[N, K / G]``; ``y [M,
N]`` in ``x.dtype``, accumulated in float32. Triton: tiles of ``y``, K in steps of ``BLOCK_K``; for ``M <= 16``
(decode, verify) K is also split into ``SPLIT_K`` slices summed in a fixed order. The reference dequantizes and
calls ``F.linear``; the CPU path uses PyTorch's own weight-only kernels (``nanospec.model.linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanospec.kernels.backend import dispatch


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, out_ptr,
    M, N, K, k_per_split,
    x_row_stride, q_row_stride, scale_row_stride, out_split_stride,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row_stride + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w_rows = cols[:, None].to(tl.int64)
        if BITS == 4:
            byte = tl.load(q_ptr + w_rows * q_row_stride + (ks // 2)[None, :], mask=w_mask, other=0)
            q = (byte.to(tl.int32) >> ((ks % 2) * 4)[None, :]) & 15
            w = (q - 8).to(tl.float32)
        else:
            w = tl.load(q_ptr + w_rows * q_row_stride + ks[None, :], mask=w_mask, other=0).to(tl.float32)
        group = (ks // GROUP)[None, :]
        w = w * tl.load(scale_ptr + w_rows * scale_row_stride + group, mask=w_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            w += tl.load(zero_ptr + w_rows * scale_row_stride + group, mask=w_mask, other=0.0).to(tl.float32)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = out_ptr + pid_k * out_split_stride + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


SPLIT_K_MAX_ROWS = 16


def launch_shape(M: int, N: int, K: int) -> dict:
    """Block sizes and the K split for ``M`` rows (only which side of SPLIT_K_MAX_ROWS ``M`` falls on counts)."""
    if M <= SPLIT_K_MAX_ROWS:
        block_n, block_k = 64, 128
        split_k = max(1, min(triton.cdiv(K, block_k), 128 // triton.cdiv(N, block_n)))
        return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, split_k=split_k)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, split_k=1)


def quantized_matmul_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                            group_size: int, bits: int, shape: dict | None = None) -> torch.Tensor:
    """``shape``: override :func:`launch_shape` (tests: small blocks, several K slices)."""
    M, K = x.shape
    N = q.shape[0]
    shape = dict(shape or launch_shape(M, N, K))
    split_k = shape.pop("split_k")
    block_k = shape["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    partial = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    if M and N:
        x = x.contiguous()
        grid = (triton.cdiv(M, shape["BLOCK_M"]), triton.cdiv(N, shape["BLOCK_N"]), split_k)
        _quantized_matmul_kernel[grid](
            x, q, scale, zero if zero is not None else scale, partial, M, N, K, k_per_split,
            x.stride(0), q.stride(0), scale.stride(0), M * N,
            GROUP=group_size, BITS=bits, HAS_ZERO=zero is not None, DOT_FP32=x.dtype == torch.float32, **shape)
    y = partial[0] if split_k == 1 else partial.sum(dim=0)
    return y.to(x.dtype)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
                   bits: int) -> torch.Tensor:
    """The float32 ``W [N, K]`` that ``q``, ``scale``, ``zero`` stand for."""
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
