"""One token from a distribution by an exponential race, shared by the sampler and the verifiers:

    token = argmax_v  w_v / E_v,   E_v = -log(uniform(seed, offset, v))

picks v with probability w_v / sum(w). The log is float64 rounded to float32 and divisions round to nearest, so
Triton and torch pick the same token; ties go to the lowest id.
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import tl, triton
from nanospec.kernels.random import uniform, uniform_ref


@triton.jit
def race(p_ptr, seed, offset, V, BLOCK_V: tl.constexpr):
    """The race over one row of weights ``p`` (negative weights count as 0; 0 if no weight is positive)."""
    best_score = tl.full((), 0.0, tl.float32)
    best_token = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        vocab = start + tl.arange(0, BLOCK_V)
        p = tl.load(p_ptr + vocab, mask=vocab < V, other=0.0).to(tl.float32)
        exponential = (-tl.log(uniform(seed, offset, vocab).to(tl.float64))).to(tl.float32)
        score = tl.math.div_rn(tl.maximum(p, 0.0), exponential)
        tile_best = tl.max(score, axis=0)  # a later tile wins only if strictly better: ties go to the lowest id
        best_token = tl.where(tile_best > best_score, start + tl.argmax(score, axis=0), best_token)
        best_score = tl.maximum(tile_best, best_score)
    return best_token


def exponentials_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """E[b, v] = -log(uniform(seeds[b], offsets[b], v)), the float64 log rounded to float32."""
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    u = uniform_ref(seeds[:, None], offsets[:, None], vocab[None, :])
    return (-torch.log(u.double())).float()


def race_ref(weights: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One race per row of ``weights [N, V]``, at row ``n``'s ``(seeds[n], offsets[n])``."""
    exponential = exponentials_ref(seeds.to(weights.device), offsets.to(weights.device), weights.shape[-1])
    return (weights.float().clamp_min(0.0) / exponential).argmax(dim=-1)
