"""SiLU-and-mul, the gated activation of the Llama MLP.

    x = [gate | up]                       x: [T, 2F], gate and up: [T, F]
    out = silu(gate) * up                 silu(g) = g / (1 + exp(-g))

computed in fp32, stored in ``x.dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanospec.kernels.backend import dispatch, tl, triton


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, ffn_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ffn_size
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + ffn_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * ffn_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` ``[T, 2F]``: ``[T, F]``."""
    ffn_size = x.shape[-1] // 2
    if x.dtype == torch.float32:
        return F.silu(x.narrow(-1, 0, ffn_size)).mul_(x.narrow(-1, ffn_size, ffn_size))
    x32 = x.float()
    return F.silu(x32.narrow(-1, 0, ffn_size)).mul_(x32.narrow(-1, ffn_size, ffn_size)).to(x.dtype)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    ffn_size = x.shape[-1] // 2
    x_rows = x.reshape(-1, 2 * ffn_size)
    if x_rows.stride(-1) != 1:
        x_rows = x_rows.contiguous()
    out = torch.empty((*x.shape[:-1], ffn_size), dtype=x.dtype, device=x.device)
    num_rows = x_rows.shape[0]
    if num_rows > 0:
        block = min(triton.next_power_of_2(ffn_size), 1024)
        grid = (num_rows, triton.cdiv(ffn_size, block))
        _silu_and_mul_kernel[grid](x_rows, out, x_rows.stride(0), ffn_size, BLOCK=block)
    return out


silu_and_mul = dispatch(silu_and_mul_triton, silu_and_mul_ref)
