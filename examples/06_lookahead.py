"""The tokens, positions and attention mask of one lookahead decoding step (W=5, N=4, G=2), then a
real prompt decoded with it, showing n-grams entering the pool and being accepted.

    python examples/06_lookahead.py [mask.png]

The last committed token (the root, token 42 at position P) is fed with two branches. The verification
branch is a trie of the pool's candidate 3-grams that followed 42 before: here "7 8 9" and "7 8 5" share
"7 8". The lookahead branch is the 2-D window: level l, column c sits at position P + l + c, column 0 of
level 0 being the root itself. A window token sees the root, level 0 up to its column and its own column
in the levels below it, so it reads a left-to-right text; the target's argmax there guesses the next
position, and each column plus that guess becomes a new 4-gram for the pool. The branches never see each
other. With a PNG path and matplotlib installed, the mask is also drawn to that file.
"""

import argparse

from nanospec.kernels.attention_mask import unpack_mask
from nanospec.speculative.lookahead import LookaheadDecoder
from nanospec.speculative.proposal import tree_depths, tree_mask

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("png", nargs="?", help="draw the mask to this PNG file (needs matplotlib)")
args = p.parse_args()

W, N, G = 5, 4, 2
ROOT = 42

decoder = LookaheadDecoder(window_size=W, ngram_size=N, guess_set_size=G)
# A made-up prompt whose 4-grams seed the pool: 42 was followed by "7 8 9", later by "7 8 5".
state = decoder.new_state([42, 7, 8, 9, 1, 42, 7, 8, 5, 3])
# A window in its steady state (after warm-up): level 0 holds columns 1..W-1, levels 1..N-2 columns 0..W-1.
state.levels = [[10, 11, 12, 13], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34]]
step = decoder.build_step(state, ROOT)

labels = ["root"] + [f"v{i}" for i in range(1, step.num_tree_nodes)]
labels += [f"l{level}c{column}" for level, tokens in enumerate(state.levels)
           for column in range(1 if level == 0 else 0, len(tokens) + (1 if level == 0 else 0))]
n = len(step.tokens)
visible = unpack_mask(tree_mask(step.parents), n)  # a row sees its ancestors and itself
positions = tree_depths(step.parents)  # P + depth

print(f"W={W} N={N} G={G}: {n} new tokens ({step.num_tree_nodes} root + verification, "
      f"{len(step.lookahead_rows)} lookahead); pool[{ROOT}] = {state.candidates(ROOT)}")
print(f"verification parents: {step.parents[:step.num_tree_nodes]}\n")
header = " " * 20 + "".join(f"{i // 10 if i >= 10 else ' ':>2}" for i in range(n))
print(header)
print(f"{'row':>3} {'label':<6} {'pos':>4} {'tok':>4} " + "".join(f"{i % 10:>2}" for i in range(n)))
for row in range(n):
    cells = "".join(" x" if visible[row, col] else " ." for col in range(n))
    print(f"{row:>3} {labels[row]:<6} {'P+' + str(positions[row]):>4} {step.tokens[row]:>4} {cells}")

if args.png:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\nmatplotlib is not installed: no PNG written")
    else:
        fig, ax = plt.subplots(figsize=(8, 8))
        ax.imshow(visible.numpy(), cmap="Blues")
        ax.set_xticks(range(n), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(n), [f"{lab} (P+{p})" for lab, p in zip(labels, positions)], fontsize=7)
        ax.set_title(f"lookahead step mask, W={W} N={N} G={G} (row sees column)")
        fig.tight_layout()
        fig.savefig(args.png, dpi=150)
        print(f"\nwrote {args.png}")

# ---------------------------------------------------------------- the same layout, running on a real prompt
print(f"\nRunning the embedded SmolLM2 with lookahead decoding (W={W}, N={N}, G={G}), greedy:")
from nanospec import LLM, SamplingParams  # noqa: E402

# "adaptive": False feeds the window at every step; by default the goodput policy feeds it only beside guesses that pay
llm = LLM(speculative_config={"method": "lookahead", "window_size": W, "ngram_size": N, "guess_set_size": G,
                              "adaptive": False})
question = "Repeat this sentence three times: the quick brown fox jumps over the lazy dog."
prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": question}]))
engine = llm.engine
request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=48))
seq = engine.sequences[request]
step_no = 0
while not seq.is_finished:
    before = seq.num_tokens
    pool_before = sum(len(v) for v in seq.spec_state.pool.values())
    engine.step()
    step_no += 1
    pool_after = sum(len(v) for v in seq.spec_state.pool.values()) if seq.spec_state else pool_before
    new = seq.token_ids[before:]
    print(f"step {step_no:>2}: +{len(new)} token(s) {llm.tokenizer.decode(new)!r:<28} pool {pool_before:>3} -> "
          f"{pool_after:>3} n-grams" + ("   <- n-gram accepted" if len(new) > 1 else ""))
engine.pop_finished(request)
plain = LLM().generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]
print(f"\n{seq.num_output_tokens} tokens in {seq.num_steps} target steps "
      f"(tau {(seq.num_output_tokens - 1) / max(seq.num_steps - 1, 1):.2f}); identical to plain greedy decoding: "
      f"{plain.token_ids == seq.output_token_ids}")
