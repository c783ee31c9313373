"""``y = x W^T``: the one place the model multiplies by a weight matrix.

On CUDA this is ``F.linear`` (cuBLAS). On CPU in float32 the weight is pre-packed once for oneDNN
(``torch.ops.mkldnn``), measured on the 2-core CI machine against ``F.linear`` (MKL), 30 matrices of
3072x576: 1 token 10.6 vs 18.8 ms, 2 tokens 11.2 vs 38.0 ms, 6 tokens 12.4 vs 40.9 ms. Its
matrix-vector product reads memory faster, and its cost stays flat for small token counts, which is
what makes verifying several speculative tokens almost as cheap as decoding one. Results agree with
``F.linear`` to float32 rounding (summation order differs). ``NANOSPEC_ONEDNN=0`` turns it off.
A tensor-parallel version would shard ``weight`` by rows (q/k/v, gate/up) or columns (o, down) here.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and os.environ.get("NANOSPEC_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
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
