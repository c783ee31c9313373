"""An EAGLE-3 head's teacher-forced top-1 accuracy per draft step, prompt by prompt: the trainer's unroll
(:class:`nanospec.train.eagle3.Unroller`) over the target's own greedy continuations, from position 0.

    python benchmarks/eagle3_accuracy.py                     # the shipped head, benchmarks/prompts.jsonl, 40 tokens
    python benchmarks/eagle3_accuracy.py --head DIR --prompts FILE --max-tokens 96

Step k's accuracy counts the continuation's rows whose k-th guess (earlier steps fed the true tokens) is the target's
next token; a token outside the draft vocabulary is a miss.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanospec.model.eagle3 import load_eagle3_head  # noqa: E402
from nanospec.model.embedded import embedded_model_path  # noqa: E402
from nanospec.model.llama import Llama  # noqa: E402
from nanospec.model.loader import load_checkpoint  # noqa: E402
from nanospec.train.data import IGNORE  # noqa: E402
from nanospec.train.eagle3 import Batch, Unroller, draft_vocabulary_index, step_losses  # noqa: E402
from nanospec.train.record import record  # noqa: E402

HERE = Path(__file__).resolve().parent


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", default=str(HERE.parent / "nanospec" / "speculators" / "smollm2-135m-instruct-eagle3"))
    p.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2)")
    p.add_argument("--prompts", default=str(HERE / "prompts.jsonl"))
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    checkpoint = load_checkpoint(args.model or str(embedded_model_path()), torch.float32)
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}])) for r in rows]
    target = Llama(config, checkpoint.tensors, "cpu", torch.float32, max_len=max(map(len, ids)) + args.max_tokens)
    head, aux_layers = load_eagle3_head(args.head, config, "cpu", torch.float32)
    rec = record(target, ids, list(tokenizer.eos_token_ids), max_tokens=args.max_tokens, temperature=0.0, seed=0,
                 batch=16, desc="recording", prompt_rows_from=0, aux_layers=aux_layers)
    unroller = Unroller(head, target.embed(torch.arange(config.vocab_size)).float(), args.steps,
                        int((rec.offsets[1:] - rec.offsets[:-1]).max()))
    index = draft_vocabulary_index(torch.arange(head.config.draft_vocab_size) + head.d2t.cpu(), config.vocab_size)
    print(f"{'prompt':<8}{'category':<15}" + "".join(f"{f'step {k + 1}':>8}" for k in range(args.steps)))
    for s, row in enumerate(rows):
        begin, end, first = int(rec.offsets[s]), int(rec.offsets[s + 1]), int(rec.generated_from[s])
        tokens = torch.full((1, end - begin + args.steps + 1), IGNORE)
        tokens[0, :end - begin] = rec.tokens[begin:end]
        scored = torch.zeros(1, end - begin, dtype=torch.bool)
        scored[0, first:] = True
        batch = Batch(rec.aux[begin:end].float()[None], tokens, torch.zeros_like(tokens), scored)
        _, hits, _ = step_losses(head, unroller(batch), batch, index)
        accuracy = [float(h[scored].float().mean()) for h in hits]
        print(f"{s:<8}{row.get('category', ''):<15}" + "".join(f"{a:>8.2f}" for a in accuracy))


if __name__ == "__main__":
    main()
