"""The fused RoPE + KV write: the Triton kernel (interpreted on CPU) against its reference (apply_rope_ref then
store_kv_ref), over odd head counts and sizes, padding tokens, slots at block edges, and empty batches."""

import pytest
import torch

from nanospec.kernels.backend import backend
from nanospec.kernels.rope import apply_rope_ref, build_rope_cache
from nanospec.kernels.rope_store_kv import rope_store_kv, rope_store_kv_ref, rope_store_kv_triton

# fp32 math and one rounding in both; bf16 loose because the interpreter truncates fp32 -> bf16 where torch rounds
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(num_tokens, q_heads, kv_heads, head_dim, block_size, dtype, device, num_blocks=4):
    """q, k, v as strided views of one fused qkv projection; caches filled with noise (so untouched slots show)."""
    gen = torch.Generator().manual_seed(num_tokens * 31 + head_dim)
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(device=device, dtype=dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return (q.view(num_tokens, q_heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
            v.view(num_tokens, kv_heads, head_dim), k_cache, v_cache)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (5, 1, 10, 4), (3, 3, 6, 2)])
def test_fused_matches_rope_then_store(device, dtype, q_heads, kv_heads, head_dim, block_size):
    num_tokens = 7
    q, k, v, k_cache, v_cache = _inputs(num_tokens, q_heads, kv_heads, head_dim, block_size, dtype, device)
    last = 4 * block_size - 1
    # distinct slots: the first and last of the pool and both sides of block edges; two padding tokens
    slots = torch.tensor([0, block_size - 1, -1, block_size, last, -1, 2 * block_size - 1], device=device)
    assert len(set(slots.tolist()) - {-1}) == 5
    positions = torch.tensor([0, 5, 63, 7, 8, 1, 40], device=device)
    cos_sin = build_rope_cache(head_dim, 64, 10000.0, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = rope_store_kv_ref(q, k, v, positions, cos_sin, expected_k, expected_v, slots)
    got_q = rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert got_q.dtype == dtype and got_q.is_contiguous()
    torch.testing.assert_close(got_q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache, expected_k, **TOLERANCE[dtype])  # every slot: written ones and the rest
    assert torch.equal(v_cache, expected_v)  # v is copied, not computed

    # and the reference is what it says: the rotated k in the real tokens' slots, v beside it, the rest untouched
    rotated_q, rotated_k = apply_rope_ref(q, k, positions, cos_sin)
    flat_k, flat_v = expected_k.view(-1, kv_heads, head_dim), expected_v.view(-1, kv_heads, head_dim)
    real = slots >= 0
    torch.testing.assert_close(flat_k[slots[real]], rotated_k[real], atol=0, rtol=0)
    assert torch.equal(flat_v[slots[real]], v[real])
    assert torch.equal(expected_q, rotated_q)


def test_fused_empty_batch(device):
    q, k, v, k_cache, v_cache = _inputs(0, 4, 2, 16, 4, torch.float32, device)
    before = k_cache.clone()
    cos_sin = build_rope_cache(16, 8, 10000.0, device=device)
    none = torch.empty(0, dtype=torch.int64, device=device)
    assert rope_store_kv_triton(q, k, v, none, cos_sin, k_cache, v_cache, none).shape == (0, 4, 16)
    assert torch.equal(k_cache, before)


def test_dispatch_runs_the_kernel_under_the_triton_backend(device):
    q, k, v, k_cache, v_cache = _inputs(3, 2, 1, 8, 4, torch.float32, device)
    cos_sin = build_rope_cache(8, 8, 10000.0, device=device)
    positions, slots = torch.tensor([1, 2, 3], device=device), torch.tensor([5, -1, 9], device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = rope_store_kv_ref(q, k, v, positions, cos_sin, ref_k, ref_v, slots)
    with backend("triton"):
        got = rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(k_cache, ref_k, **TOLERANCE[torch.float32])
