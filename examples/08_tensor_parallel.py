"""One model split over 2 processes (tensor parallelism), started by the LLM itself or by torchrun.

    python examples/08_tensor_parallel.py                        # LLM(...) spawns its worker (rank 1)
    torchrun --nproc-per-node 2 examples/08_tensor_parallel.py   # torchrun starts both ranks
    python examples/08_tensor_parallel.py --model PATH --draft DRAFT_PATH --draft-tp 1

Rank 0 (the driver) runs the engine and its half of every layer; rank 1 holds the other half of the heads and of
the MLP and joins each step's all-reduces (gloo on a CPU, NCCL with one GPU per rank). Under torchrun every rank
runs this same script: on rank 1, ``LLM(...)`` serves as the worker and exits the process when the driver shuts
down, so only rank 0 gets past it. Across machines, the same script with torchrun's ``--nnodes`` /
``--rdzv-endpoint`` options.

The output is the same tokens as on one process (checked below). Without ``--model`` the model has random weights
(the text is noise) in a shape 2 divides: SmolLM2-135M's 9 heads do not split over 2 ranks. On a 2-core CPU two
ranks are no faster than one (see benchmarks/RESULTS.md); tensor parallelism is for models larger than one GPU.
"""

import argparse

from nanospec import LLM, SamplingParams

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)


def build(args, tensor_parallel_size: int, draft_tp: int | None = None) -> LLM:
    kwargs = dict(tensor_parallel_size=tensor_parallel_size, num_blocks=128, max_model_len=512, dtype="float32",
                  device="cpu" if args.cpu else None)
    if args.draft:
        kwargs["speculative_config"] = {"method": "draft", "model": args.draft, "num_speculative_tokens": 3}
        if draft_tp is not None:
            kwargs["speculative_config"]["draft_tensor_parallel_size"] = draft_tp
    if args.model:
        return LLM(args.model, **kwargs)
    return LLM.with_random_weights(SHAPE, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Llama (HF directory or .gguf) whose heads 2 divides; default: random")
    parser.add_argument("--draft", help="a draft model (same vocabulary) for speculative decoding")
    parser.add_argument("--draft-tp", type=int, default=None, help="the draft's ranks: 1 or 2 (default 2)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo) even where there are GPUs")
    args = parser.parse_args()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    with build(args, 2, args.draft_tp) as llm:  # under torchrun, rank 1 never returns from here
        split = llm.generate(prompts, params)
        stats = llm.stats()
    whole = build(args, 1).generate(prompts, params)  # the same model on this one process
    split_tokens = [out.outputs[0].token_ids for out in split]
    for out in split:
        print(repr(out.outputs[0].text))
    print(f"{stats['num_steps']} steps, {stats['forward_seconds']:.2f} s in target forwards")
    print("same tokens as tensor_parallel_size=1:", split_tokens == [out.outputs[0].token_ids for out in whole])


if __name__ == "__main__":
    main()
