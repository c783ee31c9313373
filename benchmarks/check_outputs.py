"""Record, or compare against a record, the outputs of every speculative method on the benchmark prompts.

    python benchmarks/check_outputs.py --write before.json          # on the code before a change
    python benchmarks/check_outputs.py --compare before.json        # after it: every output must be the same

For each method (plain, n-gram, n-gram tree, lookahead, draft chain, draft tree, the shipped MLP speculator as
served and as a chain) every prompt of
prompts.jsonl runs alone, greedy, and then all prompts run in one ``generate`` call with seeded
sampling (temperature 0.8, top_p 0.95, seed = the prompt's line). Greedy outputs must equal plain greedy
for every method (lossless) and equal the record; sampled outputs must equal the record. Adaptive k is
off for the sampled runs, so that they do not depend on measured forward costs. The draft is the
target's first ``--draft-layers`` layers (built once, as bench_spec does).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_spec import load_prompts, truncated_draft  # noqa: E402

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.model.embedded import embedded_model_path  # noqa: E402

HERE = Path(__file__).resolve().parent


def method_configs(draft: Path) -> dict[str, dict | None]:
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 5},
        "ngram_tree": {"method": "ngram", "num_speculative_tokens": 5, "max_candidates": 3, "tree_budget": 8},
        "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 2},
        "draft": {"method": "draft", "model": str(draft), "num_speculative_tokens": 3},
        "draft_tree": {"method": "draft", "model": str(draft), "num_speculative_tokens": 3, "tree_top_k": 2,
                       "tree_budget": 5},
        "mlp_speculator": {"method": "mlp_speculator"},
        "mlp_chain": {"method": "mlp_speculator", "tree_top_k": 1, "prompt_lookup": False},
    }


def quantization(args) -> str | None:
    return None if args.quantization == "none" else args.quantization


def run(args) -> dict:
    model = Path(args.model) if args.model else embedded_model_path()
    draft = truncated_draft(model, args.draft_layers)
    prompts = load_prompts(Path(args.prompts), None, args.limit)
    record: dict[str, dict] = {}
    llm_plain = None
    for name, config in method_configs(draft).items():
        if args.methods and name not in args.methods:
            continue
        start = time.perf_counter()
        llm = LLM(str(model), dtype="float32", device="cpu", speculative_config=config,
                  quantization=quantization(args))
        chat = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
                for _, _, p in prompts]
        greedy_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        greedy = [llm.generate([ids], greedy_params)[0].outputs[0].token_ids for ids in chat]
        if config is not None and "adaptive" not in config:
            llm = LLM(str(model), dtype="float32", device="cpu", speculative_config={**config, "adaptive": False},
                      quantization=quantization(args))
        sampled_params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=index)
                          for index, _, _ in prompts]
        sampled = [o.outputs[0].token_ids for o in llm.generate(chat, sampled_params)]
        record[name] = {"greedy": greedy, "sampled": sampled}
        if llm_plain is None:
            llm_plain = record[name]
        same = sum(a == b for a, b in zip(greedy, llm_plain["greedy"]))
        print(f"{name:<11} {time.perf_counter() - start:6.1f} s   greedy == plain greedy: {same}/{len(greedy)}",
              flush=True)
    return record


def compare(before: dict, after: dict) -> int:
    differences = 0
    for name, outputs in after.items():
        for kind in ("greedy", "sampled"):
            old, new = before[name][kind], outputs[kind]
            bad = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
            differences += len(bad)
            print(f"{name:<11} {kind:<8} {len(new) - len(bad)}/{len(new)} as recorded"
                  + (f"   DIFFERENT: prompts {bad}" if bad else ""))
    return differences


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", default=str(HERE / "prompts.jsonl"))
    p.add_argument("--limit", type=int, default=None, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--methods", nargs="+", default=None)
    p.add_argument("--quantization", default="auto",
                   help="the target's weights, as LLM(quantization=...): auto (the default), int4, int8 or none "
                        "(float; tests/data/recorded_greedy.json was written so)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", help="record the outputs here")
    g.add_argument("--compare", help="compare the outputs with this record")
    args = p.parse_args(argv)
    record = run(args)
    if args.write:
        Path(args.write).write_text(json.dumps(record) + "\n")
        return 0
    differences = compare(json.loads(Path(args.compare).read_text()), record)
    print("all outputs as recorded" if not differences else f"{differences} outputs differ from the record")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
