"""GGUF tensors as nanospec weights: the 4-bit blocks kept as int4 groups of 32, the rest rounded or dequantized.
The 4-bit kinds map exactly onto ``w = (q - 8) * scale + zero`` per 32 inputs (:mod:`nanospec.model.quantization`):

    Q4_0   w = d (q - 8)                           scale = d,       zero = 0
    Q4_1   w = d q + m                             scale = d,       zero = m + 8 d
    Q4_K   w = d sc_j q - dmin mn_j   (8 groups of 32 in a block of 256)
                                                   scale = d sc_j,  zero = 8 d sc_j - dmin mn_j
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from nanospec.model.quantization import Int4Weight, cat_rows, pack_int4, quantize

Q = GGMLQuantizationType
INT4_KINDS = (Q.Q4_0, Q.Q4_1, Q.Q4_K)


ROWS_AT_ONCE = 4096  # rows dequantized, then rounded, at a time: a whole embedding in float32 is ~4x its Q8_0 bytes


def int4_from_blocks(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int]) -> Int4Weight:
    """The Q4_0 / Q4_1 / Q4_K blocks ``data`` (a tensor's bytes) of an ``(out, in)`` weight as int4 groups of 32."""
    N, K = shape
    blocks = data.reshape(-1, GGML_QUANT_SIZES[kind][1])
    q, scale, zero = _q4_k(blocks) if kind == Q.Q4_K else _q4_0_or_1(blocks, kind)
    q = torch.from_numpy(q.reshape(N, K))
    return Int4Weight(pack_int4(q), torch.from_numpy(scale.reshape(N, K // 32)),
                      torch.from_numpy(zero.reshape(N, K // 32)), 32)


def _q4_0_or_1(blocks: np.ndarray, kind) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block of 32: fp16 d (and m for Q4_1), 16 bytes: input j in the low nibble of byte j, j + 16 in the high."""
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)[:, 0]
    qs = blocks[:, 4:] if kind == Q.Q4_1 else blocks[:, 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=1)
    if kind == Q.Q4_0:
        return q, d, np.zeros_like(d)
    m = blocks[:, 2:4].view(np.float16).astype(np.float32)[:, 0]
    return q, d, m + 8 * d


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block of 256: fp16 d, dmin, 12 bytes of 6-bit (sc, mn) for 8 groups (``gguf``'s own unpacking), 128 bytes:
    groups 2i and 2i + 1 in the low and high nibbles of bytes 32i .. 32i + 31."""
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, mn = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    scale = d * sc.reshape(-1, 8).astype(np.float32)
    zero = 8 * scale - dmin * mn.reshape(-1, 8).astype(np.float32)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=2)  # [blocks, 4, 2, 32]: groups in order
    return q, scale, zero


def dequantize_blocks(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Any kind ``gguf`` reads (and F64), as float32 of ``shape``."""
    rows = data.reshape(*shape[:-1], -1)
    if kind == Q.F64:
        return torch.from_numpy(rows.view(np.float64)).float().reshape(shape)
    return torch.from_numpy(quants.dequantize(rows, kind)).reshape(shape)


def gguf_weight(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...], quantization: str | None,
                group_size: int = 32):
    """One tensor as the model holds it. ``quantization`` None: float32; "auto": 4-bit kinds as int4, float kinds float,
    other kinds int8; "int4" / "int8": every 2-D weight that scheme. 1-D tensors are float32."""
    if quantization is None or len(shape) != 2:
        return dequantize_blocks(data, kind, shape)
    if kind in INT4_KINDS and (quantization == "auto" or (quantization == "int4" and group_size == 32)):
        return int4_from_blocks(data, kind, shape)
    if quantization == "auto" and kind in (Q.F32, Q.F16, Q.BF16, Q.F64):
        return dequantize_blocks(data, kind, shape)
    scheme = "int8" if quantization == "auto" else quantization
    rows = data.reshape(shape[0], -1)
    chunks = [rows[i:i + ROWS_AT_ONCE] for i in range(0, shape[0], ROWS_AT_ONCE)]
    return cat_rows([quantize(dequantize_blocks(c, kind, (len(c), shape[1])), scheme, group_size) for c in chunks])
