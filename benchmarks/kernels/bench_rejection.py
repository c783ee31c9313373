"""Micro-benchmark of speculative verification: the Triton kernels against the PyTorch reference.

    PYTHONPATH=. python benchmarks/kernels/bench_rejection.py

rejection_sample (with draft probabilities, and one-hot drafts) and greedy_verify at the SmolLM2-135M
(V = 49152) and Llama-3.2-1B (V = 128256) vocabularies, k = 5 drafts, batch 1 to 64. The target and draft
rows are softmaxes of random logits shifted towards each other, so a realistic share of drafts is
accepted. Prints microseconds per call (triton.testing.do_bench, median), the speedup, the mean number
of tokens emitted per row, and how many rows differ between the kernel and the reference (they are
meant to agree token for token). Needs a CUDA GPU.
"""

from __future__ import annotations

import sys

import torch

VOCABS = {"SmolLM2-135M": 49152, "Llama-3.2-1B": 128256}
BATCHES = [1, 8, 64]
NUM_DRAFTS = 5


def problem(batch: int, vocab_size: int, device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(0)
    shared = torch.randn(batch, NUM_DRAFTS + 1, vocab_size, device=device, generator=gen) * 4
    target_logits = shared + 0.3 * torch.randn(shared.shape, device=device, generator=gen)
    draft_logits = shared + 0.3 * torch.randn(shared.shape, device=device, generator=gen)
    target_probs = torch.softmax(target_logits, dim=-1)
    draft_probs = torch.softmax(draft_logits[:, :NUM_DRAFTS], dim=-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=gen).reshape(batch, NUM_DRAFTS)
    return target_probs, draft_probs, drafts


def main():
    if not torch.cuda.is_available():
        print("bench_rejection: needs a CUDA GPU (Triton kernels are only interpreted on CPU); skipping.")
        return 0

    from triton.testing import do_bench

    from nanospec.kernels.rejection import (
        greedy_verify_ref,
        greedy_verify_triton,
        rejection_sample_ref,
        rejection_sample_triton,
    )

    print(f"{torch.cuda.get_device_name()}  k={NUM_DRAFTS}")
    header = ("model", "op", "batch", "triton us", "torch us", "speedup", "tokens/row", "rows differ")
    print("{:<14} {:<18} {:>6} {:>10} {:>10} {:>8} {:>11} {:>12}".format(*header))
    for model, vocab_size in VOCABS.items():
        for batch in BATCHES:
            target_probs, draft_probs, drafts = problem(batch, vocab_size)
            seeds = torch.arange(batch, device="cuda") + 1000
            offsets = torch.full((batch,), 37, device="cuda")
            target_argmax = target_probs.argmax(-1)
            cases = {
                "rejection (q)": (rejection_sample_triton, rejection_sample_ref,
                                  (target_probs, drafts, draft_probs), dict(seeds=seeds, offsets=offsets)),
                "rejection one-hot": (rejection_sample_triton, rejection_sample_ref,
                                      (target_probs, drafts, None), dict(seeds=seeds, offsets=offsets)),
                "greedy_verify": (greedy_verify_triton, greedy_verify_ref, (target_argmax, drafts), {}),
            }
            for op, (triton_fn, ref_fn, args, kwargs) in cases.items():
                got, expected = triton_fn(*args, **kwargs), ref_fn(*args, **kwargs)
                rows_differ = (got != expected).any(-1).sum().item()
                tokens_per_row = (got >= 0).sum().item() / batch
                triton_ms = do_bench(lambda: triton_fn(*args, **kwargs))
                ref_ms = do_bench(lambda: ref_fn(*args, **kwargs))
                print(f"{model:<14} {op:<18} {batch:>6} {triton_ms * 1e3:>10.1f} {ref_ms * 1e3:>10.1f} "
                      f"{ref_ms / triton_ms:>7.2f}x {tokens_per_row:>11.2f} {rows_differ:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
