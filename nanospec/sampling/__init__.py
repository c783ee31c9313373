"""How a token is chosen: plain sampling, for a decode step and every node of a speculative step alike.

Row ``j`` of sequence ``i`` draws the token after ``paths[i][j]`` (the guessed tokens above it) at position
``num_tokens + len(path)``, exactly as plain decoding would had the path been emitted: ``penalties.py`` (the
``min_tokens`` ban, repetition / frequency / presence over prompt, output and path), ``tensors.py`` (argmax, or the
exponential race at (seed, position)), ``logprobs.py`` (from the raw logits).
"""
