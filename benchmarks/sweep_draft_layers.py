"""Which layer-truncated SmolLM2 makes the best draft? tok/s, acceptance and tau per N, beside plain.

    python benchmarks/sweep_draft_layers.py --layers 2 4 8 16 24 --prompts 4 --max-tokens 64

Each draft is the target's first N layers + final norm + (tied) head, written by
``nanospec.convert --num-layers N``. Drafts are verified every step (adaptive off) so that the
draft's own quality is measured; with the default adaptive policy the engine stops drafting when
it does not pay.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.convert import convert  # noqa: E402
from nanospec.model.embedded import embedded_model_path  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    tokens = steps = drafted = accepted = 0
    start = time.perf_counter()
    outs = [llm.generate([p], params)[0].outputs[0] for p in prompts]
    seconds = time.perf_counter() - start
    for o in outs:
        tokens += len(o.token_ids)
        steps += o.num_steps
        drafted += o.num_draft_tokens
        accepted += o.num_accepted_tokens
    return {"tok_s": tokens / seconds, "tau": (tokens - len(outs)) / max(steps - len(outs), 1),
            "acceptance": accepted / drafted if drafted else 0.0, "token_ids": [o.token_ids for o in outs]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 24])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [json.loads(line) for line in (Path(__file__).parent / "prompts.jsonl").read_text().splitlines()]
    plain = LLM()
    prompts = [plain.tokenizer.encode(plain.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}]))
               for r in rows[: args.prompts]]
    results = {"plain": run(plain, prompts, args.max_tokens)}
    del plain
    print(f"{'draft':<10}{'tok/s':>8}{'tau':>7}{'accept':>8}{'vs plain':>10}")
    print(f"{'plain':<10}{results['plain']['tok_s']:>8.1f}{1.0:>7.2f}{'-':>8}{1.0:>10.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.layers:
            draft = convert(embedded_model_path(), Path(tmp) / f"layers{n}", num_layers=n)
            llm = LLM(speculative_config={"method": "draft", "model": str(draft), "num_speculative_tokens": args.k,
                                          "adaptive": False})
            r = results[f"layers{n}"] = run(llm, prompts, args.max_tokens)
            same = r["token_ids"] == results["plain"]["token_ids"]
            print(f"{n:<10}{r['tok_s']:>8.1f}{r['tau']:>7.2f}{r['acceptance']:>8.0%}"
                  f"{r['tok_s'] / results['plain']['tok_s']:>10.2f}{'' if same else '  MISMATCH'}")
            del llm
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
