"""Repetition, frequency and presence penalties on the logits of a verify step, each row with its own prefix.

For one logits row, let ``c_v`` be how often token ``v`` occurs in the output so far and ``seen_v`` whether it
occurs in the prompt or the output. vLLM's (and OpenAI's) penalties, in this order:

    l_v = l_v / r   if seen_v and l_v > 0        (r = repetition_penalty; 1 is off)
    l_v = l_v * r   if seen_v and l_v <= 0
    l_v = l_v - frequency_penalty * c_v - presence_penalty * [c_v > 0]

**Under speculation** a sequence's rows are its root's and one per node of its token tree. The root's row
judges the token after the committed output; node ``j``'s row judges the token after node ``j``, so it counts
the committed output *and the tokens on the path from the root down to node j* (node j's own token
included). Each row is then exactly the row plain decoding would have penalized had that path been
emitted, so greedy and matched verification stay lossless with penalties on.

Plain torch on the device: the per-sequence counts are one scatter-add, each row's path one more; no host read.
"""

from __future__ import annotations

import torch

from nanospec.sequence import Sequence
from nanospec.speculative.proposal import Proposal


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], proposals: list[Proposal],
                    seq_rows: list[list[int]]) -> None:
    """Penalize ``logits`` in place. ``seq_rows[i]``: the rows of ``seqs[i]`` in ``logits``, its root's first and
    then one per candidate node of ``proposals[i]``, in node order. Sequences without penalties are left alone."""
    rows, owners, path_rows, path_tokens, penalized = [], [], [], [], []
    for seq, proposal, srows in zip(seqs, proposals, seq_rows):
        if not seq.params.has_penalties:
            continue
        paths = proposal.paths()
        for j, row in enumerate(srows):
            if j > 0:  # node j - 1: its path's tokens count as output
                path_rows += [len(rows)] * len(paths[j - 1])
                path_tokens += paths[j - 1]
            rows.append(row)
            owners.append(len(penalized))
        penalized.append(seq)
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]

    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    out_owner = tensor([b for b, s in enumerate(penalized) for _ in range(s.num_output_tokens)])
    out_tokens = tensor([t for s in penalized for t in s.output_token_ids])
    counts = torch.zeros(len(penalized), vocab, dtype=torch.float32, device=device)
    counts.index_put_((out_owner, out_tokens), torch.ones_like(out_tokens, dtype=torch.float32), accumulate=True)
    in_prompt = torch.zeros(len(penalized), vocab, dtype=torch.bool, device=device)
    in_prompt[tensor([b for b, s in enumerate(penalized) for _ in range(s.num_prompt_tokens)]),
              tensor([t for s in penalized for t in s.prompt_token_ids])] = True

    owner = tensor(owners)
    counts, in_prompt = counts[owner], in_prompt[owner]
    if path_rows:
        counts.index_put_((tensor(path_rows), tensor(path_tokens)),
                          torch.ones(len(path_rows), dtype=torch.float32, device=device), accumulate=True)
    in_output = counts > 0
    per_row = [penalized[b].params for b in owners]
    repetition = tensor([p.repetition_penalty for p in per_row], torch.float32)[:, None]
    frequency = tensor([p.frequency_penalty for p in per_row], torch.float32)[:, None]
    presence = tensor([p.presence_penalty for p in per_row], torch.float32)[:, None]

    row_index = tensor(rows)
    x = logits[row_index].float()
    x = torch.where(in_prompt | in_output, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * counts - presence * in_output.float()
    logits[row_index] = x.to(logits.dtype)

