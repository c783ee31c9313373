"""Lossless verification of draft tokens: rejection sampling, and its greedy special case.

Row ``b`` of a batch holds ``n = num_draft_tokens[b]`` draft tokens ``d_0 .. d_{n-1}`` (``0 <= n <= k``),
the target distributions ``p_0 .. p_n`` at those positions (``p_n`` is the bonus distribution) and,
for a draft model, its distributions ``q_0 .. q_{n-1}``. Rows of ``p`` and ``q`` are normalised first
(``p / S_p``, ``q / S_q``, with ``S`` the row sum), so they need not sum exactly to 1.

    for i = 0 .. n-1:
        accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
        on rejection: emit a token drawn from norm(max(p_i - q_i, 0)) and stop      (recovered token)
    if all n drafts were accepted: emit a token drawn from p_n                      (bonus token)

Each emitted token is distributed exactly as a token sampled from ``p`` (Leviathan et al. 2023, Chen et
al. 2023). Without ``draft_probs`` the draft is one-hot at ``d_i`` (n-gram, lookahead): accept with
probability ``p_i(d_i)``; on rejection draw from ``p_i`` with ``d_i`` zeroed. When the residual has
no mass (``p_i == q_i``, where a rejection has probability 0) the token is drawn from ``p_i`` instead.
The output row is ``[d_0 .. d_{a-1}, token, -1, ..., -1]`` (``a`` accepted drafts), of length ``k + 1``.

Randomness. Every number is ``uniform(seed, offset + i, index)`` from :mod:`nanospec.kernels.random`, with
the row's ``seed`` and ``offset`` (the position of its first verified token) and the draft position ``i``:

    acceptance at i:        u = uniform(seed, offset + i, V);  accept iff u * q_i(d_i) * S_p < p_i(d_i) * S_q
                            (that is u < (p_i(d_i) / S_p) / (q_i(d_i) / S_q), without a division)
    a draw from weights w:  token = argmax_v w_v / E_v,   E_v = -log(uniform(seed, offset + i, v))

The draw is an exponential race: the ``E_v`` are independent Exp(1), so ``P(token = v) = w_v / sum w``
with no normalisation and no cumulative sum. The residual's weights are ``max(p / S_p - q / S_q, 0)``;
the bonus token races on ``p_n`` itself. Without ``seeds``, row ``b`` uses seed ``seed + b`` and offset 0
(or ``offsets[b]``). The draft tokens must come from a stream independent of these numbers (a draft model
sampling with the same seed must not reuse ``uniform(seed, offset + i, v)``).

The Triton kernel and the reference compute the same float32 values in the same order, so they emit
identical tokens: sums are accumulated in float64 and rounded to float32 (the order of a float64 sum
almost never shows after that rounding), ``E_v`` is the float64 log rounded to float32 (float32 ``log``
implementations disagree in the last bit: numpy's and torch's on a fifth of all possible u), divisions
round to nearest (``tl.math.div_rn``), ties go to the lowest token id.

Greedy verification (temperature 0) is the same walk with ``p`` one-hot at ``target_argmax``: accept while
``d_i == target_argmax[i]``, then emit ``target_argmax`` at the first mismatch (or the bonus
``target_argmax[n]``). ``rejection_sample`` with one-hot target rows returns exactly ``greedy_verify``.

Triton: one program per row, a loop over draft positions that stops at the first rejection (no host
sync), the vocabulary streamed in ``BLOCK_V`` tiles: one pass per verified position for the row sums,
one pass for the final draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanospec.kernels.backend import use_triton
from nanospec.kernels.exponential_race import draw_token, exponentials_ref
from nanospec.kernels.random import uniform, uniform_ref

_TINY = torch.finfo(torch.float32).tiny  # floor for a row sum, so an all-zero row gives no NaN


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _row_sums(p_ptr, q_ptr, V, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """(S_p, S_q) of one position: float64 sums rounded to float32; S_q = 1 for a one-hot draft."""
    p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    q_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        vocab = start + tl.arange(0, BLOCK_V)
        mask = vocab < V
        p_acc += tl.load(p_ptr + vocab, mask=mask, other=0.0).to(tl.float32).to(tl.float64)
        if HAS_DRAFT_PROBS:
            q_acc += tl.load(q_ptr + vocab, mask=mask, other=0.0).to(tl.float32).to(tl.float64)
    p_sum = tl.maximum(tl.sum(p_acc, axis=0).to(tl.float32), 1.1754943508222875e-38)
    if HAS_DRAFT_PROBS:
        q_sum = tl.maximum(tl.sum(q_acc, axis=0).to(tl.float32), 1.1754943508222875e-38)
    else:
        q_sum = tl.full((), 1.0, tl.float32)
    return p_sum, q_sum


@triton.jit
def _rejection_sample_kernel(
    target_probs_ptr,  # [B, K + 1, V]
    draft_probs_ptr,  # [B, K, V] (unused without HAS_DRAFT_PROBS)
    draft_ids_ptr,  # [B, K] int64
    num_drafts_ptr,  # [B]
    seeds_ptr,  # [B] int64
    offsets_ptr,  # [B] int64
    out_ptr,  # [B, K + 1] int64
    K,
    V,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_drafts = tl.load(num_drafts_ptr + row).to(tl.int32)
    seed = tl.load(seeds_ptr + row)
    offset = tl.load(offsets_ptr + row)
    p_row = target_probs_ptr + row * (K + 1) * V
    q_row = draft_probs_ptr + row * K * V
    drafts = draft_ids_ptr + row * K

    # Walk the drafts until the first rejection. The sums and the draft token of the last position
    # visited stay in the loop variables: at a rejection they are what the residual needs.
    num_accepted = tl.full((), 0, tl.int32)
    rejected = tl.full((), 0, tl.int1)
    draft_token = tl.full((), -1, tl.int32)
    p_sum = tl.full((), 1.0, tl.float32)
    q_sum = tl.full((), 1.0, tl.float32)
    while (num_accepted < num_drafts) & (rejected == 0):
        position = num_accepted
        draft_token = tl.load(drafts + position).to(tl.int32)
        p_sum, q_sum = _row_sums(p_row + position * V, q_row + position * V, V, HAS_DRAFT_PROBS, BLOCK_V)
        p_draft = tl.load(p_row + position * V + draft_token).to(tl.float32)
        if HAS_DRAFT_PROBS:
            q_draft = tl.load(q_row + position * V + draft_token).to(tl.float32)
        else:
            q_draft = tl.full((), 1.0, tl.float32)
        u = uniform(seed, offset + position, V)
        accept = u * q_draft * p_sum < p_draft * q_sum
        num_accepted += accept.to(tl.int32)
        rejected = accept == 0

    # The recovered token (after a rejection) or the bonus token (all accepted), at position num_accepted.
    stop = num_accepted
    token = draw_token(
        p_row + stop * V, q_row + stop * V, p_sum, q_sum, 1.0, tl.full((1,), 0, tl.int64) + draft_token,
        rejected.to(tl.int32), seed, offset + stop, V, HAS_DRAFT_PROBS, 1, BLOCK_V,
    )

    cols = tl.arange(0, BLOCK_K)
    accepted_drafts = tl.load(drafts + cols, mask=cols < stop, other=-1)
    out = tl.where(cols < stop, accepted_drafts, tl.where(cols == stop, token.to(tl.int64), -1))
    tl.store(out_ptr + row * (K + 1) + cols, out, mask=cols <= K)


@triton.jit
def _greedy_verify_kernel(
    target_argmax_ptr,  # [B, K + 1] int64
    draft_ids_ptr,  # [B, K] int64
    num_drafts_ptr,  # [B]
    out_ptr,  # [B, K + 1] int64
    K,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_drafts = tl.load(num_drafts_ptr + row).to(tl.int32)
    cols = tl.arange(0, BLOCK_K)
    target = tl.load(target_argmax_ptr + row * (K + 1) + cols, mask=cols <= K, other=-1)
    drafts = tl.load(draft_ids_ptr + row * K + cols, mask=cols < num_drafts, other=-1)
    # Accepted = the drafts before the first mismatch (or before num_drafts).
    stops = (drafts != target) | (cols >= num_drafts)
    num_accepted = tl.min(tl.where(stops, cols, BLOCK_K), axis=0)
    out = tl.where(cols <= num_accepted, target, -1)
    tl.store(out_ptr + row * (K + 1) + cols, out, mask=cols <= K)


# ----------------------------------------------------------------------------------------------------
# Shared argument handling
# ----------------------------------------------------------------------------------------------------


def _num_drafts(num_draft_tokens: torch.Tensor | None, batch: int, k: int, device) -> torch.Tensor:
    if num_draft_tokens is None:
        return torch.full((batch,), k, dtype=torch.int64, device=device)
    return num_draft_tokens.to(device=device, dtype=torch.int64)


def _row_seeds_and_offsets(
    batch: int, device, seed: int | None, seeds: torch.Tensor | None, offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (seed, offset): ``seeds`` if given, else ``seed + b`` (a seed drawn from torch's RNG if None)."""
    if seeds is None:
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        seeds = seed + torch.arange(batch, dtype=torch.int64)
    seeds = seeds.to(device=device, dtype=torch.int64)
    if offsets is None:
        offsets = torch.zeros(batch, dtype=torch.int64, device=device)
    return seeds, offsets.to(device=device, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------
# Rejection sampling
# ----------------------------------------------------------------------------------------------------


def rejection_sample_ref(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, k_plus_1, vocab_size = target_probs.shape
    k = k_plus_1 - 1
    device = target_probs.device
    num_drafts = _num_drafts(num_draft_tokens, batch, k, device)
    seeds, offsets = _row_seeds_and_offsets(batch, device, seed, seeds, offsets)
    rows = torch.arange(batch, device=device)
    p = target_probs.float()

    # Every acceptance decision at once; the row stops at its first rejection.
    positions = torch.arange(k, device=device)
    drafts = draft_token_ids.long().clamp(0, vocab_size - 1)  # entries past num_drafts are ignored
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    p_sum = p[:, :k].sum(-1, dtype=torch.float64).float().clamp_min(_TINY)
    if draft_probs is not None:
        q = draft_probs.float()
        q_draft = q.gather(-1, drafts[..., None])[..., 0]
        q_sum = q.sum(-1, dtype=torch.float64).float().clamp_min(_TINY)
    else:
        q_draft = torch.ones_like(p_draft)
        q_sum = torch.ones_like(p_sum)
    u = uniform_ref(seeds[:, None], offsets[:, None] + positions, vocab_size)
    accept = (u * q_draft * p_sum < p_draft * q_sum) & (positions < num_drafts[:, None])
    num_accepted = accept.long().cumprod(-1).sum(-1)
    rejected = num_accepted < num_drafts

    # One draw per row at its stop position: the residual after a rejection, p_n for the bonus.
    stop = num_accepted
    exponential = exponentials_ref(seeds, offsets + stop, vocab_size)
    p_stop = p[rows, stop]
    p_score = p_stop / exponential
    token = p_score.argmax(-1)
    if k > 0:
        at = stop.clamp(max=k - 1)  # rows that were not rejected do not use the residual
        if draft_probs is not None:
            q_stop = q[rows, at]
        else:
            q_stop = torch.nn.functional.one_hot(drafts[rows, at], vocab_size).float()
        residual = (p_stop / p_sum[rows, at, None] - q_stop / q_sum[rows, at, None]).clamp_min(0.0)
        residual_score = residual / exponential
        residual_token = residual_score.argmax(-1)
        has_mass = residual_score.gather(-1, residual_token[:, None])[:, 0] > 0
        token = torch.where(rejected & has_mass, residual_token, token)

    cols = torch.arange(k + 1, device=device)
    out = torch.full((batch, k + 1), -1, dtype=torch.int64, device=device)
    out[:, :k] = torch.where(cols[:k] < stop[:, None], draft_token_ids.long(), -1)
    out[rows, stop] = token
    return out


def rejection_sample_triton(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, k_plus_1, vocab_size = target_probs.shape
    k = k_plus_1 - 1
    device = target_probs.device
    num_drafts = _num_drafts(num_draft_tokens, batch, k, device)
    seeds, offsets = _row_seeds_and_offsets(batch, device, seed, seeds, offsets)
    out = torch.empty((batch, k + 1), dtype=torch.int64, device=device)
    if batch == 0:
        return out
    target_probs = target_probs.contiguous()
    draft_token_ids = draft_token_ids.to(torch.int64).contiguous()
    has_draft_probs = draft_probs is not None
    draft_probs = draft_probs.contiguous() if has_draft_probs else target_probs
    block_v = min(triton.next_power_of_2(vocab_size), 2048)
    _rejection_sample_kernel[(batch,)](
        target_probs,
        draft_probs,
        draft_token_ids,
        num_drafts,
        seeds,
        offsets,
        out,
        k,
        vocab_size,
        HAS_DRAFT_PROBS=has_draft_probs,
        BLOCK_K=triton.next_power_of_2(k + 1),
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return out


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify ``draft_token_ids [B, k]`` against ``target_probs [B, k+1, V]``: ``[B, k+1]`` tokens, -1 padded."""
    verify = rejection_sample_triton if use_triton(target_probs) else rejection_sample_ref
    return verify(
        target_probs,
        draft_token_ids,
        draft_probs,
        seed=seed,
        num_draft_tokens=num_draft_tokens,
        seeds=seeds,
        offsets=offsets,
    )


# ----------------------------------------------------------------------------------------------------
# Greedy verification
# ----------------------------------------------------------------------------------------------------


def greedy_verify_ref(
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, k_plus_1 = target_argmax.shape
    k = k_plus_1 - 1
    num_drafts = _num_drafts(num_draft_tokens, batch, k, target_argmax.device)
    cols = torch.arange(k + 1, device=target_argmax.device)
    matches = (draft_token_ids.long() == target_argmax[:, :k]) & (cols[:k] < num_drafts[:, None])
    num_accepted = matches.long().cumprod(-1).sum(-1)
    return torch.where(cols <= num_accepted[:, None], target_argmax.long(), -1)


def greedy_verify_triton(
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, k_plus_1 = target_argmax.shape
    k = k_plus_1 - 1
    num_drafts = _num_drafts(num_draft_tokens, batch, k, target_argmax.device)
    out = torch.empty((batch, k + 1), dtype=torch.int64, device=target_argmax.device)
    if batch > 0:
        _greedy_verify_kernel[(batch,)](
            target_argmax.to(torch.int64).contiguous(),
            draft_token_ids.to(torch.int64).contiguous(),
            num_drafts,
            out,
            k,
            BLOCK_K=triton.next_power_of_2(k + 1),
            num_warps=1,
        )
    return out


def greedy_verify(
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Accept drafts while they equal ``target_argmax``; then its token at the first mismatch (or the bonus)."""
    verify = greedy_verify_triton if use_triton(target_argmax) else greedy_verify_ref
    return verify(target_argmax, draft_token_ids, num_draft_tokens)
