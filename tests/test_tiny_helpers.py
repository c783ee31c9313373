"""The comparison helpers of tests/tiny.py catch what they must: a token that differs where there is no near tie,
K/V in a wrong slot or at a wrong position. (Their tolerances would otherwise be untested.) CPU only: host-side
checks on hand-made tensors, no kernel."""

import pytest
import torch

from tiny import KV_TOLERANCE, NEAR_TIE, assert_same_kv, assert_same_tokens_up_to_a_near_tie


def test_tokens_may_part_only_at_a_near_tie():
    logits = torch.zeros(4, 10)
    logits[:, 3] = 1.0  # token 3 wins everywhere by 1.0...
    logits[2, 7] = 1.0 - NEAR_TIE / 4  # ...except at index 2, where 7 is within a near tie of it
    rows = lambda i: logits[i]  # noqa: E731
    assert assert_same_tokens_up_to_a_near_tie([3, 3, 3, 3], [3, 3, 3, 3], rows) == 4
    assert assert_same_tokens_up_to_a_near_tie([3, 3, 7, 1], [3, 3, 3, 3], rows) == 2  # nothing compared past it
    with pytest.raises(AssertionError, match="no near tie"):
        assert_same_tokens_up_to_a_near_tie([3, 5, 3, 3], [3, 3, 3, 3], rows)
    with pytest.raises(AssertionError, match="no near tie"):  # a near tie between two tokens, neither of them
        assert_same_tokens_up_to_a_near_tie([3, 3, 1, 3], [3, 3, 7, 3], rows)


class _Cache:
    """A KV cache stand-in: one layer, K and V ``[num_blocks, block_size, heads, head_dim]``."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def layer(self, layer):
        return self.k, self.v


def test_same_kv_tolerates_rounding_and_nothing_like_a_bug():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 8, 16, 2, 8, generator=gen)  # 16 slots of 2 heads x 8
    cache = _Cache(k, v)
    slots, copies = list(range(8)), list(range(8, 16))
    for t in (k, v):  # the copies: the first 8 slots plus fp32 rounding noise
        flat = t.view(-1, 2, 8)
        flat[copies] = flat[slots] * (1 + 1e-7 * torch.randn(8, 2, 8, generator=gen))
    assert_same_kv(cache, 1, slots, copies)
    with pytest.raises(AssertionError):  # a wrong slot
        assert_same_kv(cache, 1, slots, copies[:3] + [copies[4], copies[3]] + copies[5:])
    tol = KV_TOLERANCE["cpu"]["atol"]
    k.view(-1, 2, 8)[copies[5]] += 50 * tol  # one value off by far less than any real bug, far more than rounding
    with pytest.raises(AssertionError):
        assert_same_kv(cache, 1, slots, copies)
