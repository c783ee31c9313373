"""Speculative decoding on a prompt set: nanospec plain / n-gram / draft model / MLP speculator vs transformers, greedy.

    python benchmarks/bench_spec.py                        # embedded SmolLM2 (its 4-bit weights) on CPU, every prompt
    python benchmarks/bench_spec.py --quantization none    # the same with float32 weights
    python benchmarks/bench_spec.py --limit 1 --max-tokens 16 --categories summarization   # a quick look
    python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --draft path/to/small-llama --json spec.json
    python benchmarks/bench_spec.py --batch 16 --methods plain ngram   # 16 requests at a time
    python benchmarks/bench_spec.py --methods plain ngram mlp_speculator    # the shipped MLP speculator, k=3
    python benchmarks/bench_spec.py --prompts benchmarks/spec_bench_questions.jsonl --limit 4   # Spec-Bench

``spec_bench_questions.jsonl``: the first turns of Spec-Bench's 480 questions (Xia et al. 2024, Apache-2.0).

Every engine and method is loaded first; then each prompt (chat template, greedy, until eos or --max-tokens) runs
through every method in turn, so that a machine whose speed drifts slows them alike. transformers runs the same token
ids: plain ``generate``, prompt lookup (``prompt_lookup_num_tokens``) and assisted generation (``assistant_model=``
the same draft, the same k). nanospec's k is adaptive by default; --no-adaptive verifies all k every step, as
transformers does. With --batch B the prompts go B at a time into one ``generate`` call (transformers: plain only,
left-padded), and a batch's wall time is shared among its requests in proportion to their tokens. Columns:

    tok/s    generated tokens / wall time of the whole request, prefill included
    tau      tokens per target forward that could verify drafts. nanospec: (tokens - 1) / (steps - 1), its
             prefill step emits one token and verifies nothing; transformers: tokens / forwards
    accept   accepted / drafted tokens (nanospec only)
    speedup  tok/s over the same engine's plain tok/s;  vs hf: nanospec tok/s over its transformers counterpart
    match    prompts whose greedy tokens equal the same engine's plain tokens (a MISMATCH line names the others)

Methods beyond the first three: the default draft is the target cut to its first --draft-layers layers (it exercises
the draft path; a trained small model is a real draft). ``mlp_speculator`` is the MLP speculator shipped for the
embedded SmolLM2 (or --mlp-speculator PATH) served as its directory says; ``mlp_chain`` its chain of stages;
``mlp_tree`` its beam of --mlp-tree-width candidates per depth; ``mlp_tree_lookup`` that beam with the n-gram chain
merged in. ``eagle3`` is an EAGLE-3 head (--eagle3 PATH, default the shipped one) served as its directory's
``speculative_config.json`` says; ``eagle3_chain`` its chain of k; ``eagle3_tree`` its EAGLE-2 tree of
--eagle3-tree-width candidates per depth and --eagle3-tree-budget nodes; ``eagle3_chain_lookup`` and
``eagle3_tree_lookup`` those with the n-gram chain joined.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.convert import convert  # noqa: E402
from nanospec.device import resolve_device, resolve_dtype  # noqa: E402
from nanospec.model.embedded import embedded_model_path  # noqa: E402

HERE = Path(__file__).resolve().parent
# the first three have a transformers counterpart; the others are nanospec only
METHODS = ("plain", "ngram", "draft", "ngram_tree", "draft_tree", "lookahead", "draft_coupled", "mlp_speculator",
           "mlp_chain", "mlp_tree", "mlp_tree_lookup", "eagle3", "eagle3_chain", "eagle3_tree", "eagle3_chain_lookup",
           "eagle3_tree_lookup")
MLP_METHODS = ("mlp_speculator", "mlp_chain", "mlp_tree", "mlp_tree_lookup")
EAGLE3_METHODS = ("eagle3", "eagle3_chain", "eagle3_tree", "eagle3_chain_lookup", "eagle3_tree_lookup")
SHIPPED_EAGLE3 = HERE.parent / "nanospec" / "speculators" / "smollm2-135m-instruct-eagle3"
HF_LABELS = {"plain": "plain", "ngram": "prompt-lookup", "draft": "assisted"}
DEFAULT_K = {"ngram": 5, "draft": 4, "mlp_speculator": 3, "eagle3": 5}


@dataclass
class Result:
    """One prompt through one method of one engine."""

    engine: str                 # "nanospec" | "transformers"
    method: str                 # "plain" | "ngram" | "draft"
    category: str
    prompt_index: int           # line of prompts.jsonl
    token_ids: list[int]        # generated, eos included
    seconds: float
    target_steps: int           # target forward passes, prefill included
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# Spec-Bench's first 80 questions are MT-bench's, 10 in each of these; Spec-Bench reports them as one category
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def load_prompts(path: Path, categories: list[str] | None, limit: int | None) -> list[tuple[int, str, str]]:
    """(line index, category, prompt), ``limit`` of each category spread evenly over it (all without a limit), in
    file order. A line is ``{"category", "prompt"}`` (prompts.jsonl) or a Spec-Bench question
    ``{"question_id", "category", "turns"}``, of which the first turn is the prompt and MT-bench's eight
    categories are one, ``mt_bench``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    items = [(i, "mt_bench" if "turns" in r and r["category"] in MT_BENCH else r["category"],
              r["prompt"] if "prompt" in r else r["turns"][0]) for i, r in enumerate(rows)]
    known = list(dict.fromkeys(c for _, c, _ in items))
    for c in categories or []:
        if c not in known:
            raise SystemExit(f"unknown category {c!r}; {path.name} has {known}")
    by_category = {c: [item for item in items if item[1] == c] for c in known if not categories or c in categories}
    taken = []
    for group in by_category.values():
        n = len(group) if limit is None else min(limit, len(group))
        taken += [group[j * len(group) // n] for j in range(n)]
    return sorted(taken)


def truncated_draft(model: Path, num_layers: int) -> Path:
    """The target's first ``num_layers`` layers as a Hugging Face directory, built once into benchmarks/.cache/."""
    out = HERE / ".cache" / f"{model.stem}-{num_layers}layers"
    if not out.is_dir():
        partial = out.with_name(out.name + ".partial")
        print(f"building the draft: {model.name}, first {num_layers} layers -> {out}", flush=True)
        convert(model, partial, num_layers=num_layers)
        partial.rename(out)  # whole or absent, even if interrupted
    return out


# ---------------------------------------------------------------- nanospec
def speculative_config(method: str, args, draft: Path | None) -> dict | None:
    adaptive = {"adaptive": not args.no_adaptive}
    ngram = {"method": "ngram", "num_speculative_tokens": args.k["ngram"], "prompt_lookup_max": args.prompt_lookup_max}
    drafted = {"method": "draft", "model": str(draft), "num_speculative_tokens": args.k["draft"]}
    if method == "ngram":
        return {**ngram, **adaptive, "prompt_lookup_min": 1}
    if method == "ngram_tree":  # same verified-token budget as the ngram chain: k nodes
        return {**ngram, "max_candidates": args.max_candidates, "tree_budget": args.k["ngram"]}
    if method == "draft":
        return {**drafted, **adaptive}
    if method == "draft_coupled":  # the draft samples with the target's own random numbers
        return {**drafted, **adaptive, "acceptance": "coupled"}
    if method == "draft_tree":  # same verified-token budget as the draft chain: k nodes
        return {**drafted, "tree_top_k": 2, "tree_budget": args.k["draft"]}
    if method.startswith("lookahead"):
        w, n, g = args.lookahead_configs[method]
        return {"method": "lookahead", "window_size": w, "ngram_size": n, "guess_set_size": g, **adaptive}
    if method in MLP_METHODS:  # without --mlp-speculator: the one shipped for the embedded model
        config = {"method": "mlp_speculator", "num_speculative_tokens": args.k["mlp_speculator"], **adaptive}
        if method != "mlp_speculator":  # a chain, or a beam of candidates, and the n-gram chain with it or not
            config.update(tree_top_k=1 if method == "mlp_chain" else args.mlp_tree_width,
                          prompt_lookup=method == "mlp_tree_lookup", prompt_lookup_max=args.prompt_lookup_max)
        if args.mlp_speculator:
            config["model"] = args.mlp_speculator
        return config
    if method == "eagle3":  # served as the head directory's speculative_config.json says
        return {"method": "eagle3", "model": args.eagle3, **adaptive}
    if method in EAGLE3_METHODS:
        config = {"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": args.k["eagle3"], **adaptive,
                  "prompt_lookup": method.endswith("_lookup"), "prompt_lookup_max": args.prompt_lookup_max}
        if method.startswith("eagle3_tree"):
            config["tree_top_k"] = args.eagle3_tree_width
            if args.eagle3_tree_budget:
                config["tree_budget"] = args.eagle3_tree_budget
        return config
    return None


def share_time(seconds: float, token_ids: list[list[int]]) -> list[float]:
    """A batch's wall time split among its requests in proportion to their generated tokens."""
    total = sum(len(t) for t in token_ids)
    return [seconds * len(t) / total if total else seconds / len(token_ids) for t in token_ids]


def nanospec_runner(llm: LLM, method: str, prompt_ids, max_tokens: int, device, temperature: float = 0.0,
                    top_p: float = 1.0):
    """A function that generates a batch of prompts with this engine and times it (sampling: seed = the prompt's
    line in the prompt file)."""
    # warm-up; on CUDA every prompt, whole: the runner captures a CUDA graph for each batch shape the first time it
    # meets it, and a verify's shape follows the policy's choices, so a short warm-up leaves captures in the timing
    warm_up = prompt_ids if device.type == "cuda" else prompt_ids[:1]
    llm.generate(warm_up, [SamplingParams(temperature=0.0, max_tokens=max_tokens if device.type == "cuda" else 8)
                           for _ in warm_up])
    llm.reset_prefix_cache()  # the timed requests prefill their prompts, as the first one of a real run does
    policy = llm.engine.speculator.policy
    if policy is not None:  # what the goodput policy measured at start-up: its decisions follow from it
        costs = ", ".join(f"{m}: {policy.forward_cost(m) * 1e3:.1f}" for m in (1, 2, 4, 8, 16, 32)
                          if m <= policy.points[-1][0])
        print(f"nanospec {method}: policy's forward ms by tokens {{{costs}}}, guessing {policy.draft_cost * 1e3:.2f} "
              f"ms a depth", flush=True)

    def run(batch: list[tuple[int, str, list[int]]]) -> list[Result]:
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=index)
                  for index, _, _ in batch]
        sync(device)
        start = time.perf_counter()
        outs = [out.outputs[0] for out in llm.generate([ids for _, _, ids in batch], params)]
        sync(device)
        seconds = share_time(time.perf_counter() - start, [o.token_ids for o in outs])
        return [Result("nanospec", method, category, index, o.token_ids, s, o.num_steps, o.num_draft_tokens,
                       o.num_accepted_tokens) for (index, category, _), o, s in zip(batch, outs, seconds)]
    return run


# ---------------------------------------------------------------- transformers
def load_transformers(path: Path, dtype, device):
    from transformers import AutoModelForCausalLM

    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent if gguf else path, dtype=dtype, **gguf)
    return model.to(device).eval()


def transformers_runner(model, method: str, prompt_ids, max_tokens: int, eos_ids: list[int], args, assistant,
                        device):
    """A function that generates a batch of prompts with transformers (plain, prompt lookup or assisted), timed."""
    kwargs = dict(do_sample=False, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    if method == "ngram":
        kwargs.update(prompt_lookup_num_tokens=args.k["ngram"], max_matching_ngram_size=args.prompt_lookup_max)
    elif method == "draft":
        assistant.generation_config.num_assistant_tokens = args.k["draft"]
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0  # always k guesses, like nanospec
        kwargs.update(assistant_model=assistant)
    forwards = []  # one entry per forward of the target

    def generate(batch_ids: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(ids) for ids in batch_ids)  # left padding: every row's last prompt token is aligned
        input_ids = torch.tensor([[kwargs["pad_token_id"]] * (width - len(ids)) + ids for ids in batch_ids],
                                 device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids], device=device)
        hook = model.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
        try:
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=n, **kwargs)
        finally:
            hook.remove()
        rows = []
        for new in out[:, width:].tolist():
            stop = next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
            rows.append(new[:stop])  # until eos, like nanospec
        return rows

    generate([prompt_ids[0]], 8)  # warm-up

    def run(batch: list[tuple[int, str, list[int]]]) -> list[Result]:
        forwards.clear()
        sync(device)
        start = time.perf_counter()
        rows = generate([ids for _, _, ids in batch], max_tokens)
        sync(device)
        seconds = share_time(time.perf_counter() - start, rows)
        return [Result("transformers", method, category, index, tokens, s, len(forwards))
                for (index, category, _), tokens, s in zip(batch, rows, seconds)]
    return run


# ---------------------------------------------------------------- report
def summarize(results: list[Result], plain_tokens: dict) -> dict:
    """Totals over ``results`` (one engine, one method, some prompts)."""
    engine = results[0].engine
    tokens = sum(len(r.token_ids) for r in results)
    seconds = sum(r.seconds for r in results)
    if engine == "nanospec":
        tau_tokens = sum(len(r.token_ids) - 1 for r in results)
        tau_steps = sum(r.target_steps - 1 for r in results)
    else:
        tau_tokens, tau_steps = tokens, sum(r.target_steps for r in results)
    drafted = sum(r.num_draft_tokens or 0 for r in results)
    accepted = sum(r.num_accepted_tokens or 0 for r in results)
    references = [plain_tokens.get((engine, "plain", r.prompt_index)) for r in results]
    return {
        "prompts": len(results), "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
        "tau": tau_tokens / tau_steps if tau_steps > 0 else 1.0,
        "num_draft_tokens": drafted if engine == "nanospec" else None,
        "num_accepted_tokens": accepted if engine == "nanospec" else None,
        "acceptance_rate": accepted / drafted if engine == "nanospec" and drafted else None,
        "matching_plain": (sum(ref == r.token_ids for ref, r in zip(references, results))
                           if None not in references else None),
    }


def find_mismatches(results: list[Result], plain_tokens: dict, may_differ: set[str] = frozenset()) -> list[dict]:
    """Every result whose tokens differ from its engine's plain tokens for the same prompt, printed loudly
    (methods in ``may_differ`` are not expected to match: a draft in rejection mode, sampling)."""
    mismatches = []
    for r in results:
        ref = plain_tokens.get((r.engine, "plain", r.prompt_index))
        if r.method == "plain" or r.method in may_differ or ref is None or ref == r.token_ids:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ref, r.token_ids)) if a != b), min(len(ref), len(r.token_ids)))
        mismatches.append({"engine": r.engine, "method": r.method, "prompt_index": r.prompt_index, "first_diff": at})
        print(f"!!! MISMATCH: {r.engine} {r.method} differs from {r.engine} plain on prompt {r.prompt_index} "
              f"({r.category}) from generated token {at} on")
    return mismatches


def print_table(title: str, rows: dict) -> None:
    """``rows``: (engine, method) -> summary, for one category (or all)."""
    some = next(iter(rows.values()))
    print(f"\n== {title}: {some['prompts']} prompt(s) ==")
    header = (f"{'engine':<14}{'method':<15}{'tokens':>7}{'tok/s':>9}{'tau':>7}{'accept':>8}{'speedup':>9}"
              f"{'vs hf':>8}{'match':>8}")
    print(header)
    print("-" * len(header))
    for (engine, method), s in rows.items():
        plain = rows.get((engine, "plain"))
        hf = rows.get(("transformers", method)) if engine == "nanospec" else None
        accept = f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] is not None else "-"
        speedup = f"{s['tok_per_s'] / plain['tok_per_s']:.2f}x" if plain else "-"
        vs_hf = f"{s['tok_per_s'] / hf['tok_per_s']:.2f}x" if hf else "-"
        match = "ref" if method == "plain" else (
            f"{s['matching_plain']}/{s['prompts']}" if s["matching_plain"] is not None else "-")
        label = HF_LABELS[method] if engine == "transformers" else method
        print(f"{engine:<14}{label:<15}{s['tokens']:>7}{s['tok_per_s']:>9.1f}{s['tau']:>7.2f}{accept:>8}{speedup:>9}"
              f"{vs_hf:>8}{match:>8}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target: a .gguf file or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--prompts", default=str(HERE / "prompts.jsonl"))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS[:3]))
    p.add_argument("--lookahead", nargs="+", default=["5,4,5"], metavar="W,N,G",
                   help="lookahead (window, n-gram, guess set) settings to run when 'lookahead' is a method")
    p.add_argument("--max-candidates", type=int, default=3, help="continuations per match for ngram_tree")
    p.add_argument("--categories", nargs="+", default=None)
    p.add_argument("--limit", type=int, default=None, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="requests per generate call (transformers: plain only)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: seeded sampling (seed = prompt line), nanospec only; greedy by default")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--draft", default=None, help="draft model path (default: the target's first --draft-layers layers)")
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--mlp-speculator", default=None, metavar="PATH",
                   help="MLP speculator directory for mlp_speculator (default: the one shipped for the embedded model)")
    p.add_argument("--mlp-tree-width", type=int, default=4, help="candidates per depth for mlp_tree(_lookup)")
    p.add_argument("--eagle3", default=str(SHIPPED_EAGLE3), metavar="PATH", help="EAGLE-3 head for the eagle3 methods")
    p.add_argument("--eagle3-tree-width", type=int, default=8, help="candidates per depth for eagle3_tree")
    p.add_argument("--eagle3-tree-budget", type=int, default=None,
                   help="nodes of eagle3_tree (default: k x width)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"k for every method (default: {DEFAULT_K})")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram the ngram methods match")
    p.add_argument("--no-adaptive", action="store_true",
                   help="nanospec verifies every guess (default: only as many as pay off on this machine)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default="auto", help="the target's weights: auto (a GGUF's own), int4, int8 or none")
    p.add_argument("--device", default=None)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (the default on CUDA is to capture decode and verify steps)")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args()
    args.k = {m: args.num_speculative_tokens or k for m, k in DEFAULT_K.items()}
    args.lookahead_configs = {f"lookahead{w},{n},{g}": (int(w), int(n), int(g))
                              for w, n, g in (c.split(",") for c in args.lookahead)}
    if "lookahead" in args.methods:
        i = args.methods.index("lookahead")
        args.methods[i:i + 1] = list(args.lookahead_configs)

    torch.set_grad_enabled(False)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model_path = Path(args.model) if args.model else embedded_model_path()
    prompts = load_prompts(Path(args.prompts), args.categories, args.limit)
    if not prompts:
        raise SystemExit("no prompts selected")
    draft = None
    if args.temperature > 0 and not args.no_transformers:
        print("sampling: transformers' random numbers are its own, so it is not run (--no-transformers)")
        args.no_transformers = True
    if {"draft", "draft_tree", "draft_coupled"} & set(args.methods):
        draft = Path(args.draft) if args.draft else truncated_draft(model_path, args.draft_layers)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"threads {torch.get_num_threads()}, dtype {dtype}, batch {args.batch}, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature} top_p {args.top_p}'}, "
          f"max {args.max_tokens} new tokens, {len(prompts)} prompts")
    print(f"target {model_path.name} (quantization: {args.quantization}); ngram k={args.k['ngram']} n-gram<={args.prompt_lookup_max}"
          + (f"; draft {draft} k={args.k['draft']}" if draft else "")
          + (f"; mlp speculator {args.mlp_speculator or '(shipped)'} k={args.k['mlp_speculator']}"
             if set(MLP_METHODS) & set(args.methods) else "")
          + ("; nanospec verifies every guess" if args.no_adaptive else "; nanospec k adaptive (goodput)"))
    print("tok/s = generated tokens / wall time of the request, prefill included")

    # Every engine and method is loaded first, then each prompt runs through all of them in turn.
    runners = []
    prompt_ids, eos_ids = None, None
    for method in args.methods:
        print(f"nanospec {method}: loading ...", flush=True)
        llm = LLM(args.model, dtype=dtype, device=device, max_num_seqs=args.batch,
                  quantization=None if args.quantization == "none" else args.quantization,
                  enforce_eager=args.enforce_eager or None,
                  speculative_config=speculative_config(method, args, draft))
        if prompt_ids is None:
            tok = llm.tokenizer
            prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
                          for _, _, text in prompts]
            eos_ids = list(tok.eos_token_ids)
        runners.append(nanospec_runner(llm, method, prompt_ids, args.max_tokens, device, args.temperature,
                                       args.top_p))
    if not args.no_transformers:
        print("transformers: loading the target ...", flush=True)
        model = load_transformers(model_path, dtype, device)
        assistant = load_transformers(draft, dtype, device) if "draft" in args.methods else None
        for method in [m for m in args.methods if m in HF_LABELS and (args.batch == 1 or m == "plain")]:
            runners.append(transformers_runner(model, method, prompt_ids, args.max_tokens, eos_ids, args, assistant,
                                               device))
    results: list[Result] = []
    work = [(index, category, ids) for (index, category, _), ids in zip(prompts, prompt_ids)]
    for start in range(0, len(work), args.batch):
        batch = work[start:start + args.batch]
        print("prompt" + ("s " if len(batch) > 1 else " ") + ", ".join(f"{i} ({c})" for i, c, _ in batch) + " ...",
              flush=True)
        for run in runners:
            results += run(batch)

    plain_tokens = {(r.engine, "plain", r.prompt_index): r.token_ids for r in results if r.method == "plain"}
    mismatches = find_mismatches(results, plain_tokens, {"draft"} if args.temperature > 0 else set())
    groups: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for r in results:
        groups[r.category][(r.engine, r.method)].append(r)
    for r in results:
        groups["overall"][(r.engine, r.method)].append(r)
    summary = {c: {key: summarize(rs, plain_tokens) for key, rs in rows.items()} for c, rows in groups.items()}
    for category, rows in summary.items():
        if category != "overall" or len(summary) > 2:  # one category: its table is the overall one
            print_table(category, rows)
    if args.batch > 1:
        print(f"\nbatch {args.batch}: tok/s is the throughput of the batches, which mix categories; "
              "tau and match are per request")

    nanospec_plain = {i: t for (engine, _, i), t in plain_tokens.items() if engine == "nanospec"}
    hf_plain = {i: t for (engine, _, i), t in plain_tokens.items() if engine == "transformers"}
    if nanospec_plain and hf_plain:
        same = sum(nanospec_plain[i] == hf_plain[i] for i in nanospec_plain)
        print(f"\nnanospec plain == transformers plain, token for token, on {same}/{len(nanospec_plain)} prompts "
              f"(different kernels may round differently)")
    if "plain" not in args.methods:
        print("\nplain was not run: outputs not checked against it")
    elif mismatches:
        print(f"\n!!! {len(mismatches)} MISMATCH(ES) against plain, listed above")
    elif args.temperature > 0:
        print("\nevery seeded output (but the rejection-mode draft's) matches plain seeded sampling token for token")
    else:
        print("\nevery greedy output matches its engine's plain output token for token")

    if args.json:
        report = {
            "settings": {"model": str(model_path), "draft": str(draft) if draft else None,
                         "mlp_speculator": args.mlp_speculator, "device": str(device),
                         "dtype": str(dtype), "threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
                         "batch": args.batch, "num_speculative_tokens": args.k, "adaptive": not args.no_adaptive,
                         "prompt_lookup_max": args.prompt_lookup_max, "methods": args.methods,
                         "tok_per_s": "generated tokens / request wall time, prefill included"},
            "summary": {c: [{"engine": e, "method": m, **s} for (e, m), s in rows.items()]
                        for c, rows in summary.items()},
            "mismatches": mismatches,
            "results": [asdict(r) for r in results],
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
