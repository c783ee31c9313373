"""An MLP speculator's guesses beside the target's tokens, step by step, for one prompt.

    python examples/07_mlp_speculator.py [--speculator PATH] [--max-tokens N] [--prompt TEXT]

The MLP speculator (IBM's MLPSpeculator, the format vLLM loads as ``mlp_speculator``) needs no forward of the
target of its own. The target's forward already computed its final hidden state h at the position whose logits
drew the last token t; from (h, t) stage 1 guesses the next token, stage 2 the one after from stage 1's state
and guess, and so on: a few small matrix products each. The next target forward verifies the k guesses at once
and keeps the longest prefix it agrees with, plus one token of its own (the correction, or a bonus token when
every guess was right).

Each line below is one target step: the guesses of stages 1..k, marked ok (accepted), NO (the first one the
target disagreed with) or -- (after a rejection: not reached), then the tokens the target emitted. At the end,
per stage: how often its guess was accepted, out of the steps it proposed one, and out of the steps that
reached it (every earlier stage accepted). Greedy, k=3, every guess verified (``"adaptive": False``). The
default speculator is the one shipped for the embedded SmolLM2 (``nanospec/speculators/smollm2-135m-instruct``).
"""

import argparse
import sys

from nanospec import LLM, SamplingParams
from nanospec.speculative.mlp import SHIPPED_FOR_EMBEDDED

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--speculator", default=None, help=f"MLP speculator directory (default: {SHIPPED_FOR_EMBEDDED})")
p.add_argument("--max-tokens", type=int, default=48)
p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
args = p.parse_args()
if args.speculator is None and not (SHIPPED_FOR_EMBEDDED / "config.json").is_file():
    sys.exit(f"the MLP speculator shipped for the embedded SmolLM2 is missing ({SHIPPED_FOR_EMBEDDED}); "
             f"pass --speculator PATH (python -m nanospec.train trains one)")

K = 3
# the chain of its stages, every guess verified (served as shipped it is a beam of 16 + prompt lookup, whose
# nodes the goodput policy picks: per-stage acceptance is clearest on the chain)
config = {"method": "mlp_speculator", "num_speculative_tokens": K, "adaptive": False, "tree_top_k": 1,
          "prompt_lookup": False}
if args.speculator is not None:
    config["model"] = args.speculator
llm = LLM(speculative_config=config)
tok = llm.tokenizer
prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]))
params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

# Listen in on the proposer: keep the guesses it makes for our one request each step.
proposer = llm.engine.speculator.proposer
propose = proposer.propose
guesses: list[int] = []


def propose_and_record(seqs, ks):
    proposals = propose(seqs, ks)
    guesses[:] = proposals[0].token_ids if proposals else []
    return proposals


proposer.propose = propose_and_record

engine = llm.engine
request = engine.add_request(prompt, params)
seq = engine.sequences[request]
proposed, accepted, reached = [0] * K, [0] * K, [0] * K
show = lambda t: repr(tok.decode([t]))  # noqa: E731
print(f"prompt: {args.prompt!r}\n")
print(f"{'step':>4}  " + "".join(f"{f'stage {i + 1}':<19}" for i in range(K)) + "target emitted")
step = 0
while not seq.is_finished:
    guesses.clear()
    before, accepted_before = seq.num_tokens, seq.num_accepted_tokens
    engine.step()
    step += 1
    emitted = seq.token_ids[before:]
    num_accepted = seq.num_accepted_tokens - accepted_before
    cells = []
    for i, guess in enumerate(guesses):
        mark = "ok" if i < num_accepted else "NO" if i == num_accepted else "--"
        proposed[i] += 1
        reached[i] += i <= num_accepted
        accepted[i] += i < num_accepted
        cells.append(f"{show(guess)[:15]:>15} {mark}")
    row = "".join(f"{c:<19}" for c in cells) or ("(prefill: no guesses)" if step == 1 else "(no guesses)")
    print(f"{step:>4}  {row:<{19 * K}}" + " ".join(show(t) for t in emitted))
engine.pop_finished(request)

print("\nper stage: accepted / proposed, and accepted / reached (every earlier stage accepted)")
for i in range(K):
    rate = accepted[i] / proposed[i] if proposed[i] else 0.0
    conditional = accepted[i] / reached[i] if reached[i] else 0.0
    print(f"  stage {i + 1}: {accepted[i]:>3} / {proposed[i]:<3} ({rate:5.1%})    {accepted[i]:>3} / {reached[i]:<3} "
          f"({conditional:5.1%})")
plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens, speculate=False))[0].outputs[0]
tau = (seq.num_output_tokens - 1) / max(seq.num_steps - 1, 1)  # tokens per target step after the prefill
print(f"\n{seq.num_output_tokens} tokens in {seq.num_steps} target steps (tau {tau:.2f}); identical to plain "
      f"greedy decoding: {plain.token_ids == seq.output_token_ids}")
