"""Token sampling: temperature, min-p, top-k, top-p, and seeded draws from a distribution.

``probs_from_logits`` turns a row of logits ``x`` into the distribution a request samples from:

* ``T == 0`` (greedy): the one-hot of ``argmax x`` (the first index on ties);
* otherwise ``w_v = exp((x_v - max x) / T)`` over the kept tokens ``{v : x_v >= tau}``, normalised; ``tau`` is the
  larger of top-k's ``tau_k`` (the k-th largest logit, ties kept) and top-p's ``tau_p`` (the largest ``t`` with
  ``sum_{x_v >= max(tau_k, t)} w_v >= top_p * sum_{x_v >= tau_k} w_v``: vLLM's smallest nucleus).
  min-p (vLLM's, applied before top-k and top-p) keeps the tokens with ``p_v >= min_p * max p``, i.e.
  ``x_v >= max x + T log(min_p)``: the ``m`` most likely, so it joins top-k as ``k = min(k, m)``.

Thresholds compare an order-preserving int32 key of the float32 bits, so both backends keep the same top-k set; the
Triton kernel finds each by bisection over the keys (sort-free), the reference by ``torch.topk``.
``sample_from_probs`` draws one token per row by the exponential race at ``(seed, offset)``
(:mod:`nanospec.kernels.exponential_race`), bit-identical in both backends. Shapes: logits ``[N, V]``, temperature
top_p and min_p ``[N]`` float32 (min_p None: 0, off), top_k ``[N]`` int32, seeds and offsets ``[N]`` int64.
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import dispatch, tl, triton
from nanospec.kernels.exponential_race import race, race_ref


def _block_v(vocab_size: int) -> int:
    return min(max(triton.next_power_of_2(vocab_size), 16), 1024)


@triton.jit
def _order_key(x):
    """int32 key that sorts like the float32 ``x``: flip the magnitude bits of negative numbers."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _row_argmax(row_logits, vocab_size, BLOCK_V: tl.constexpr):
    """The largest logit of a row and the first index that holds it."""
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_logits + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        block_best = tl.max(x, axis=0)
        better = block_best > best
        best_index = tl.where(better, start + tl.argmax(x, axis=0), best_index)
        best = tl.where(better, block_best, best)
    return best, best_index


@triton.jit
def _at_or_above(row_logits, vocab_size, key_threshold, row_max, temperature, MASS: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """Over the tokens of a row with ``key(x) >= key_threshold``: how many, or with ``MASS`` the sum of
    ``exp((x - row_max) / temperature)``."""
    if MASS:
        total = tl.full((), 0.0, tl.float32)
    else:
        total = tl.full((), 0, tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        x = tl.load(row_logits + cols, mask=mask, other=float("-inf")).to(tl.float32)
        kept = mask & (_order_key(x) >= key_threshold)
        if MASS:
            total += tl.sum(tl.where(kept, tl.exp((x - row_max) / temperature), 0.0), axis=0)
        else:
            total += tl.sum(kept.to(tl.int32), axis=0)
    return total


@triton.jit
def _largest_key(row_logits, vocab_size, lo, goal, row_max, temperature, MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The largest key ``>= lo`` whose :func:`_at_or_above` is ``>= goal`` and positive (``lo`` if none): each round
    keeps ``lo`` a key that qualifies and halves ``[lo, hi]``, so 32 rounds cover the 2**32 int32 keys."""
    hi = tl.full((), 2**31 - 1, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        total = _at_or_above(row_logits, vocab_size, mid, row_max, temperature, MASS, BLOCK_V)
        enough = (total >= goal) & (total > 0)
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    return lo


@triton.jit
def _probs_from_logits_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, probs_ptr,
                              logits_row_stride, vocab_size, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * logits_row_stride
    row_probs = probs_ptr + row * vocab_size
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    row_max, argmax = _row_argmax(row_logits, vocab_size, BLOCK_V)

    if temperature == 0.0:
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(row_probs + cols, (cols == argmax).to(tl.float32), mask=cols < vocab_size)
    else:
        threshold = tl.full((), -(2**31), tl.int64)  # every token is at or above it
        if min_p > 0.0:
            min_logit = row_max + temperature * tl.log(min_p)
            num_likely = _at_or_above(row_logits, vocab_size, _order_key(min_logit), row_max, temperature, False,
                                      BLOCK_V)
            top_k = tl.where((top_k > 0) & (top_k < num_likely), top_k, num_likely)
        if (top_k > 0) & (top_k < vocab_size):
            threshold = _largest_key(row_logits, vocab_size, threshold, top_k, row_max, temperature, False, BLOCK_V)
        if top_p < 1.0:
            target = top_p * _at_or_above(row_logits, vocab_size, threshold, row_max, temperature, True, BLOCK_V)
            threshold = _largest_key(row_logits, vocab_size, threshold, target, row_max, temperature, True, BLOCK_V)
        mass = _at_or_above(row_logits, vocab_size, threshold, row_max, temperature, True, BLOCK_V)

        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < vocab_size
            x = tl.load(row_logits + cols, mask=mask, other=float("-inf")).to(tl.float32)
            weight = tl.exp((x - row_max) / temperature)
            probs = tl.where(_order_key(x) >= threshold, weight / mass, 0.0)
            tl.store(row_probs + cols, probs, mask=mask)


@triton.jit
def _sample_from_probs_kernel(probs_ptr, seeds_ptr, offsets_ptr, samples_ptr, probs_row_stride, vocab_size,
                              BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    token = race(probs_ptr + row * probs_row_stride, tl.load(seeds_ptr + row), tl.load(offsets_ptr + row),
                 vocab_size, BLOCK_V)
    tl.store(samples_ptr + row, token)


def _order_key_ref(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _keep_threshold_ref(keys, weights, top_k, top_p) -> torch.Tensor:
    """Per row, the key ``tau`` of the docstring: tokens with ``keys >= tau`` are kept."""
    num_rows, vocab_size = keys.shape
    threshold = torch.full((num_rows,), -(2**31), dtype=torch.int64, device=keys.device)
    top_k_on = (top_k > 0) & (top_k < vocab_size)
    if top_k_on.any():
        largest_k = int(top_k[top_k_on].max())
        top_keys = keys.topk(largest_k, dim=1).values
        kth_key = top_keys.gather(1, (top_k.clamp(1, largest_k) - 1).long()[:, None])[:, 0]
        threshold = torch.where(top_k_on, kth_key.long(), threshold)

    top_p_on = top_p < 1.0
    if top_p_on.any():
        target = top_p * (weights * (keys >= threshold[:, None])).sum(dim=1)
        # The nucleus usually holds few tokens: look at the largest 64 first, double until enough.
        num_candidates = min(64, vocab_size)
        while True:
            candidate_keys, candidate_index = keys.topk(num_candidates, dim=1)
            kept = candidate_keys >= threshold[:, None]
            cumulative = (weights.gather(1, candidate_index) * kept).cumsum(dim=1)
            if num_candidates == vocab_size or bool(((cumulative[:, -1] >= target) | ~top_p_on).all()):
                break
            num_candidates = min(2 * num_candidates, vocab_size)
        crossing = (cumulative < target[:, None]).sum(dim=1).clamp(max=num_candidates - 1)
        crossing_key = candidate_keys.gather(1, crossing[:, None])[:, 0].long()
        threshold = torch.where(top_p_on, torch.maximum(threshold, crossing_key), threshold)
    return threshold


def _with_min_p_ref(top_k, x, temperature, min_p) -> torch.Tensor:
    """top_k with min-p joined in: ``min(k, #{v : x_v >= max x + T log(min_p)})`` where min_p > 0."""
    if min_p is None or not bool((min_p > 0).any()):
        return top_k
    min_logit = x.amax(dim=1) + temperature * torch.log(min_p.float())
    num_likely = (x >= min_logit[:, None]).sum(dim=1).to(top_k.dtype)
    joined = torch.where((top_k > 0) & (top_k < num_likely), top_k, num_likely)
    return torch.where(min_p > 0, joined, top_k)


def probs_from_logits_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 ``[N, V]`` distribution each row samples from (see the module docstring)."""
    x = logits.float()
    one_hot = torch.zeros_like(x).scatter_(1, x.argmax(dim=1, keepdim=True), 1.0)
    greedy_rows = temperature == 0
    if greedy_rows.all():
        return one_hot
    safe_temperature = torch.where(greedy_rows, 1.0, temperature.float())
    weights = torch.exp((x - x.amax(dim=1, keepdim=True)) / safe_temperature[:, None])
    keys = _order_key_ref(x)
    top_k = _with_min_p_ref(top_k, x, safe_temperature, min_p)
    threshold = _keep_threshold_ref(keys, weights, top_k, top_p)
    kept_weights = weights * (keys >= threshold[:, None])
    probs = kept_weights / kept_weights.sum(dim=1, keepdim=True)
    return torch.where(greedy_rows[:, None], one_hot, probs)


def sample_from_probs_ref(probs: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (unnormalised is fine), a pure function of (probs, seed, offset)."""
    return race_ref(probs, seeds, offsets)


def sample_ref(logits, temperature, top_k, top_p, seeds, offsets, min_p=None) -> torch.Tensor:
    """``sample_from_probs(probs_from_logits(logits, ...), seeds, offsets)``: int64 ``[N]``."""
    return sample_from_probs_ref(probs_from_logits_ref(logits, temperature, top_k, top_p, min_p), seeds, offsets)


def probs_from_logits_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_rows, vocab_size = logits.shape
    probs = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    min_p = torch.zeros_like(top_p, dtype=torch.float32) if min_p is None else min_p
    if num_rows > 0:
        _probs_from_logits_kernel[(num_rows,)](logits, temperature.float().contiguous(),
                                               top_k.to(torch.int32).contiguous(), top_p.float().contiguous(),
                                               min_p.float().contiguous(), probs, logits.stride(0), vocab_size,
                                               BLOCK_V=_block_v(vocab_size))
    return probs


def sample_from_probs_triton(probs: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    probs = probs.float()
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    num_rows, vocab_size = probs.shape
    samples = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows > 0:
        _sample_from_probs_kernel[(num_rows,)](probs, seeds.to(torch.int64).contiguous(),
                                               offsets.to(torch.int64).contiguous(), samples, probs.stride(0),
                                               vocab_size, BLOCK_V=_block_v(vocab_size))
    return samples


def sample_triton(logits, temperature, top_k, top_p, seeds, offsets, min_p=None) -> torch.Tensor:
    return sample_from_probs_triton(probs_from_logits_triton(logits, temperature, top_k, top_p, min_p), seeds,
                                    offsets)


probs_from_logits = dispatch(probs_from_logits_triton, probs_from_logits_ref)
sample_from_probs = dispatch(sample_from_probs_triton, sample_from_probs_ref)
sample = dispatch(sample_triton, sample_ref)
