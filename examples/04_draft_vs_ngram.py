"""Three ways to decode one code-edit prompt: plain, n-gram lookup and a small draft model. Same tokens, different cost.

    python examples/04_draft_vs_ngram.py

Speculative decoding lets something cheap guess the next k tokens; the target checks all k guesses in ONE
forward pass and keeps the longest prefix it agrees with, plus one token of its own (the correction, or a
bonus token when every guess was right). Greedy output is therefore exactly what plain decoding gives.

tau = tokens produced per target step (after the prefill step). Plain decoding has tau = 1; a step that
accepts j guesses produces j + 1 tokens. A verify step over a few tokens costs little more than a one-token
step (the weights are read once either way), so the speedup follows tau, minus what the guessing costs.
By default the engine verifies only as many guesses per step as pay off on this machine (it times verify
passes at start-up and tracks each request's acceptance), so a poor guesser is mostly left unchecked.

The n-gram proposer guesses for free: it finds the last few generated tokens earlier in the prompt or output
and proposes what followed them there. When the answer copies its input, as a code edit that returns the
whole function does, long runs of guesses are right and tau is high. The draft here is the target cut to its
first 4 layers: it shares the tokenizer but was never trained to stop early, so it rarely agrees with the
target and its own forwards make the step dearer: a draft model pays off only when it predicts the target well.
"""

import argparse
import tempfile
import time

from nanospec import LLM, SamplingParams
from nanospec.convert import convert
from nanospec.model.embedded import embedded_model_path

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

PROMPT = """Add the line `import os` at the top of this code and return the whole code unchanged otherwise.

```python
def load_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith('#'):
                continue
            key, value = line.split('=', 1)
            config[key.strip()] = value.strip()
    return config
```"""
MESSAGES = [{"role": "user", "content": PROMPT}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=128)

print("tok/s = generated tokens / request time, prefill included")
with tempfile.TemporaryDirectory() as draft_dir:
    convert(embedded_model_path(), draft_dir, num_layers=4)  # a layer-truncated SmolLM2 as the draft
    methods = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
        "draft": {"method": "draft", "model": draft_dir, "num_speculative_tokens": 4},
    }
    outputs = {}
    for name, spec in methods.items():
        llm = LLM(speculative_config=spec)
        llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        start = time.perf_counter()
        out = llm.chat(MESSAGES, PARAMS)[0].outputs[0]
        seconds = time.perf_counter() - start
        outputs[name] = out
        first_line = next((line for line in out.text.splitlines() if line.strip()), "")
        accept = f"{out.acceptance_rate:.0%}" if out.num_draft_tokens else "-"
        print(f"{name:<6} {first_line[:40]!r:<44} tokens {len(out.token_ids):>3}  target steps {out.num_steps:>3}  "
              f"tau {out.tau:.2f}  accepted {out.num_accepted_tokens:>3}/{out.num_draft_tokens:<3} ({accept:>4})  "
              f"{len(out.token_ids) / seconds:5.1f} tok/s")
        del llm

assert outputs["ngram"].token_ids == outputs["plain"].token_ids, "n-gram speculation changed the greedy output"
assert outputs["draft"].token_ids == outputs["plain"].token_ids, "draft speculation changed the greedy output"
print("greedy outputs are identical token for token; the answer:\n")
print(outputs["plain"].text)
