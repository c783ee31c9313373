"""RMSNorm, optionally fused with the residual add that precedes it.

    out[t, :] = x[t, :] / sqrt(mean_h(x[t, h]^2) + eps) * weight

computed in fp32 and stored in ``out_dtype`` (default ``x.dtype``): HF ``LlamaRMSNorm`` up to its extra
rounding of the normalised x to the input dtype before the weight multiply (identical in fp32).

With ``residual`` given, the add comes first and its sum is the new residual stream:

    s = x + residual                      (stored in the promoted dtype of x and residual, normalised as stored)
    returns (rms_norm(s), s)

Shapes: ``x`` and ``residual`` are ``[T, H]`` (any leading dims work, ``T`` may be 0), ``weight`` is ``[H]``.
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import dispatch, tl, triton


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_row_stride, residual_row_stride,
                     hidden_size, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size

    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden_size + cols, summed, mask=mask)
        x = summed.to(tl.float32)

    mean_square = tl.sum(x * x, axis=0) / hidden_size
    inv_rms = tl.rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = x * inv_rms * weight
    tl.store(out_ptr + row * hidden_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x)``, or with ``residual`` ``(rms_norm(x + residual), x + residual)`` (the module docstring)."""
    if residual is None:
        return _normalize(x, weight, eps, out_dtype or x.dtype)
    summed = x + residual
    return _normalize(summed, weight, eps, out_dtype or summed.dtype), summed


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``F.rms_norm``'s ops in its order (the same bits), written out: half the ops on a CPU."""
    x32 = x if x.dtype == torch.float32 else x.float()
    inv_rms = torch.sum(x32 * x32, dim=-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()
    out = (x32 * inv_rms).mul_(weight if weight.dtype == torch.float32 else weight.float())
    return out if out.dtype == out_dtype else out.to(out_dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden_size = x.shape[-1]
    x_rows = x.reshape(-1, hidden_size)
    if x_rows.stride(-1) != 1:
        x_rows = x_rows.contiguous()
    summed_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=out_dtype or summed_dtype, device=x.device)
    if residual is None:
        residual_rows = residual_out = x_rows  # unused by the kernel when HAS_RESIDUAL is False
    else:
        residual_rows = residual.reshape(-1, hidden_size)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        residual_out = torch.empty(x.shape, dtype=summed_dtype, device=x.device)

    num_rows = x_rows.shape[0]
    if num_rows > 0:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_rows,)](x_rows, residual_rows, weight, out, residual_out, x_rows.stride(0),
                                      residual_rows.stride(0), hidden_size, eps, HAS_RESIDUAL=residual is not None,
                                      BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return out if residual is None else (out, residual_out)


rms_norm = dispatch(rms_norm_triton, rms_norm_ref)
