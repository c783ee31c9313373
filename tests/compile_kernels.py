"""Compile every Triton kernel of ``nanospec.kernels`` for a GPU, on a machine without one.

    python tests/compile_kernels.py            # for sm_90 (H100, H200)
    python tests/compile_kernels.py 80         # for sm_80 (A100)

The interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, not Triton's compiler: a type that differs between
the branches of an ``if``, an op the GPU lacks, or too much shared memory shows only when the kernel is compiled. Here
each op's ``<op>_triton`` launcher runs on small CPU tensors with GPU-like shapes and dtypes (SmolLM2-135M's: 9 query
heads, 3 KV heads, head dim 64, vocabulary 49152), and each launch is compiled (Triton's frontend, LLVM and ``ptxas``,
all shipped in Triton's wheel) instead of run. Prints one line per compiled kernel variant; any error ends the script
with a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("unset TRITON_INTERPRET: this script compiles the kernels instead of interpreting them")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# nanospec.kernels.backend imports Triton itself where CUDA is available; launchers that pick a GPU variant by
# ``tensor.is_cuda`` (paged attention's tensor-core dots) pick it here too
torch.cuda.is_available = lambda: True
torch.Tensor.is_cuda = property(lambda self: True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

COMPILED: list[str] = []


class _Target:
    """Triton's active driver, reduced to what compiling needs: the GPU to compile for."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes a block may use, per compute capability


def _compile_only(run, capability: int):
    """``JITFunction.run`` compiling the launch's variant (``warmup``) instead of running it, and checking that its
    shared memory fits the GPU (a kernel over the limit compiles, then fails at launch)."""
    limit = SHARED_MEMORY.get(capability, min(SHARED_MEMORY.values()))

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        shared = kernel.metadata.shared
        if shared > limit:
            raise RuntimeError(f"{self.fn.__name__} needs {shared} B of shared memory; sm_{capability} has {limit}")
        COMPILED.append(f"{self.fn.__name__}: {shared} B shared memory, {kernel.metadata.num_warps} warps")
        return kernel
    return compile_instead


def launch_every_op() -> None:
    from nanospec.kernels.activation import silu_and_mul_triton
    from nanospec.kernels.kv_store import copy_kv_slots_triton, store_kv_triton
    from nanospec.kernels.paged_attention import paged_attention_triton
    from nanospec.kernels.quantized_matmul import quantized_matmul_triton
    from nanospec.kernels.rmsnorm import rms_norm_triton
    from nanospec.kernels.rope import build_rope_cache
    from nanospec.kernels.rope_store_kv import rope_store_kv_triton
    from nanospec.kernels.sampling import probs_from_logits_triton, sample_from_probs_triton
    from nanospec.kernels.tree_rejection import tree_rejection_sample_triton
    from nanospec.kernels.tree_verify import greedy_tree_verify_triton

    hidden, heads, kv_heads, head_dim, ffn, vocab, block_size = 576, 9, 3, 64, 1536, 49152, 16
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4, hidden, dtype=dtype)
        silu_and_mul_triton(torch.randn(4, 2 * ffn, dtype=dtype))
        rms_norm_triton(x, torch.ones(hidden, dtype=dtype), 1e-5)
        rms_norm_triton(x, torch.ones(hidden, dtype=dtype), 1e-5, residual=x.clone(), out_dtype=torch.bfloat16)

        tokens, num_blocks = 5, 4
        k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q = torch.randn(tokens, heads, head_dim, dtype=dtype)
        k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
        v = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
        slots = torch.tensor([20, 21, 22, 23, -1])
        rope_store_kv_triton(q, k, v, torch.arange(tokens), build_rope_cache(head_dim, 64, 10000.0), k_cache, v_cache,
                             slots)
        store_kv_triton(k, v, k_cache, v_cache, slots)
        copy_kv_slots_triton(k_cache, v_cache, torch.tensor([20, 21]), torch.tensor([40, 41]))

        block_tables = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]], dtype=torch.int32)
        for max_query_len, query_start_loc, tree_mask in ((1, [0, 1, 2], None), (4, [0, 4, 5], None),
                                                           (4, [0, 4, 5], torch.tensor([[1], [3], [5], [9], [1]]))):
            paged_attention_triton(q, k_cache, v_cache, block_tables, torch.tensor([24, 30]),
                                   torch.tensor(query_start_loc, dtype=torch.int32), head_dim ** -0.5, max_query_len,
                                   tree_mask)

    for rows in (1, 64):  # the few-rows launch shape (decode, verify) and the tiled one (prefill)
        for x_dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, hidden, dtype=x_dtype)
            q4 = torch.randint(0, 255, (ffn, hidden // 2), dtype=torch.uint8)
            for group in (32, 128):
                scale = torch.rand(ffn, hidden // group, dtype=torch.bfloat16)
                quantized_matmul_triton(x, q4, scale, scale.clone(), group, bits=4)
            q8 = torch.randint(-127, 127, (ffn, hidden), dtype=torch.int8)
            quantized_matmul_triton(x, q8, torch.rand(ffn, 1, dtype=torch.bfloat16), None, hidden, bits=8)

    logits = torch.randn(3, vocab)
    ones = torch.ones(3)
    probs = probs_from_logits_triton(logits, ones, torch.tensor([0, 50, 0]), torch.tensor([1.0, 0.9, 0.5]),
                                     torch.tensor([0.0, 0.0, 0.1]))
    sample_from_probs_triton(probs, torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.int64))

    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    node_tokens = torch.randint(0, vocab, (2, 4))
    greedy_tree_verify_triton(torch.randint(0, vocab, (2, 4)), node_tokens, parents, torch.tensor([4, 3]))
    tree_rejection_sample_triton(torch.rand(2, 4, vocab), node_tokens, parents, torch.tensor([4, 3]),
                                 torch.rand(2, 4, vocab), seeds=torch.tensor([1, 2]), offsets=torch.tensor([0, 0]))


def main() -> None:
    capability = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    driver.set_active(_Target(capability))
    JITFunction.run = _compile_only(JITFunction.run, capability)
    launch_every_op()
    print(f"sm_{capability}: {len(COMPILED)} launches compiled, {len(set(COMPILED))} kinds")
    for line in sorted(set(COMPILED)):
        print("  " + line)


if __name__ == "__main__":
    main()
