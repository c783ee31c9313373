"""How often a draft's guess is accepted under rejection sampling and under coupled (matched) verification.

    python benchmarks/acceptance_modes.py                       # 4-, 12- and 24-layer SmolLM2 drafts, T=0.8
    python benchmarks/acceptance_modes.py --layers 8 --temperature 1.0 --top-p 1.0

For every position of the target's own sampled continuations of the benchmark prompts (the context is the
prompt and the continuation so far), with ``p`` the target's and ``q`` the draft's distribution there (the
request's temperature and top-p applied to each):

    rejection  P(accept) = sum_v min(p_v, q_v) = 1 - TV(p, q)            (exact)
    coupled    P(accept) = P(argmax_v q_v / E_v == argmax_v p_v / E_v)   (E_v ~ Exp(1), shared; --samples draws)

The first is the acceptance of a draft that samples its guess from ``q`` and is verified by rejection
sampling ("acceptance": "rejection", the default); the second of a draft that samples with the target's own
exponentials and is verified by matching ("acceptance": "coupled"), whose output equals plain seeded
sampling. ``(1 - TV) / (1 + TV)`` is the known lower bound of the coupled one. Both are per guess, for the
first guess after an accepted context; one forward of each model over each whole text measures them, so
this takes seconds where running the engines would take minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_spec import truncated_draft  # noqa: E402
from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.kernels.sampling import probs_from_logits  # noqa: E402
from nanospec.model.embedded import embedded_model_path  # noqa: E402
from nanospec.model.forward_batch import build_forward_batch  # noqa: E402


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` logits after every prefix of ``ids`` (one prefill, in blocks that are freed again)."""
    engine = llm.engine
    table: list[int] = []
    engine.block_manager.reserve(table, len(ids))
    try:
        batch = build_forward_batch([ids], [0], [table], engine.block_manager.block_size, [list(range(len(ids)))],
                                    llm.device)
        return llm.model.compute_logits(llm.model.forward(batch, engine.kv_cache)).float()
    finally:
        engine.block_manager.free(table)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 12, 24], help="draft = the target's first N layers")
    p.add_argument("--prompts", default=str(HERE / "prompts.jsonl"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--samples", type=int, default=512, help="exponential draws per position for the coupled rate")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)

    model = embedded_model_path()
    target = LLM(str(model), dtype="float32", num_blocks=512)
    tok = target.tokenizer
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": x["prompt"]}])) for x in prompts]
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=i)
              for i in range(len(prompts))]
    outputs = target.generate(prompt_ids, params)  # the target's own continuations
    texts = [(ids, out.outputs[0].token_ids) for ids, out in zip(prompt_ids, outputs)]
    n = len(texts)
    temperature = torch.tensor([args.temperature])
    top_p = torch.tensor([args.top_p])
    top_k = torch.tensor([-1])

    def dists(llm, ids, cont):
        logits = all_logits(llm, ids + cont)[len(ids) - 1: len(ids) + len(cont) - 1]  # predicting each cont token
        rows = logits.shape[0]
        return probs_from_logits(logits, temperature.expand(rows), top_k.expand(rows), top_p.expand(rows))

    target_probs = [dists(target, ids, cont) for ids, cont in texts]
    print(f"SmolLM2-135M-Instruct target, fp32, temperature {args.temperature}, top-p {args.top_p}; "
          f"{n} prompts x up to {args.max_tokens} positions; coupled rate from {args.samples} draws per position")
    print(f"{'draft':<12} {'positions':>9} {'rejection':>10} {'coupled':>8} {'bound':>8}")
    results = {}
    for layers in args.layers:
        draft = LLM(str(truncated_draft(model, layers)), dtype="float32", num_blocks=512)
        rejection, coupled, bound, count = 0.0, 0.0, 0.0, 0
        for (ids, cont), probs_p in zip(texts, target_probs):
            probs_q = dists(draft, ids, cont)
            overlap = torch.minimum(probs_p, probs_q).sum(dim=-1)  # 1 - TV
            tv = 1 - overlap
            for pp, qq in zip(probs_p, probs_q):
                support = ((pp > 0) | (qq > 0)).nonzero().squeeze(1)
                e = torch.empty(args.samples, support.numel()).exponential_()
                same = (pp[support] / e).argmax(dim=1) == (qq[support] / e).argmax(dim=1)
                coupled += same.float().mean().item()
            rejection += overlap.sum().item()
            bound += ((1 - tv) / (1 + tv)).sum().item()
            count += overlap.numel()
        results[layers] = dict(positions=count, rejection=rejection / count, coupled=coupled / count,
                               bound=bound / count)
        r = results[layers]
        print(f"{layers:>2} layers    {count:>9} {r['rejection']:>10.3f} {r['coupled']:>8.3f} {r['bound']:>8.3f}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
