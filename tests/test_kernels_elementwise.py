"""RMSNorm, RoPE, SiLU-and-mul and the paged KV store/copy: references against HF transformers and
hand-written loops, Triton kernels (interpreted on CPU, compiled on CUDA) against the references, on the test
device. The RoPE tables are built on the CPU and checked against HF's there (host code, no kernel)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nanospec.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from nanospec.kernels.backend import backend
from nanospec.kernels.kv_store import copy_kv_slots_ref, copy_kv_slots_triton, store_kv_ref, store_kv_triton
from nanospec.kernels.rmsnorm import rms_norm, rms_norm_ref, rms_norm_triton
from nanospec.kernels.rope import apply_rope_ref, build_rope_cache, rope_inv_freq

# Tolerances of a Triton kernel (fp32 math, one rounding) against its reference, on either device. fp32: the two
# differ in the order of operations and, compiled on CUDA, in fused multiply-adds and the hardware's exp2 / rsqrt
# approximations: ~1e-6 relative at these magnitudes, so 1e-5. fp16 / bf16: the output's rounding to the half type
# (2^-11 / 2^-8 relative, on both sides); bf16 is loose also because the interpreter truncates fp32 -> bf16 where
# the reference rounds (compiled kernels round).
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = list(TOLERANCE)


# ----------------------------------------------------------------------------------------------
# RMSNorm


def test_rms_norm_ref_matches_hf(device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf_norm = LlamaRMSNorm(576, eps=1e-5).to(device)
    torch.nn.init.normal_(hf_norm.weight)
    x = torch.randn(7, 576, device=device)
    torch.testing.assert_close(rms_norm_ref(x, hf_norm.weight, 1e-5), hf_norm(x))


@pytest.mark.parametrize("num_tokens, hidden_size", [(0, 576), (1, 576), (5, 37), (300, 576)])
def test_rms_norm_ref_is_bit_for_bit_torchs_on_a_cpu(num_tokens, hidden_size):
    """The reference writes out F.rms_norm's CPU ops: the same bits, also through a bfloat16 output and a
    residual."""
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden_size, generator=generator) * 30
    residual = torch.randn(num_tokens, hidden_size, generator=generator).to(torch.bfloat16)
    weight = torch.randn(hidden_size, generator=generator)
    assert torch.equal(rms_norm_ref(x, weight, 1e-5), F.rms_norm(x, (hidden_size,), weight, 1e-5))
    out, summed = rms_norm_ref(residual, weight, 1e-6, residual=x, out_dtype=torch.bfloat16)
    assert torch.equal(out, F.rms_norm(residual + x, (hidden_size,), weight, 1e-6).to(torch.bfloat16))
    assert torch.equal(summed, residual + x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [1, 37, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton_matches_ref(device, dtype, hidden_size, with_residual):
    x = torch.randn(5, hidden_size, device=device).to(dtype)
    weight = torch.randn(hidden_size, device=device).to(dtype)
    residual = torch.randn(5, hidden_size, device=device).to(dtype) if with_residual else None
    expected = rms_norm_ref(x, weight, 1e-6, residual)
    got = rms_norm_triton(x, weight, 1e-6, residual)
    if with_residual:
        torch.testing.assert_close(got[1], expected[1], **TOLERANCE[dtype])
        expected, got = expected[0], got[0]
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_rms_norm_fused_residual_is_add_then_norm(device):
    x, residual = torch.randn(3, 40, device=device), torch.randn(3, 40, device=device)
    weight = torch.rand(40, device=device)
    out, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, rms_norm_ref(x + residual, weight, 1e-5))


def test_rms_norm_triton_strided_rows_and_empty(device):
    wide = torch.randn(4, 100, device=device)
    x = wide[:, 10:70]  # rows 100 apart
    weight = torch.randn(60, device=device)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))

    empty = torch.empty(0, 60, device=device)
    assert rms_norm_triton(empty, weight, 1e-5).shape == (0, 60)
    out, new_residual = rms_norm_triton(empty, weight, 1e-5, empty)
    assert out.shape == new_residual.shape == (0, 60)


def test_rms_norm_dispatch(device, triton_backend):
    x, weight = torch.randn(2, 16, device=device, dtype=torch.bfloat16), torch.ones(16, device=device)
    assert torch.equal(rms_norm(x, weight, 1e-5), rms_norm_triton(x, weight, 1e-5))
    with backend("torch"):
        assert torch.equal(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a process with a CUDA GPU imports Triton to run its kernels")
def test_a_cpu_process_without_the_interpreter_never_imports_triton():
    """Where no kernel can launch (no GPU, no TRITON_INTERPRET=1), the engine runs without importing Triton (about
    70 MB resident), its ops run their torch paths, and a Triton kernel asked for says what it needs."""
    code = """
import sys, torch
from nanospec.kernels.rmsnorm import rms_norm, rms_norm_triton
import nanospec.llm, nanospec.engine, nanospec.kernels.paged_attention, nanospec.kernels.tree_rejection
x = torch.randn(2, 16)
rms_norm(x, torch.ones(16), 1e-5)
assert "triton" not in sys.modules, "triton was imported"
try:
    rms_norm_triton(x, torch.ones(16), 1e-5)
except RuntimeError as error:
    print(error)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Triton kernels run on a CUDA GPU, or on a CPU with TRITON_INTERPRET=1" in result.stdout


# ----------------------------------------------------------------------------------------------
# RoPE

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_config(head_dim, theta, rope_scaling):
    from transformers import LlamaConfig

    rope_parameters = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta}
    return LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )


@pytest.mark.parametrize(
    "head_dim, theta, rope_scaling",
    [
        (64, 100000.0, None),
        (128, 500000.0, LLAMA3_SCALING),
        (64, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    ],
)
def test_rope_cache_matches_hf(head_dim, theta, rope_scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _hf_config(head_dim, theta, rope_scaling)
    if rope_scaling is not None:
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, "cpu")
        torch.testing.assert_close(rope_inv_freq(head_dim, theta, rope_scaling), hf_inv_freq, atol=0, rtol=0)

    cache = build_rope_cache(head_dim, 300, theta, rope_scaling)
    assert cache.shape == (300, head_dim) and cache.dtype == torch.float32
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(cache, torch.arange(300)[None])
    half = head_dim // 2
    torch.testing.assert_close(cache[:, :half], hf_cos[0, :, :half])
    torch.testing.assert_close(cache[:, half:], hf_sin[0, :, :half])


def test_rope_scaling_keys_and_errors():
    plain = rope_inv_freq(64, 10000.0)
    assert torch.equal(rope_inv_freq(64, 10000.0, {"rope_type": "default"}), plain)
    legacy_key = {**LLAMA3_SCALING, "type": "llama3"}
    del legacy_key["rope_type"]
    assert torch.equal(rope_inv_freq(64, 500000.0, legacy_key), rope_inv_freq(64, 500000.0, LLAMA3_SCALING))
    assert torch.equal(rope_inv_freq(64, 10000.0, {"type": "linear", "factor": 2.0}), plain / 2)
    with pytest.raises(ValueError, match="yarn"):
        build_rope_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def _fused_qkv_views(num_tokens, q_heads, kv_heads, head_dim, dtype, device):
    """q and k as the strided views a fused qkv projection gives."""
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(num_tokens, q_heads, head_dim), k.view(num_tokens, kv_heads, head_dim)


def test_apply_rope_ref_matches_hf(device):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _fused_qkv_views(6, 9, 3, 64, torch.float32, device)
    cache = build_rope_cache(64, 50, 100000.0, device=device)
    positions = torch.tensor([0, 1, 2, 17, 31, 49], device=device)
    cos, sin = cache[positions, :32], cache[positions, 32:]
    cos, sin = torch.cat((cos, cos), dim=-1)[None], torch.cat((sin, sin), dim=-1)[None]
    # HF wants [batch, heads, tokens, head_dim]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = apply_rope_ref(q, k, positions, cache)
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(k_out, hf_k[0].transpose(0, 1))


# ----------------------------------------------------------------------------------------------
# SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, ffn_size", [(0, 37), (3, 37), (2, 1536), (1, 2100)])
def test_silu_and_mul_triton_matches_ref(device, dtype, num_tokens, ffn_size):
    x = (3 * torch.randn(num_tokens, 2 * ffn_size, device=device)).to(dtype)
    expected = silu_and_mul_ref(x)
    got = silu_and_mul_triton(x)
    assert got.shape == (num_tokens, ffn_size) and got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_silu_and_mul_ref_is_silu_times_up(device):
    x = torch.randn(4, 74, device=device)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(x[:, :37]) * x[:, 37:])


# ----------------------------------------------------------------------------------------------
# Paged KV store and slot copies

NUM_KV_HEADS, HEAD_DIM = 3, 8


def _caches(block_size, dtype, device, num_blocks=6):
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)


def _fused_kv_views(num_tokens, dtype, device):
    """k and v as strided views of a fused qkv projection (2 q heads in front)."""
    width = HEAD_DIM * NUM_KV_HEADS
    qkv = torch.randn(num_tokens, 2 * HEAD_DIM + 2 * width, device=device).to(dtype)
    _, k, v = qkv.split([2 * HEAD_DIM, width, width], dim=-1)
    return k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM), v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)


STORE_KV_IMPLS = [store_kv_ref, store_kv_triton]
COPY_KV_IMPLS = [copy_kv_slots_ref, copy_kv_slots_triton]


@pytest.mark.parametrize("store", STORE_KV_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
def test_store_kv(device, store, dtype, block_size):
    k_cache, v_cache = _caches(block_size, dtype, device)
    k, v = _fused_kv_views(9, dtype, device)
    # Two sequences' new tokens in non-consecutive blocks, crossing block boundaries, plus padding.
    first = 2 * block_size - 2
    slots = [first, first + 1, first + 2, first + 3, -1, 5 * block_size - 1, 1, 2, -1]
    slot_mapping = torch.tensor(slots, device=device)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = k[token]
            expected_v[slot // block_size, slot % block_size] = v[token]
    store(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("store", STORE_KV_IMPLS)
def test_store_kv_empty(device, store):
    k_cache, v_cache = _caches(4, torch.float32, device)
    before = k_cache.clone()
    k, v = _fused_kv_views(0, torch.float32, device)
    store(k, v, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("copy", COPY_KV_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize(
    "src, dst",
    [
        ([3, 5, 6, 9, 17], [3, 4, 5, 6, 7]),  # compact a tree path: dst 5, 6 are sources of others
        ([1, 2, 14], [2, 1, 22]),  # a swap plus a move into another block
    ],
)
def test_copy_kv_slots_reads_before_writes(device, copy, dtype, block_size, src, dst):
    k_cache, v_cache = _caches(block_size, dtype, device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for s, d in zip(src, dst):
        expected_k[d // block_size, d % block_size] = k_cache[s // block_size, s % block_size]
        expected_v[d // block_size, d % block_size] = v_cache[s // block_size, s % block_size]
    src_slots = torch.tensor(src, device=device)
    dst_slots = torch.tensor(dst, device=device)
    copy(k_cache, v_cache, src_slots, dst_slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("copy", COPY_KV_IMPLS)
def test_copy_kv_slots_empty(device, copy):
    k_cache, v_cache = _caches(4, torch.float32, device)
    before = v_cache.clone()
    no_slots = torch.empty(0, dtype=torch.int64, device=device)
    copy(k_cache, v_cache, no_slots, no_slots)
    assert torch.equal(v_cache, before)
