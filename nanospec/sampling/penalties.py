"""What plain decoding does to a row of logits before it draws: ``allowed_token_ids``, ``bad_words``,
``min_tokens``, ``logit_bias`` and the penalties, in that order (vLLM's).

Tokens outside ``allowed_token_ids`` get ``-inf``; a bad word's last token gets ``-inf`` in a row whose output (and
path, under speculation) ends with the rest of the word; a row whose token would be output token number
``< min_tokens`` gets ``-inf`` at its stop tokens; ``logit_bias[v]`` is added to ``l_v``. Penalties (vLLM's and
OpenAI's), with ``c_v`` the count of ``v`` in the output followed by the row's path, ``seen_v`` whether ``v`` is in
the prompt or that output:

    l_v = l_v / r   if seen_v and l_v > 0        (r = repetition_penalty; 1 is off)
    l_v = l_v * r   if seen_v and l_v <= 0
    l_v = l_v - frequency_penalty * c_v - presence_penalty * [c_v > 0]
"""

from __future__ import annotations

import torch

from nanospec.sequence import Sequence


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """vLLM's reading of ``bad_words``: each word's tokens alone and, where a leading space gives a different first
    token and as many tokens, after a space too (the word in the middle of a text). Raises ValueError, naming the
    word, for a token outside the model's vocabulary."""
    ids: list[list[int]] = []
    for word in words:
        alone, spaced = tokenizer.encode(word.lstrip()), tokenizer.encode(" " + word.lstrip())
        variants = [alone] + ([spaced] if spaced and spaced[0] != alone[0] and len(spaced) == len(alone) else [])
        if any(not 0 <= t < vocab_size for tokens in variants for t in tokens):
            raise ValueError(f"bad_words: {word!r} has a token outside the vocabulary [0, {vocab_size})")
        ids += variants
    return ids


def ban_bad_words(logits: torch.Tensor, seqs: list[Sequence], seq_rows: list[list[int]],
                  paths: list[list[list[int]]]) -> None:
    """``logits[row, word[-1]] = -inf`` for every bad word whose other tokens end the output of ``seqs[i]`` followed
    by ``paths[i][j]`` (row ``seq_rows[i][j]``); a one-token word is banned everywhere."""
    rows, cols = [], []
    for seq, srows, spaths in zip(seqs, seq_rows, paths):
        if not seq.bad_words_token_ids:
            continue
        longest = max(len(word) for word in seq.bad_words_token_ids) - 1
        output = seq.output_token_ids[-longest:] if longest else []  # all a prefix can reach
        for row, path in zip(srows, spaths):
            past = output + path
            for word in seq.bad_words_token_ids:
                prefix = word[:-1]
                if len(prefix) <= len(past) and past[len(past) - len(prefix):] == prefix:
                    rows.append(row)
                    cols.append(word[-1])
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")


def ban_stop_tokens_before_min_tokens(logits: torch.Tensor, seqs: list[Sequence], seq_rows: list[list[int]],
                                      depths: list[list[int]]) -> None:
    """``logits[row, stop token] = -inf`` for every row whose token would come before ``min_tokens``."""
    rows, cols = [], []
    for seq, seq_row, seq_depths in zip(seqs, seq_rows, depths):
        missing = seq.params.min_tokens - seq.num_output_tokens
        if missing <= 0 or not seq.stop_token_ids:
            continue
        for row, depth in zip(seq_row, seq_depths):
            if depth < missing:
                rows += [row] * len(seq.stop_token_ids)
                cols += seq.stop_token_ids
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")


def keep_allowed_tokens(logits: torch.Tensor, seqs: list[Sequence], seq_rows: list[list[int]]) -> None:
    """``logits[row, v] = -inf`` for every token ``v`` outside the ``allowed_token_ids`` of the row's sequence."""
    for seq, seq_row in zip(seqs, seq_rows):
        allowed = seq.params.allowed_token_ids
        if allowed is not None and seq_row:
            banned = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            banned[torch.tensor(allowed, device=logits.device)] = False
            rows = torch.tensor(seq_row, device=logits.device)
            logits[rows] = logits[rows].masked_fill(banned, float("-inf"))


def add_logit_bias(logits: torch.Tensor, seqs: list[Sequence], seq_rows: list[list[int]]) -> None:
    """``logits[row, v] += logit_bias[v]`` for every row of a sequence whose parameters carry a ``logit_bias``."""
    rows, cols, values = [], [], []
    for seq, seq_row in zip(seqs, seq_rows):
        bias = seq.params.logit_bias
        for row in seq_row if bias else ():
            rows += [row] * len(bias)
            cols += list(bias)
            values += list(bias.values())
    if rows:
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], seq_rows: list[list[int]],
                    paths: list[list[list[int]]]) -> None:
    """Penalize ``logits`` in place: row ``seq_rows[i][j]`` counts the output of ``seqs[i]`` followed by
    ``paths[i][j]``. Sequences without penalties are left alone."""
    rows, owners, path_rows, path_tokens, penalized = [], [], [], [], []
    for seq, srows, spaths in zip(seqs, seq_rows, paths):
        if not seq.params.has_penalties:
            continue
        for row, path in zip(srows, spaths):
            path_rows += [len(rows)] * len(path)
            path_tokens += path
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
    repetition, frequency, presence = tensor([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                                              for p in per_row], torch.float32).T[..., None]

    row_index = tensor(rows)
    x = logits[row_index].float()
    x = torch.where(in_prompt | in_output, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * counts - presence * in_output.float()
    logits[row_index] = x.to(logits.dtype)
