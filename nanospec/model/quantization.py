"""Weight-only quantized weights: what a quantized weight is, apart from how a device multiplies by it.

**int4**, in groups of ``G`` (32, 64 or 128) consecutive inputs, a float scale and zero per group, two to a byte (the
even input in the low nibble: ``packed[n, j] = q[n, 2j] | q[n, 2j + 1] << 4``), rounded to nearest per group::

    w[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]          q in 0..15
    s = (max - min) / 15,   zero = min + 8 s,   q = round((w - min) / s)   (min and max land on q = 0 and 15)

**int8**, one symmetric scale per output channel::

    w[n, k] = q[n, k] * scale[n]                                           q in -127..127,  scale = max_k |w| / 127

Scales and zeros are float32 here; a device's kernel may round them. Both kinds slice like a float ``(out, in)``
weight, join along the output axis (``cat_rows``) and give back the float weight they stand for (``dequantize``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

INT4_GROUP_SIZES = (32, 64, 128)
# what LLM(quantization=...) takes: "auto" keeps a GGUF file's 4-bit blocks (see nanospec.model.gguf_quant) and
# loads a Hugging Face checkpoint as it is stored; None loads every weight as float
QUANTIZATIONS = ("auto", "int4", "int4-g64", "int4-g128", "int8")


class _RowWise:
    """A quantized weight's tensors, each with the weight's output axis first."""

    def map_tensors(self, fn):
        """The same kind of weight, ``fn`` applied to each of its tensors."""
        return replace(self, **{name: fn(t) for name, t in vars(self).items() if isinstance(t, torch.Tensor)})

    def rows(self, start: int, end: int):
        return self.map_tensors(lambda t: t[start:end].contiguous())

    def to(self, device):
        return self.map_tensors(lambda t: t.to(device))

    @property
    def device(self) -> torch.device:
        return self.scale.device


@dataclass
class Int4Weight(_RowWise):
    packed: torch.Tensor  # uint8 [N, K / 2]
    scale: torch.Tensor   # float32 [N, K / G]
    zero: torch.Tensor    # float32 [N, K / G]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def unpacked(self) -> torch.Tensor:
        """q as uint8 ``[N, K]``, one value 0..15 per input."""
        low, high = self.packed & 15, self.packed >> 4
        return torch.stack([low, high], dim=-1).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        N, K = self.shape
        q = self.unpacked().view(N, K // self.group_size, self.group_size).float() - 8
        return (q * self.scale[..., None] + self.zero[..., None]).reshape(N, K).to(dtype)

    def columns(self, start: int, end: int) -> Int4Weight:
        G = self.group_size
        if start % G or end % G:
            raise ValueError(f"an int4 weight in groups of {G} splits only on group boundaries, not at inputs "
                             f"{start}..{end}")
        return Int4Weight(self.packed[:, start // 2:end // 2].contiguous(), self.scale[:, start // G:end // G]
                          .contiguous(), self.zero[:, start // G:end // G].contiguous(), G)


@dataclass
class Int8Weight(_RowWise):
    q: torch.Tensor      # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def columns(self, start: int, end: int) -> Int8Weight:
        return Int8Weight(self.q[:, start:end].contiguous(), self.scale)


QuantizedWeight = Int4Weight | Int8Weight
Weight = torch.Tensor | QuantizedWeight


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q ``[N, K]`` (values 0..15, K even) two to a byte, the even input in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Round a float ``(out, in)`` weight to int4 groups of ``group_size`` (to nearest; see the module)."""
    N, K = weight.shape
    check_int4_shape(K, group_size)
    w = weight.float().reshape(N, K // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((w - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    return Int4Weight(pack_int4(q.reshape(N, K)), scale, low + 8 * scale, group_size)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round a float ``(out, in)`` weight to int8 with one symmetric scale per output channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return Int8Weight((w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale)


def quantize(weight: torch.Tensor, scheme: str, group_size: int = 32) -> QuantizedWeight:
    if scheme == "int4":
        return quantize_int4(weight, group_size)
    if scheme == "int8":
        return quantize_int8(weight)
    raise ValueError(f"quantization {scheme!r} is not one of {QUANTIZATIONS}")


def parse_quantization(value) -> tuple[str | None, int]:
    """``LLM(quantization=...)`` as (scheme, int4 group size): ``None``, "auto", "int4" (groups of 32), "int4-g64",
    "int4-g128" or "int8"; a ValueError names anything else."""
    if value is None:
        return None, 32
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None (float weights), "
                         f"got {value!r}")
    scheme, _, group = value.partition("-g")
    return scheme, int(group or 32)


def quantization_from_cli(value: str) -> str | None:
    """A command line's ``--quantization`` as ``LLM(quantization=...)`` takes it: "none" (float weights) is None; a
    ValueError in the command line's spelling names anything else."""
    if value == "none":
        return None
    if value not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)} or none (float weights), "
                         f"got {value!r}")
    return value


def int4_group_size(tensors: dict) -> int | None:
    """The largest int4 group among ``tensors``' values (None: no int4 weight)."""
    return max((t.group_size for t in tensors.values() if isinstance(t, Int4Weight)), default=None)


def check_int4_shape(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"int4 in groups of {group_size} needs every layer's input size to be a multiple of "
                         f"{group_size}; this model has a layer with {in_features} inputs")


def cat_rows(weights: list[Weight]) -> Weight:
    """Weights of the same kind stacked along the output axis (fused q/k/v, gate/up)."""
    first = weights[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(weights)
    if any(type(w) is not type(first) for w in weights):
        raise ValueError("cannot fuse weights of different kinds: " + ", ".join(type(w).__name__ for w in weights))
    if isinstance(first, Int4Weight) and any(w.group_size != first.group_size for w in weights):
        raise ValueError("cannot fuse int4 weights of different group sizes")
    names = [name for name, t in vars(first).items() if isinstance(t, torch.Tensor)]
    return replace(first, **{name: torch.cat([getattr(w, name) for w in weights]) for name in names})


def select_rows(weight: Weight, index: torch.Tensor) -> Weight:
    """The rows ``index`` of a weight, of the same kind (an embedding lookup, a permutation of rows)."""
    return weight[index] if isinstance(weight, torch.Tensor) else weight.map_tensors(lambda t: t[index])


def pad_rows(weight: Weight, num_rows: int) -> Weight:
    """``weight`` with zero rows appended up to ``num_rows`` rows (the all-gather of a vocabulary-parallel head)."""
    pad = num_rows - weight.shape[0]
    if pad == 0:
        return weight
    if isinstance(weight, torch.Tensor):
        return F.pad(weight, (0, 0, 0, pad))
    if isinstance(weight, Int4Weight):  # q = 8, scale = zero = 0: w = 0
        return Int4Weight(F.pad(weight.packed, (0, 0, 0, pad), value=0x88), F.pad(weight.scale, (0, 0, 0, pad)),
                          F.pad(weight.zero, (0, 0, 0, pad)), weight.group_size)
    return Int8Weight(F.pad(weight.q, (0, 0, 0, pad)), F.pad(weight.scale, (0, pad)))


def to_device(weight: Weight, device, dtype: torch.dtype) -> Weight:
    """A float weight in ``dtype`` on ``device``; a quantized one moved as it is."""
    if isinstance(weight, torch.Tensor):
        return weight.to(device=device, dtype=dtype)
    return weight.to(device)

