"""Bitmasks of which new tokens of a sequence each new token may attend to (the cached context is always visible).

A mask over ``q`` new tokens is int64 ``[q, ceil(q / 64)]``: ``visible(i, b) = (words[i, b // 64] >> (b % 64)) & 1``.
Bit 63 is the sign bit: packing sums disjoint powers of two and unpacking shifts arithmetically, so it round-trips.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 64
_BIT_VALUES = torch.ones(BITS_PER_WORD, dtype=torch.int64) << torch.arange(BITS_PER_WORD, dtype=torch.int64)


def num_words(num_tokens: int) -> int:
    """Words per mask row for ``num_tokens`` new tokens."""
    return (num_tokens + BITS_PER_WORD - 1) // BITS_PER_WORD


def pack_mask(dense: torch.Tensor) -> torch.Tensor:
    """Bool ``[rows, n]`` -> int64 ``[rows, ceil(n / 64)]``: bit ``b`` of a row is ``dense[row, b]``."""
    rows, n = dense.shape
    words = num_words(n)
    padded = torch.zeros(rows, words * BITS_PER_WORD, dtype=torch.int64, device=dense.device)
    padded[:, :n] = dense.to(torch.int64)
    return (padded.view(rows, words, BITS_PER_WORD) * _BIT_VALUES.to(dense.device)).sum(dim=-1)


def unpack_mask(words: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[rows, W]`` -> Bool ``[rows, n]`` (the inverse of :func:`pack_mask` for ``n <= 64 * W``)."""
    bits = torch.arange(n, device=words.device)
    selected = words[:, bits // BITS_PER_WORD]
    return ((selected >> (bits % BITS_PER_WORD)) & 1).bool()


def causal_mask(q_len: int) -> torch.Tensor:
    """Each of ``q_len`` new tokens sees itself and the new tokens before it."""
    return pack_mask(torch.ones(q_len, q_len, dtype=torch.bool).tril())


def concat_masks(masks: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence masks ``[q_i, W_i]`` -> one ``[sum q_i, max W_i]`` (rows in order, zero-padded words)."""
    if not masks:
        return torch.zeros(0, 0, dtype=torch.int64)
    width = max(m.shape[1] for m in masks)
    return torch.cat([torch.nn.functional.pad(m.to(torch.int64), (0, width - m.shape[1])) for m in masks])
