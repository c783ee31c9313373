"""Decode speed beside a fixed background load: nanospec vs transformers, quiet and busy, in one process.

    python benchmarks/bench_busy.py                    # 2 busy processes, 3 rounds each way
    python benchmarks/bench_busy.py --busy 1 --rounds 5 --new-tokens 48

The machine is first measured as it is (quiet, if nothing else runs), then beside ``--busy`` processes that each
keep one core busy (a pure-Python loop, like any CPU-bound neighbour). In each phase the engines alternate, one
greedy batch-1 request of ``--new-tokens`` tokens per round (prefill excluded, eos ignored), so a machine whose
speed drifts slows both alike. Reported per engine: decode tok/s (median of the rounds) quiet and busy, and the
slowdown (quiet / busy). nanospec's CPU thread count is what ``nanospec.threads`` chooses; transformers runs with
torch's own setting in the same process.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import PROMPT, load_transformers  # noqa: E402

from nanospec import LLM, SamplingParams  # noqa: E402


def spin(stop) -> None:
    """One busy core until ``stop`` is set (checked every ~10 ms)."""
    os.nice(0)
    while not stop.is_set():
        deadline = time.perf_counter() + 0.01
        while time.perf_counter() < deadline:
            pass


def nanospec_decode(llm: LLM, prompt_ids: list[int], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    stream = llm.stream(list(prompt_ids), params)
    next(stream)  # the prefill's token
    start, count = time.perf_counter(), 0
    for out in stream:
        count = len(out.token_ids) - 1
    return count / (time.perf_counter() - start)


def transformers_decode(model, prompt_ids: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n):
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return time.perf_counter() - start

    prefill = run(1)
    return (new_tokens - 1) / (run(new_tokens) - prefill)


def rounds(llm, hf, prompt_ids, args) -> tuple[list[float], list[float]]:
    ns, tf = [], []
    for _ in range(args.rounds):
        ns.append(nanospec_decode(llm, prompt_ids, args.new_tokens))
        tf.append(transformers_decode(hf, prompt_ids, args.new_tokens))
        print(f"  round: nanospec {ns[-1]:.1f} tok/s, transformers {tf[-1]:.1f} tok/s", flush=True)
    return ns, tf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--busy", type=int, default=2, help="background processes, each keeping one core busy")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    args = p.parse_args()

    torch.set_grad_enabled(False)
    llm = LLM(args.model)
    hf = load_transformers(argparse.Namespace(model=args.model, random_shape=None), llm.dtype, llm.device)
    prompt_ids = llm.tokenizer.encode(PROMPT)[: args.prompt_tokens]
    nanospec_decode(llm, prompt_ids, 4)  # warm-up
    transformers_decode(hf, prompt_ids, 4)
    print(f"CPU, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, dtype {llm.dtype}, "
          f"load average before {os.getloadavg()[0]:.2f}; {args.rounds} alternating rounds of {args.new_tokens} "
          f"tokens", flush=True)
    print("quiet:", flush=True)
    quiet = rounds(llm, hf, prompt_ids, args)
    stop = multiprocessing.Event()
    workers = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for w in workers:
        w.start()
    try:
        time.sleep(1.0)
        print(f"beside {args.busy} busy processes:", flush=True)
        busy = rounds(llm, hf, prompt_ids, args)
    finally:
        stop.set()
        for w in workers:
            w.join()
    print(f"{'engine':<14}{'quiet tok/s':>12}{'busy tok/s':>12}{'slowdown':>10}")
    for name, q, b in (("nanospec", quiet[0], busy[0]), ("transformers", quiet[1], busy[1])):
        q, b = statistics.median(q), statistics.median(b)
        print(f"{name:<14}{q:>12.1f}{b:>12.1f}{q / b:>9.2f}x")


if __name__ == "__main__":
    main()
