"""Kernel launches and device reads per engine step, on the path a GPU runs (the Triton backend).

    python benchmarks/count_launches.py                       # CPU: Triton kernels in the interpreter
    python benchmarks/count_launches.py --device cuda         # a GPU: compiled kernels, same counts

For one decode step at batch 1 (plain) and one verify step of each speculative method, counted in the model's
forwards (target and draft) and in verification, not in host-side batch building:

* **Triton launches**: calls of a ``@triton.jit`` kernel with a grid.
* **torch kernels**: aten ops that launch a kernel on the device (views and allocations excluded). On a GPU a
  cuBLAS matmul may launch more than one kernel; each counts once here.
* **device reads**: ``tolist`` / ``item`` / ``bool`` / ... of a tensor by nanospec's code (on a GPU, each is a
  host-device synchronisation), counted over the whole step.

Without CUDA graphs every launch is a separate call from Python; with them (``enforce_eager=False``, the default
on CUDA) a decode or verify step's target forward is one graph launch holding the same kernels. The kernels are
the same on a CPU (interpreted) and on a GPU, so the counts are too; only the time differs (the interpreter takes
~10 ms per program instance: a SmolLM2 verify step takes seconds here).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--methods", nargs="+", default=["plain", "ngram", "ngram_tree", "draft"])
    p.add_argument("--steps", type=int, default=2, help="steps counted per method (the counts are averaged)")
    args = p.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch
    import triton.runtime.interpreter
    import triton.runtime.jit
    from torch.utils._python_dispatch import TorchDispatchMode

    import nanospec
    from nanospec import LLM, SamplingParams
    from nanospec.kernels.backend import backend
    from nanospec.model.llama import Llama
    from nanospec.speculative import speculator

    package = str(Path(nanospec.__file__).parent)
    counts = collections.Counter()
    counting = [False]

    class TorchKernels(TorchDispatchMode):
        no_kernel = {"empty", "empty_strided", "empty_like", "lift_fresh", "_local_scalar_dense", "set_",
                     "resize_", "is_pinned", "_pin_memory"}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if counting[0] and not func.is_view and name not in self.no_kernel:
                counts["torch kernels"] += 1
                counts[f"  aten.{name}"] += 1
            return func(*args, **(kwargs or {}))

    def counted_region(fn):
        def wrapper(*a, **kw):
            outer = counting[0]
            counting[0] = True
            try:
                return fn(*a, **kw)
            finally:
                counting[0] = outer
        return wrapper

    def counted_launch(run):
        def wrapper(self, *a, **kw):
            outer = counting[0]
            if outer and not kw.get("warmup", False):
                counts["triton launches"] += 1
                counts[f"  triton {getattr(self, '__name__', None) or self.fn.__name__}"] += 1
            counting[0] = False  # what the launcher (or the interpreter) does with torch is not the kernel's
            try:
                return run(self, *a, **kw)
            finally:
                counting[0] = outer
        return wrapper

    reads_names = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")

    @contextlib.contextmanager
    def patched():
        saved = [(Llama, "forward", Llama.forward), (Llama, "compute_logits", Llama.compute_logits),
                 (speculator, "verify", speculator.verify),
                 (triton.runtime.jit.JITFunction, "run", triton.runtime.jit.JITFunction.run),
                 (triton.runtime.interpreter.InterpretedFunction, "run",
                  triton.runtime.interpreter.InterpretedFunction.run)]
        saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in reads_names]
        Llama.forward, Llama.compute_logits = counted_region(Llama.forward), counted_region(Llama.compute_logits)
        speculator.verify = counted_region(speculator.verify)
        for cls in (triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction):
            cls.run = counted_launch(cls.run)

        def read(name, original):
            def wrapper(self, *a, **kw):
                caller = sys._getframe(1).f_code
                if stepping[0] and caller.co_filename.startswith(package) and not caller.co_name.endswith("_ref"):
                    counts["device reads"] += 1
                return original(self, *a, **kw)
            return wrapper
        for n in reads_names:
            setattr(torch.Tensor, n, read(n, getattr(torch.Tensor, n)))
        try:
            with TorchKernels():
                yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    stepping = [False]
    sys.path.insert(0, str(HERE))
    from bench_spec import speculative_config, truncated_draft  # the benchmark's own method settings

    class Settings:  # what bench_spec's speculative_config reads from its arguments (its defaults)
        k, prompt_lookup_max, max_candidates, no_adaptive = {"ngram": 5, "draft": 4}, 4, 3, True
        lookahead_configs = {"lookahead": (5, 4, 5)}
    prompt = ("Summarize: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
              "The quick brown fox")
    print(f"device {args.device}{' (Triton interpreter)' if args.device == 'cpu' else ''}, batch 1, greedy; "
          f"counts per step, averaged over {args.steps} steps after the prefill")
    from nanospec.model.embedded import embedded_model_path
    model_path = Path(args.model) if args.model else embedded_model_path()
    rows = []
    for method in args.methods:
        draft = truncated_draft(model_path, 4) if method.startswith("draft") else None
        config = speculative_config(method, Settings, draft)
        llm = LLM(str(model_path), device=args.device, dtype="float32", speculative_config=config, enforce_eager=True,
                  num_blocks=64)
        counts.clear()
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        with backend("triton"), patched():
            llm.engine.add_request(llm.tokenizer.encode(prompt), params)
            llm.engine.step()  # the prefill, not counted
            counts.clear()
            tokens_before = llm.engine.stats.num_generated_tokens
            stepping[0] = True
            for _ in range(args.steps):
                llm.engine.step()
            stepping[0] = False
        tokens = llm.engine.stats.num_generated_tokens - tokens_before
        rows.append((method, dict(counts), tokens / args.steps))
    for method, c, tokens_per_step in rows:
        launches = c.get("triton launches", 0) + c.get("torch kernels", 0)
        triton_launches = c.get("triton launches", 0) / args.steps
        torch_kernels = c.get("torch kernels", 0) / args.steps
        print(f"\n{method}: {launches / args.steps:.0f} launches per step ({triton_launches:.0f} Triton, "
              f"{torch_kernels:.0f} torch), {tokens_per_step:.1f} tokens per step, "
              f"{launches / args.steps / tokens_per_step:.0f} launches per token, "
              f"{c.get('device reads', 0) / args.steps:.0f} device reads per step")
        for key in sorted(k for k in c if k.startswith("  ")):
            print(f"{key:<40} {c[key] / args.steps:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
