"""How a token is chosen: plain sampling, for a decode step and for every node of a speculative step alike.

A step's logits rows belong to sequences: sequence ``i`` owns ``seq_rows[i]``, and its row ``j`` draws the token that
follows ``paths[i][j]``, the guessed tokens between the committed text and that row (none for a decode step or a
tree's root), at position ``num_tokens + len(path)``. Each row is treated exactly as plain decoding would treat it
had the path been emitted:

    penalties.py   the stop tokens are banned while the output is shorter than ``min_tokens``; repetition,
                   frequency and presence penalties count the prompt, the output and the path
    tensors.py     the request's temperature, top-k, top-p, seed and the row's position on the device; the token is
                   the argmax (greedy) or the exponential race at (seed, position) (``nanospec.kernels.sampling``)
    logprobs.py    log-probabilities of the drawn tokens, from the raw logits (before bans and penalties)
"""
