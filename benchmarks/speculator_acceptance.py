"""Acceptance of an MLP speculator on the benchmark prompts, simulated without the engine's speculation.

    python benchmarks/speculator_acceptance.py                         # the shipped SmolLM2 speculator
    python benchmarks/speculator_acceptance.py --speculator DIR -k 3 --max-tokens 128
    python benchmarks/speculator_acceptance.py --tree-top-k 4 --prompt-lookup   # bench_spec's mlp_tree_lookup

For each prompt of ``benchmarks/prompts.jsonl`` (through the chat template, as bench_spec encodes it) the target
answers greedily (``LLM.generate``); one teacher-forced forward over prompt + answer gives the final hidden
state of every position. Then greedy speculation is replayed as the engine chains it: after the target emitted
token ``p`` (from hidden state ``h``), the speculator guesses ``k`` tokens from ``(h, token p)``; ``n`` of
them match the answer, the verify step emits ``n + 1`` tokens and the next step starts from ``p + n + 1``.
With ``--tree-top-k`` the guesses are the speculator's beam (``MLPSpeculator.propose_tree``) and with
``--prompt-lookup`` the n-gram chain joins them; a step accepts as deep as the answer runs down the tree.
tau is bench_spec's: (tokens - 1) / (target steps - 1), the prefill step left out. Per-depth acceptance:
steps accepting depth ``i`` / steps that verified depth ``i`` (those that accepted every earlier depth).
The real engine verifies the same guesses on the same hidden states up to rounding, so its greedy tau should
match this one; it may differ where the engine's speculation is adaptive (k chosen by goodput).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanospec import LLM, SamplingParams
from nanospec.model.mlp_speculator import load_mlp_speculator
from nanospec.speculative.ngram import NgramIndex, NgramProposer
from nanospec.train.data import encode_chat, load_prompt_set
from nanospec.train.record import teacher_forced_hidden

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "nanospec" / "speculators" / "smollm2-135m-instruct"


def accepted_depth(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """How far the true continuation ``truth`` runs down the tree (nodes: tokens under parents, -1 the root)."""
    node, depth = -1, 0
    for token in truth:
        node = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
        if node is None:
            break
        depth += 1
    return depth


def simulate(speculator, hidden: torch.Tensor, tokens: list[int], k: int, width: int = 1,
             lookup_index: NgramIndex | None = None) -> tuple[int, list[int], list[int]]:
    """Replay greedy speculation over one answer: ``hidden[j]`` is the state whose logits gave ``tokens[j]``.
    Each step proposes the speculator's beam of ``width`` paths per depth (a chain when 1) and, with
    ``lookup_index`` (the n-gram index of the prompt), the n-gram chain; the accepted depth is how far the answer
    runs down their union. Returns (verify steps, per-depth guesses verified, per-depth guesses accepted)."""
    steps, tried, accepted = 0, [0] * k, [0] * k
    # every position's beam at once
    beams = [t.tolist() for t in speculator.propose_tree(hidden, torch.tensor(tokens), k, width)]
    lookup = NgramProposer(k, lookup_index.min_n, lookup_index.max_n) if lookup_index is not None else None
    done = 0  # answer tokens fed to the n-gram index so far
    p = 0
    while p < len(tokens) - 1:
        steps += 1
        truth = tokens[p + 1:p + 1 + k]
        n = accepted_depth(beams[0][p], beams[1][p], truth)
        if lookup is not None:
            lookup_index.extend(tokens[done:p + 1])
            done = p + 1
            chain = lookup.chain(lookup_index)
            n = max(n, accepted_depth(chain, list(range(-1, len(chain) - 1)), truth))
        for i in range(min(n + 1, len(truth))):
            tried[i] += 1
        for i in range(n):
            accepted[i] += 1
        p += n + 1
    return steps, tried, accepted


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--speculator", default=str(SHIPPED))
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts.jsonl"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--tree-top-k", type=int, default=1, help="the beam's width (1: the chain)")
    p.add_argument("--prompt-lookup", action="store_true", help="the n-gram chain (n 1..4) joins the proposals")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--states", default=None, help="keep the target's answers and hidden states in this file, and "
                   "reuse them when it exists (to compare speculators without rerunning the target)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on a busy 2-core machine)")
    args = p.parse_args(argv)

    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = load_prompt_set(args.prompts)
    states_file = Path(args.states) if args.states else None
    if states_file is not None and states_file.is_file():  # the target's answers and states, from an earlier run
        saved = load_file(str(states_file))
        prompt_ids = [saved[f"prompt.{i}"].tolist() for i in range(len(rows))]
        answers = [saved[f"answer.{i}"].tolist() for i in range(len(rows))]
        hidden = [saved[f"hidden.{i}"].float() for i in range(len(rows))]
    else:
        llm = LLM(args.model, dtype="float32", device="cpu", max_num_seqs=64)
        prompt_ids = [encode_chat(llm.tokenizer, row["prompt"]) for row in rows]
        outputs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        hidden = teacher_forced_hidden(llm.model, [ids + answer for ids, answer in zip(prompt_ids, answers)])
        if states_file is not None:
            save_file({**{f"prompt.{i}": torch.tensor(p) for i, p in enumerate(prompt_ids)},
                       **{f"answer.{i}": torch.tensor(a) for i, a in enumerate(answers)},
                       **{f"hidden.{i}": h.contiguous() for i, h in enumerate(hidden)}}, str(states_file))
        del llm
    speculator = load_mlp_speculator(args.speculator, hidden[0].shape[1])

    k = args.k
    per = defaultdict(lambda: {"tokens": 0, "steps": 0, "tried": [0] * k, "accepted": [0] * k})
    for row, ids, answer, states in zip(rows, prompt_ids, answers, hidden):
        if len(answer) < 2:
            continue
        lookup = NgramIndex(1, 4, ids) if args.prompt_lookup else None
        steps, tried, accepted = simulate(speculator, states[len(ids) - 1:len(ids) - 1 + len(answer)], answer, k,
                                          args.tree_top_k, lookup)
        for key in (row["category"], "overall"):
            entry = per[key]
            entry["tokens"] += len(answer) - 1
            entry["steps"] += steps
            entry["tried"] = [a + b for a, b in zip(entry["tried"], tried)]
            entry["accepted"] = [a + b for a, b in zip(entry["accepted"], accepted)]
    shape = "chain" if args.tree_top_k == 1 else f"beam of {args.tree_top_k}"
    print(f"speculator {args.speculator}, k={k}, {shape}{' + prompt lookup' if args.prompt_lookup else ''}, "
          f"greedy, max {args.max_tokens} tokens, {len(rows)} prompts")
    print(f"{'category':<15}{'tokens':>7}{'tau':>7}  per-depth acceptance")
    results = {}
    for category, e in sorted(per.items(), key=lambda item: item[0] == "overall"):
        tau = e["tokens"] / max(e["steps"], 1)
        rates = [a / t if t else 0.0 for a, t in zip(e["accepted"], e["tried"])]
        results[category] = {"tau": tau, "stage_acceptance": rates, "tokens": e["tokens"] + 1}
        print(f"{category:<15}{e['tokens']:>7}{tau:>7.2f}  " + " ".join(f"{r:.2f}" for r in rates))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
