"""Tensor parallelism on this machine: per-step target and draft time at tensor_parallel_size 1 against 2.

    python benchmarks/bench_tp.py                    # CPU, gloo, random-weight models (written once, cached)
    python benchmarks/bench_tp.py --repeats 50 --json tp.json

The models have random weights (the vocabulary and tokenizer are SmolLM2's) in shapes 2 divides: the target
~100M parameters (hidden 512, 8 heads / 4 KV heads, 24 layers, MLP 1536), the draft ~15M (hidden 256, 4 / 2 heads,
2 layers, MLP 768). Four set-ups, each its own LLM (one process group at a time):

    TP 1                  target and draft on this process (all its threads)
    TP 1, 1 thread        the same on one thread: what each rank of TP 2 gets on a 2-core machine
    TP 2, draft TP 2      both split over the driver and one worker process
    TP 2, draft TP 1      the target split, the draft whole on the driver

For each: the median over --repeats of one target forward after 64 cached tokens over 1 token (a decode) and
over k+1 tokens (a verify of k guesses), and of one single-token draft forward, each through the runner the
engine uses (so under TP 2 with the command to the worker, the all-reduces and the logits' all-gather), and of
one command that does nothing (what sending a command costs the driver; at TP 1 a local call); then a
greedy generation (draft speculation, k fixed) with the time per step spent in target forwards and in the
proposer. On a CPU the ranks share the cores (each of T ranks gets 1/T of the threads), so TP 2 cannot be faster
here: it shows what the collectives and the commands cost, not what a second GPU buys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.model.forward_batch import build_forward_batch  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=8,
              num_key_value_heads=4)
DRAFT = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
PROMPTS = ["The history of the printing press begins", "def quicksort(items):"]


def write_random_model(shape: dict, out_dir: Path, seed: int) -> str:
    """A random-weight Llama of ``shape`` as a Hugging Face directory (the workers load it from there)."""
    if (out_dir / "model.safetensors").exists():
        return str(out_dir)
    from safetensors.torch import save_file

    from nanospec.model.random_model import random_checkpoint

    checkpoint = random_checkpoint(shape, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in checkpoint.tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**checkpoint.config.to_hf_dict(), "torch_dtype": "float32"}))
    checkpoint.tokenizer.save(out_dir)
    return str(out_dir)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_forward(runner, block_manager, tokens: int, repeats: int, context: int = 64) -> float:
    """Median ms of one forward over ``tokens`` new tokens (every row's logits) after ``context`` cached ones."""
    table: list[int] = []
    block_manager.reserve(table, context + tokens)
    try:
        runner.execute(build_forward_batch([[0] * context], [0], [table], block_manager.block_size, [[context - 1]],
                                           "cpu"))
        batch = build_forward_batch([[0] * tokens], [context], [table], block_manager.block_size, [range(tokens)],
                                    "cpu")
        return median_ms(lambda: runner.execute(batch), repeats)
    finally:
        block_manager.free(table)


def run(name: str, target: str, draft: str, tp: int, draft_tp: int, args, threads: int | None = None) -> dict:
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(name, target, draft, tp, draft_tp, args)
    finally:
        torch.set_num_threads(saved)


def _run(name: str, target: str, draft: str, tp: int, draft_tp: int, args) -> dict:
    spec = {"method": "draft", "model": draft, "num_speculative_tokens": args.k, "adaptive": False,
            "draft_tensor_parallel_size": draft_tp}
    with LLM(target, tensor_parallel_size=tp, speculative_config=spec, num_blocks=256, max_model_len=1024,
             device="cpu", dtype="float32") as llm:
        engine = llm.engine
        proposer = engine.speculator.proposer
        result = {"setup": name, "tp": tp, "draft_tp": draft_tp, "threads_per_rank": torch.get_num_threads()}
        result["target_decode_ms"] = time_forward(engine.runner, engine.block_manager, 1, args.repeats)
        result["target_verify_ms"] = time_forward(engine.runner, engine.block_manager, args.k + 1, args.repeats)
        result["draft_forward_ms"] = time_forward(proposer.runner, proposer.block_manager, 1, args.repeats)
        # a command with no work (copy no K/V slots): what the driver pays to send one, on top of the forward
        none = torch.zeros(0, dtype=torch.int64)
        result["command_ms"] = median_ms(lambda: engine.runner.copy_kv_slots(none, none), args.repeats)
        propose_seconds = [0.0]
        propose = proposer.propose

        def timed_propose(*a, **kw):
            start = time.perf_counter()
            try:
                return propose(*a, **kw)
            finally:
                propose_seconds[0] += time.perf_counter() - start

        proposer.propose = timed_propose
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        before = llm.stats()
        propose_seconds[0] = 0.0
        start = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        outs = [out.outputs[0] for out in llm.generate(PROMPTS, params)]
        seconds = time.perf_counter() - start
        after = llm.stats()
        steps = after["num_steps"] - before["num_steps"]
        result.update(
            steps=steps, tokens=sum(len(o.token_ids) for o in outs), tok_per_s=sum(len(o.token_ids) for o in outs)
            / seconds, step_ms=(after["step_seconds"] - before["step_seconds"]) / steps * 1e3,
            step_target_ms=(after["forward_seconds"] - before["forward_seconds"]) / steps * 1e3,
            step_draft_ms=propose_seconds[0] / steps * 1e3, token_ids=[o.token_ids for o in outs])
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    cache = HERE / ".cache"
    target = write_random_model(TARGET, cache / "tp_target", seed=1)
    draft = write_random_model(DRAFT, cache / "tp_draft", seed=2)
    print(f"CPU, {torch.get_num_threads()} threads in all; target {TARGET}; draft {DRAFT}; k={args.k}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = [run("TP 1", target, draft, 1, 1, args), run("TP 1, 1 thread", target, draft, 1, 1, args, threads=1),
               run("TP 2, draft TP 2", target, draft, 2, 2, args), run("TP 2, draft TP 1", target, draft, 2, 1, args)]
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    header = (f"{'setup':<18} {'decode ms':>9} {f'verify {args.k + 1} ms':>11} {'draft ms':>8} {'command ms':>10} "
              f"{'step ms':>8} {'target/step':>11} {'draft/step':>10} {'tok/s':>6}")
    print(header)
    for r in results:
        print(f"{r['setup']:<18} {r['target_decode_ms']:>9.2f} {r['target_verify_ms']:>11.2f} "
              f"{r['draft_forward_ms']:>8.2f} {r['command_ms']:>10.3f} {r['step_ms']:>8.2f} "
              f"{r['step_target_ms']:>11.2f} {r['step_draft_ms']:>10.2f} {r['tok_per_s']:>6.1f}")
    same = all(r["token_ids"] == results[0]["token_ids"] for r in results)
    print("same greedy tokens in every set-up:", same)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not same:
        sys.exit("the set-ups' greedy outputs differ")


if __name__ == "__main__":
    main()
