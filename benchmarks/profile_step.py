"""Where a batch-1 decode step's time goes: the engine's step, by part, in wall-clock milliseconds.

    python benchmarks/profile_step.py                         # embedded SmolLM2, its 4-bit weights
    python benchmarks/profile_step.py --quantization none     # the same model in float32
    python benchmarks/profile_step.py --context 2000          # after a 2,000-token prompt
    python benchmarks/profile_step.py --table                 # also torch's profiler table of ops

Greedy decode of one prompt (``--context N``: the benchmark prompts' texts joined, N tokens); after a warm-up,
``--steps`` steps are timed as they run, then as many again with each part's functions timed. A part's time is the
wall time inside its functions, Python included, less the parts called within them:

    matmuls      the layers' weight matmuls (``Int4Linear`` / ``Int8Linear`` / ``Linear``), their input casts included
    head         the logits: the head's matmul and the re-computation of the logits near the top
    attention    softmax(q K^T) V over the paged cache (``PagedAttentionPlan.attend``)
    RoPE, K/V    the rest of a layer's attention: RoPE and the K/V write
    norms        the RMSNorms (residual adds and output casts included)
    SiLU-mul     the MLP's activation
    model, rest  the forward's own Python and ops: the embedding, the per-forward attention plan, the qkv cast
    engine       the step outside the forward and the logits: scheduler, batch, verification, sampling, bookkeeping

The timers add a little to each call (the difference between the two step times, printed).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_chunked_prefill import prompts  # noqa: E402

import nanospec.engine  # noqa: E402
import nanospec.kernels.cpu_attention as cpu_attention  # noqa: E402
import nanospec.model.linear as linear  # noqa: E402
import nanospec.model.llama as llama  # noqa: E402
from nanospec import LLM, SamplingParams  # noqa: E402


class PartTimer:
    """Wall time by part, each call's time less that of the timed calls within it."""

    def __init__(self):
        self.ms = defaultdict(float)
        self.stack: list[list] = []  # [part, the time of timed calls within it so far]

    def wrap(self, part: str, function):
        def timed(*args, **kwargs):
            name = "head" if part == "matmuls" and self.stack and self.stack[-1][0] == "head" else part
            self.stack.append([name, 0.0])
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                _, inner = self.stack.pop()
                self.ms[name] += (elapsed - inner) * 1e3
                if self.stack:
                    self.stack[-1][1] += elapsed
        return timed


def time_parts(timer: PartTimer) -> None:
    """Wraps the step's functions (for the rest of the process) so that ``timer`` times them by part."""
    for cls in (linear.Int4Linear, linear.Int8Linear, linear.Linear):
        cls.__call__ = timer.wrap("matmuls", cls.__call__)
    llama.logits = timer.wrap("head", llama.logits)
    cpu_attention.PagedAttentionPlan.attend = timer.wrap("attention", cpu_attention.PagedAttentionPlan.attend)
    cpu_attention.CpuAttention.__call__ = timer.wrap("RoPE, K/V", cpu_attention.CpuAttention.__call__)
    llama.rms_norm = timer.wrap("norms", llama.rms_norm)
    llama.silu_and_mul = timer.wrap("SiLU-mul", llama.silu_and_mul)
    llama.Llama.forward = timer.wrap("model, rest", llama.Llama.forward)
    nanospec.engine.Engine.step = timer.wrap("engine", nanospec.engine.Engine.step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="auto", help="auto, int4, int8 or none (float32 weights)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--context", type=int, default=None, help="a prompt of this many tokens (default: one sentence)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--table", action="store_true", help="also print the profiler's table of ops")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(quantization=None if args.quantization == "none" else args.quantization, dtype="float32",
              device="cpu", max_num_seqs=1, max_model_len=max(2048, (args.context or 0) + 3 * args.steps + 16))
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    if args.context:
        prompt = prompts(llm.tokenizer, args.context)[1]
    engine = llm.engine
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
    request = engine.add_request(llm._encode(prompt, True), SamplingParams(temperature=0, max_tokens=3 * args.steps + 8,
                                                                     ignore_eos=True))
    while engine.sequences[request].num_output_tokens < 4:  # the prefill (a chunk a step) and the first decodes
        engine.step()
    wall = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - wall) / args.steps * 1e3
    timer = PartTimer()
    time_parts(timer)
    timed_wall = time.perf_counter()
    for _ in range(args.steps):  # the same request's next steps
        engine.step()
    timed_wall = (time.perf_counter() - timed_wall) / args.steps * 1e3
    print(f"quantization={llm.model.quantization}, {torch.get_num_threads()} threads: {wall:.2f} ms a decode step "
          f"({timed_wall:.2f} with the parts timed)")
    for part, value in sorted(timer.ms.items(), key=lambda kv: -kv[1]):
        value /= args.steps
        print(f"  {part:12s} {value:6.2f} ms  {100 * value / timed_wall:4.0f}%")
    if args.table:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    while engine.has_unfinished():
        engine.step()

if __name__ == "__main__":
    main()
