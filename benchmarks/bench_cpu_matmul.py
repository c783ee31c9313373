"""The CPU's weight-only matmul kernels on SmolLM2-135M's shapes: microseconds per call (median of repeats).

    python benchmarks/bench_cpu_matmul.py                 # 1 and 4 rows
    python benchmarks/bench_cpu_matmul.py --rows 1 4 8
    python benchmarks/bench_cpu_matmul.py --rows 1 16     # 16: an MLP speculator's beam of 16 paths

Kernels, as ``nanospec.model.linear`` calls them: int4 in groups of 32 (``_weight_int4pack_mm_for_cpu``, bfloat16
inputs), int8 per output channel (``_weight_int8pack_mm``, bfloat16 inputs), float32 through oneDNN's packed weight
and through ``F.linear``, and bfloat16 ``F.linear``. Which is fastest depends on the CPU's vector units (AVX-512
BF16 multiplies bfloat16 natively, AVX2 converts it), so this is the table to read before choosing a quantization
for a machine. Weights are random: the kernels' speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tp import median_ms  # noqa: E402

LAYER = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536)}
SHAPES = {**LAYER, "head": (49152, 576), "draft head": (4096, 576)}  # (the shipped speculators' heads: 4096 tokens)
GROUP = 32


def kernels(out_features: int, in_features: int, rows: int) -> dict:
    w = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    xb = x.to(torch.bfloat16)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (out_features, in_features), dtype=torch.int32), 1)
    scales_and_zeros = torch.randn(in_features // GROUP, out_features, 2).to(torch.bfloat16)
    int8 = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    scale8 = torch.rand(out_features).to(torch.bfloat16)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w)
    wb = w.to(torch.bfloat16)
    return {
        "int4-g32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4, GROUP, scales_and_zeros),
        "int8": lambda: torch._weight_int8pack_mm(xb, int8, scale8),
        "float32 oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
        "float32 F.linear": lambda: F.linear(x, w),
        "bfloat16 F.linear": lambda: F.linear(xb, wb),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=100)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}; microseconds a call (median)")
    names = list(kernels(16, 64, 1))
    print("| rows | matrix | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    totals = {}
    for rows in args.rows:
        for matrix, (n, k) in SHAPES.items():
            with torch.inference_mode():
                us = {name: 1e3 * median_ms(fn, args.repeats if matrix != "head" else max(args.repeats // 10, 5))
                      for name, fn in kernels(n, k, rows).items()}
            if matrix in LAYER:
                for name, value in us.items():
                    totals[rows, name] = totals.get((rows, name), 0.0) + value
            print(f"| {rows} | {matrix} {n}x{k} | " + " | ".join(f"{us[name]:.0f}" for name in names) + " |",
                  flush=True)
        print(f"| {rows} | a layer's four | " + " | ".join(f"{totals[rows, name]:.0f}" for name in names) + " |")


if __name__ == "__main__":
    main()
