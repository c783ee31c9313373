"""``y = x W^T``: the one place the model multiplies by a weight matrix, float or weight-only quantized.

``make_linear`` picks a module per kind of weight. ``Linear`` (float): cuBLAS on CUDA; on a CPU in float32 the weight
is pre-packed once for oneDNN (``NANOSPEC_ONEDNN=0`` turns it off). ``Int4Linear`` / ``Int8Linear``: on a CPU,
PyTorch's weight-only kernels, which take and give bfloat16 (``input_dtype``; ``None``: activations as they are); on
CUDA, nanospec's Triton kernel. Each row of their output depends only on that row of ``x`` (checked by the tests), so a
token's logits are the same in a decode step, a verify step and any batch: speculation stays lossless.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from nanospec.kernels.quantized_matmul import quantized_matmul
from nanospec.model.quantization import Int4Weight, Int8Weight, Weight, quantize_int8, select_rows


def make_linear(weight: Weight, keep_weight: bool = True):
    """The module for ``weight``: a float tensor, an ``Int4Weight`` or an ``Int8Weight`` (on its device).
    ``keep_weight=False``: a module whose CPU kernel reads a repacked copy (int4; float32 on oneDNN) keeps only that
    copy (the head keeps both: the embedding and the logits' refinement read its weight)."""
    if isinstance(weight, Int8Weight):
        return Int8Linear(weight)
    linear = Int4Linear(weight) if isinstance(weight, Int4Weight) else Linear(weight)
    if not keep_weight and linear.packed is not None:
        linear.weight = None
    return linear


# The CPU kernels round their output to bfloat16, coarser than the gaps between the likeliest tokens: every logit
# within REFINE_MARGIN (of the row's largest |logit|) of its row's largest is recomputed in float32, so greedy decoding
# is float32's. The margin (6%) is well above the kernels' error (at most 1% on SmolLM2's head).
REFINE_MARGIN = 2 ** -4


def logits(head, x: torch.Tensor) -> torch.Tensor:
    """``head(x)`` as float32 logits, those near each row's largest recomputed in float32 where ``head`` rounds its
    output to bfloat16 (a quantized head on a CPU)."""
    y = head(x).float()
    if head.input_dtype is None or not isinstance(head.weight, (Int4Weight, Int8Weight)) or not y.numel():
        return y
    near_top = y >= y.amax(dim=-1, keepdim=True) - REFINE_MARGIN * y.abs().amax(dim=-1, keepdim=True)
    rows, tokens = near_top.nonzero(as_tuple=True)
    y[rows, tokens] = (x[rows].float() * select_rows(head.weight, tokens).dequantize()).sum(dim=-1)
    return y


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and os.environ.get("NANOSPEC_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.kind = str(weight.dtype).removeprefix("torch.")
        self.input_dtype = None
        self.packed = None
        if _onednn_usable(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
                probe = torch.ones(1, self.in_features)
                torch.testing.assert_close(self(probe), F.linear(probe, weight), rtol=1e-4, atol=1e-4)
            except Exception:  # an older or different build: fall back to F.linear
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


class PackedLinear(nn.Module):
    """A bias-free ``nn.Linear`` computed by :class:`Linear` (its weight packed) or :class:`Int8Linear`, over any
    leading dims, its output in the input's dtype. Only the packed copy is kept: ``weight`` is a stand-in of no
    storage with the float weight's shape, dtype and device, for the code around it."""

    def __init__(self, linear: nn.Linear, packed):
        super().__init__()
        w = linear.weight
        self.weight = torch.empty((), dtype=w.dtype, device=w.device).expand(w.shape)
        self.linear = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return y.to(x.dtype)


def pack_linears(module: nn.Module, int8: bool = False) -> nn.Module:
    """For inference: each bias-free ``nn.Linear`` in ``module`` (a shared one once) becomes a :class:`PackedLinear`:
    ``int8``, its weight rounded to int8 per output channel (:class:`Int8Linear`); else where :class:`Linear` packs it
    (float32 on a CPU). ``module`` can no longer be trained."""
    packed: dict[int, nn.Module] = {}
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):  # (named_children lists a module shared twice once)
            if isinstance(child, nn.Linear) and child.bias is None:
                if id(child) not in packed:
                    weight = child.weight.detach()
                    linear = Int8Linear(quantize_int8(weight)) if int8 else make_linear(weight, keep_weight=False)
                    packed[id(child)] = PackedLinear(child, linear) if int8 or linear.packed is not None else child
                setattr(parent, name, packed[id(child)])
    return module


_CPU_INT4_ROWS = 16  # PyTorch's CPU int4 layout tiles the output axis by 16: a weight is padded to a multiple


class Int4Linear:
    def __init__(self, weight: Int4Weight):
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        self.kind = f"int4-g{weight.group_size}"
        self.weight = weight  # the CPU kernel reads a repacked copy: keep_weight=False lets this one go
        self.input_dtype = None
        self.packed = None
        if weight.device.type == "cuda":
            return
        self.input_dtype = torch.bfloat16
        pad = -self.out_features % _CPU_INT4_ROWS
        q, scale, zero = weight.unpacked(), weight.scale, weight.zero
        if pad:
            q = F.pad(q, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            w = self.weight
            return quantized_matmul(x, w.packed, w.scale, w.zero, w.group_size, bits=4)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(_bf16_rows(x), self.packed, self.group_size,
                                                       self.scales_and_zeros)
        return y if y.shape[-1] == self.out_features else y[:, : self.out_features]


class Int8Linear:
    """On a CPU, torch's int8 kernel reads the inputs 16 at a time: a weight whose input size is not a multiple of 16
    gets zero columns, and the input zero columns to match (the same sums)."""

    def __init__(self, weight: Int8Weight):
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.kind = "int8"
        self.cpu_scale = weight.scale.to(torch.bfloat16) if weight.device.type == "cpu" else None
        self.input_dtype = torch.bfloat16 if self.cpu_scale is not None else None
        self.pad_inputs = -self.in_features % 16 if self.cpu_scale is not None else 0
        self.cpu_q = F.pad(weight.q, (0, self.pad_inputs)) if self.pad_inputs else weight.q

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.cpu_scale is None:
            return quantized_matmul(x, w.q, w.scale, None, self.in_features, bits=8)
        if self.pad_inputs:
            x = F.pad(x, (0, self.pad_inputs))
        return torch._weight_int8pack_mm(_bf16_rows(x), self.cpu_q, self.cpu_scale)


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).contiguous()
