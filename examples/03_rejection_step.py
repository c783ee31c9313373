"""One speculative verification step, by hand, on a six-word vocabulary.

    python examples/03_rejection_step.py

The context is "the"; a draft model guessed three tokens, "cat sat a", with its distributions q. The
target model scored the same positions with its distributions p (one more row: the bonus position).
Each draft is accepted with probability min(1, p/q); the first rejected one is replaced by a token drawn
from the residual norm(max(p - q, 0)), which is exactly what makes the emitted tokens follow p. The walk
below uses the same random numbers as the kernel (uniform(seed, position, index)) and checks that
tree_rejection_sample, given the chain as a tree (node i's parent is node i - 1), emits the same tokens
(its Triton kernel on a GPU, its PyTorch reference on CPU).
"""

import argparse

import torch

from nanospec.kernels.random import uniform_ref
from nanospec.kernels.tree_rejection import tree_rejection_sample

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

WORDS = ["the", "cat", "sat", "on", "a", "down"]
V = len(WORDS)
SEED = 8  # the request's seed; the first verified token sits at position OFFSET of the sequence
OFFSET = 1

#                    the   cat   sat   on    a     down
q = torch.tensor([[0.02, 0.80, 0.05, 0.03, 0.05, 0.05],  # the draft model after "the"
                  [0.05, 0.02, 0.75, 0.08, 0.05, 0.05],  # after "the cat"
                  [0.05, 0.05, 0.05, 0.20, 0.60, 0.05]])  # after "the cat sat"
p = torch.tensor([[0.10, 0.60, 0.10, 0.05, 0.10, 0.05],  # the target model after "the"
                  [0.05, 0.05, 0.70, 0.10, 0.05, 0.05],  # after "the cat"
                  [0.05, 0.02, 0.03, 0.55, 0.10, 0.25],  # after "the cat sat"
                  [0.05, 0.50, 0.05, 0.05, 0.05, 0.30]])  # after "the cat sat a" (bonus, if all accepted)
drafts = [WORDS.index(w) for w in ("cat", "sat", "a")]
k = len(drafts)


def show(name, dist):
    print(f"  {name:<9}" + "  ".join(f"{w}={x:.3f}" for w, x in zip(WORDS, dist.tolist())))


def exponential_race(weights, position):
    """Draw from weights (any scale): argmax_v w_v / E_v with E_v = -log(uniform(seed, position, v)) ~ Exp(1)."""
    u = uniform_ref(SEED, position, torch.arange(V))
    exponential = -torch.log(u.double()).float()
    scores = weights / exponential
    print("  race     " + "  ".join(f"{w}={s:.3f}" for w, s in zip(WORDS, scores.tolist())) + "   (w / E)")
    return int(scores.argmax())


print(f'context "the", drafts {[WORDS[d] for d in drafts]}, seed {SEED}\n')
emitted = []
for i, d in enumerate(drafts):
    print(f"position {i}: draft '{WORDS[d]}'")
    show("p", p[i])
    show("q", q[i])
    ratio = (p[i, d] / q[i, d]).item()
    u = uniform_ref(SEED, OFFSET + i, V).item()  # index V: the acceptance number, apart from the race's 0..V-1
    print(f"  accept with probability min(1, p/q) = min(1, {p[i, d]:.2f}/{q[i, d]:.2f}) = {min(ratio, 1):.3f}")
    if u < ratio:
        print(f"  u = {u:.3f} < {min(ratio, 1):.3f}: accept '{WORDS[d]}'\n")
        emitted.append(d)
        continue
    print(f"  u = {u:.3f} >= {ratio:.3f}: reject '{WORDS[d]}'")
    residual = (p[i] - q[i]).clamp_min(0)
    show("residual", residual / residual.sum())
    print("  (max(p - q, 0), normalised: only words the draft under-proposed can replace the rejected one)")
    token = exponential_race(residual, OFFSET + i)
    print(f"  recovered token '{WORDS[token]}'; the step stops here\n")
    emitted.append(token)
    break
else:
    print(f"position {k}: all {k} drafts accepted, bonus token from p")
    show("p", p[k])
    token = exponential_race(p[k], OFFSET + k)
    print(f"  bonus token '{WORDS[token]}'\n")
    emitted.append(token)

device = "cuda" if torch.cuda.is_available() else "cpu"
# the chain as a tree: node 0 is the root ("the"), node i the draft d_i under node i - 1; node i's draft row
# is the q that proposed it
node_tokens = torch.tensor([[-1] + drafts], device=device)
parents = torch.arange(-1, k, device=device)[None]
node_q = torch.cat([torch.zeros(1, V), q])[None].to(device)
_, out = tree_rejection_sample(p[None].to(device), node_tokens, parents, torch.tensor([k + 1], device=device), node_q,
                               seeds=torch.tensor([SEED], device=device), offsets=torch.tensor([OFFSET], device=device))
print("by hand:               ", " ".join(WORDS[t] for t in emitted))
print("tree_rejection_sample: ", out[0].tolist(), "->", " ".join(WORDS[t] for t in out[0].tolist() if t >= 0))
assert out[0, : len(emitted)].tolist() == emitted and (out[0, len(emitted) :] == -1).all()
print(f'the sequence is now "the {" ".join(WORDS[t] for t in emitted)}": {len(emitted)} tokens from one target pass')
