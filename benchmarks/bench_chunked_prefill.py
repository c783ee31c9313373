"""A long prompt arriving while another request decodes, with chunked prefill and without, in one process,
alternating the engines:

    python benchmarks/bench_chunked_prefill.py                        # embedded SmolLM2, 4-bit, 3,000-token prompt
    python benchmarks/bench_chunked_prefill.py --budgets 4096 512 --prompt-tokens 6000

Request A (a benchmark prompt, greedy, --decode-tokens, eos ignored) decodes alone for 8 tokens; then B (the
benchmark prompts' texts joined up to --prompt-tokens tokens, --long-max-tokens) is added. Per engine (each
``--budgets`` value of ``max_num_batched_tokens``, with chunking on and off): B's time to first token (from its
arrival), A's inter-token gaps from B's arrival until B's first token (the longest and the median), and the time
until both end. Times come from the engine loop (``Engine.step``), so they hold no HTTP or client costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanospec import LLM, SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--quantization", default="auto", help="the weights: auto (default), int4, int8 or none (float)")
    p.add_argument("--budgets", type=int, nargs="+", default=[4096, 512], help="max_num_batched_tokens values")
    p.add_argument("--prompt-tokens", type=int, default=3000, help="B's prompt length (default 3000)")
    p.add_argument("--decode-tokens", type=int, default=64, help="A's tokens (default 64)")
    p.add_argument("--long-max-tokens", type=int, default=8, help="B's tokens (default 8)")
    p.add_argument("--rounds", type=int, default=2)
    return p.parse_args(argv)


def prompts(tokenizer, length: int) -> tuple[list[int], list[int]]:
    texts = [json.loads(line)["prompt"] for line in (ROOT / "benchmarks" / "prompts.jsonl").read_text().splitlines()]
    long: list[int] = []
    while len(long) < length:
        for text in texts:
            long += tokenizer.encode(text + "\n\n")
    return tokenizer.encode(texts[0]), long[:length]


def run(llm: LLM, short: list[int], long: list[int], args) -> dict:
    engine = llm.engine
    a = engine.add_request(short, SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True))
    while engine.sequences[a].num_output_tokens < 8:
        engine.step()
    start = last_a = time.perf_counter()
    b = engine.add_request(long, SamplingParams(temperature=0, max_tokens=args.long_max_tokens, ignore_eos=True))
    gaps, ttft = [], None
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        ids = {o.request_id for o in outputs if o.token_ids}
        if ttft is None and a in ids:
            gaps.append(now - last_a)
            last_a = now
        if ttft is None and b in ids:
            ttft = now - start
    end = time.perf_counter() - start
    for request in (a, b):
        engine.pop_finished(request)
    return {"ttft": ttft, "max_gap": max(gaps, default=0.0), "median_gap": statistics.median(gaps) if gaps else 0.0,
            "gaps": len(gaps), "end": end}


def main(argv=None) -> None:
    args = parse_args(argv)
    quantization = None if args.quantization == "none" else args.quantization
    engines = {}
    for budget in args.budgets:
        for chunked in (True, False):
            engines[(budget, chunked)] = LLM(args.model, quantization=quantization, max_num_seqs=2,
                                             max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                                             enable_prefix_caching=False)
    short, long = prompts(next(iter(engines.values())).tokenizer, args.prompt_tokens)
    results: dict = {key: [] for key in engines}
    for _ in range(args.rounds):
        for key, llm in engines.items():
            results[key].append(run(llm, short, long, args))
    print("| max_num_batched_tokens | chunked prefill | B's TTFT (s) | A's longest gap (s) | A's median gap (s) | "
          "A's tokens meanwhile | both done (s) |")
    print("|---|---|---|---|---|---|---|")
    for (budget, chunked), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {budget} | {'on' if chunked else 'off'} | {med['ttft']:.2f} | {med['max_gap']:.2f} | "
              f"{med['median_gap']:.3f} | {med['gaps']:.0f} | {med['end']:.2f} |")


if __name__ == "__main__":
    main()
