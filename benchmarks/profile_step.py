"""Where a batch-1 decode step's time goes: the engine's step, by part, under torch's profiler.

    python benchmarks/profile_step.py                         # embedded SmolLM2, its 4-bit weights
    python benchmarks/profile_step.py --quantization none     # the same model in float32
    python benchmarks/profile_step.py --context 2000          # after a 2,000-token prompt

Greedy decode of one prompt (``--context N``: the benchmark prompts' texts joined, N tokens); after a warm-up,
``--steps`` steps are profiled. Parts, in ms a step: the matmuls of the layers and of the head (torch ops that read
weights), attention (the CPU backend's ops), norms, RoPE and the K/V write, dtype casts, sampling, the other torch
ops, and Python (the step's wall time less every op's own time: the engine, the scheduler, the model's Python). Each
op's own time is taken under the profiler, and the step's wall time from as many steps of the same request just
before, without it; the profiler adds a little to every op, so the ops' shares are a little high and Python's a
little low.
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

from nanospec import LLM, SamplingParams  # noqa: E402

PARTS = {  # a torch op's name -> the part of the step it belongs to (first match)
    "matmul, int8 (head)": ("_weight_int8pack_mm",),
    "matmul": ("_weight_int4pack_mm", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "mkldnn"),
    "attention": ("bmm", "softmax", "masked_fill", "baddbmm", "scaled_dot_product", "flash_attention"),
    "norms": ("rsqrt", "aten::pow", "aten::mean", "rms_norm"),
    "rope, K/V write": ("index_copy", "index_put", "aten::neg", "aten::cos", "aten::sin"),
    "casts": ("aten::to", "aten::_to_copy", "aten::copy_"),
    "sampling": ("argmax", "topk", "sort", "multinomial", "exponential", "cumsum"),
}


def part_of(name: str) -> str:
    for part, keys in PARTS.items():
        if any(key in name for key in keys):
            return part
    return "other torch ops"


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
              device="cpu", max_num_seqs=1, max_model_len=max(2048, (args.context or 0) + 2 * args.steps + 16))
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    if args.context:
        prompt = prompts(llm.tokenizer, args.context)[1]
    engine = llm.engine
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
    request = engine.add_request(llm._encode(prompt, True), SamplingParams(temperature=0, max_tokens=2 * args.steps + 8,
                                                                     ignore_eos=True))
    while engine.sequences[request].num_output_tokens < 4:  # the prefill (a chunk a step) and the first decodes
        engine.step()
    wall = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - wall) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the same request's next steps
        for _ in range(args.steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    ms = defaultdict(float)
    for event in prof.key_averages():
        ms[part_of(event.key)] += event.self_cpu_time_total / 1e3 / args.steps
    ms["Python"] = max(wall - sum(ms.values()), 0.0)
    print(f"quantization={llm.model.quantization}, {torch.get_num_threads()} threads: {wall:.2f} ms a decode step")
    for part, value in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"  {part:18s} {value:6.2f} ms  {100 * value / wall:4.0f}%")
    if args.table:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
