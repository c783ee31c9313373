"""How close the quantized embedded model is to its float32 self: teacher-forced top-1 agreement and greedy texts.

    python benchmarks/quant_accuracy.py                   # every benchmark prompt, 128 tokens
    python benchmarks/quant_accuracy.py --limit 4 --show 2

The reference is the GGUF dequantized to float32 (``quantization=None``). For every prompt it generates greedily;
each quantized variant then reads the prompt and that very continuation in one prefill (teacher forcing), and at
every continuation position its top-1 token is compared with the reference's. Reported per variant: the share of
positions whose top-1 agrees, the mean KL divergence of its next-token distribution from the reference's, and how
many prompts give the same greedy text. Variants (``LLM(quantization=...)``):

    auto      the default: the file's 4-bit blocks kept as int4, its Q8_0 embedding and head as int8 per channel
    int4      the same, the head rounded to int4 in groups of 32 as well
    int8      every matrix int8 per output channel
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.model.forward_batch import build_forward_batch  # noqa: E402

HERE = Path(__file__).resolve().parent
VARIANTS = ("auto", "int4", "int8")


def teacher_forced_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Float32 logits after every prefix of ``ids`` (``[len(ids), vocab]``), one prefill in blocks freed after."""
    table: list[int] = []
    blocks = llm.engine.block_manager
    blocks.reserve(table, len(ids))
    try:
        batch = build_forward_batch([ids], [0], [table], blocks.block_size, [list(range(len(ids)))], "cpu")
        return llm.model.compute_logits(llm.model.forward(batch, llm.engine.kv_cache)).float()
    finally:
        blocks.free(table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=str(HERE / "prompts.jsonl"))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--show", type=int, default=0, help="print the greedy texts of the first N prompts")
    args = p.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit] if args.limit else prompts
    reference = LLM(quantization=None, max_num_seqs=1, max_model_len=4096)
    tokenizer = reference.tokenizer
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                            add_generation_prompt=True)) for q in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    ref_out = [o.outputs[0].token_ids for o in reference.generate(chats, greedy)]
    ref_logits = [teacher_forced_logits(reference, ids + out)[len(ids) - 1:-1] for ids, out in zip(chats, ref_out)]
    print(f"{len(prompts)} prompts, {sum(map(len, ref_out))} reference tokens (float32, greedy)")
    print(f"{'variant':8s} {'weights':32s} {'top-1 agreement':>16s} {'mean KL':>9s} {'same greedy text':>17s}")
    texts = {"float32": [tokenizer.decode(o) for o in ref_out]}
    for variant in args.variants:
        llm = LLM(quantization=variant, max_num_seqs=1, max_model_len=4096)
        agree = total = 0
        kl = 0.0
        for ids, out, ref in zip(chats, ref_out, ref_logits):
            logits = teacher_forced_logits(llm, ids + out)[len(ids) - 1:-1]
            agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            total += len(out)
            kl += float(torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                                   reduction="sum"))
        outs = [o.outputs[0].token_ids for o in llm.generate(chats, greedy)]
        texts[variant] = [tokenizer.decode(o) for o in outs]
        same = sum(a == b for a, b in zip(outs, ref_out))
        print(f"{variant:8s} {llm.model.quantization:32s} {agree / total:16.4f} {kl / total:9.4f} "
              f"{same:>10d}/{len(prompts)}")
    for i in range(min(args.show, len(prompts))):
        print(f"\n--- prompt {i}: {prompts[i][:80]!r}")
        for name, variant_texts in texts.items():
            print(f"[{name}] {variant_texts[i]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
