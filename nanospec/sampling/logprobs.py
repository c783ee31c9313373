"""Log-probabilities of drawn tokens (``SamplingParams.logprobs``): the target's own numbers, from ``log_softmax`` of
the raw logits (before the ``min_tokens`` ban and the penalties), gathered on the device and read with the step's
tokens, so that a speculative step reports what plain decoding reports."""

from __future__ import annotations

import torch

from nanospec.outputs import TokenLogprob

PROMPT_ROWS_AT_ONCE = 1024  # prompt rows turned into log-probabilities at a time (each holds vocab_size floats)


def gather_logprobs(raw: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[torch.Tensor]:
    """On the device, for token ``tokens[i]`` drawn from row ``rows[i]`` of ``raw``: its log-probability, and the
    row's ``num_top`` largest (values, token ids), flattened: ``[M]``, ``[M * num_top]``, ``[M * num_top]``."""
    logprob = raw[rows, tokens]
    top = raw.topk(num_top, dim=-1)
    return [logprob, top.values[rows].flatten(), top.indices[rows].flatten()]


def take_prompt_logprobs(logits: torch.Tensor, hidden: torch.Tensor | None, seqs: list, rows_per_seq: list[int]
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A step's logits (and hidden states) have, for each sequence that ``needs_prompt_logprobs``, its prompt rows
    (token ``i``'s row predicts token ``i + 1``) before its ``rows_per_seq`` own. Sets those sequences'
    ``prompt_logprobs`` (None for the first token, then a ``TokenLogprob`` with ``prompt_logprobs`` top entries per
    token) and returns the logits and hidden states without the prompt rows, as the rest of the step expects."""
    keep, start = [], 0
    for seq, num_rows in zip(seqs, rows_per_seq):
        if seq.needs_prompt_logprobs:
            prompt = seq.prompt_token_ids
            seq.prompt_logprobs = _prompt_logprobs(logits[start:start + len(prompt) - 1], prompt,
                                                   seq.params.prompt_logprobs)
            start += len(prompt) - 1
        keep.extend(range(start, start + num_rows))
        start += num_rows
    index = torch.tensor(keep, dtype=torch.int64, device=logits.device)
    return logits[index], hidden[index] if hidden is not None else None


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int], num_top: int) -> list[TokenLogprob | None]:
    """``logits[i]`` predicts ``prompt[i + 1]``; log_softmax over ``PROMPT_ROWS_AT_ONCE`` rows at a time."""
    num_top = min(num_top, logits.shape[-1])
    entries: list[TokenLogprob | None] = [None]
    for first in range(0, logits.shape[0], PROMPT_ROWS_AT_ONCE):
        raw = torch.log_softmax(logits[first:first + PROMPT_ROWS_AT_ONCE].float(), dim=-1)
        tokens = prompt[first + 1:first + 1 + raw.shape[0]]
        rows = torch.arange(len(tokens), device=logits.device)
        values = [v.tolist() for v in gather_logprobs(raw, rows, torch.tensor(tokens, device=logits.device), num_top)]
        entries += token_logprobs(tokens, range(len(tokens)), values, num_top, num_top)
    return entries


def token_logprobs(tokens: list[int], slots: range, values: list[list], num_top: int, k: int) -> list[TokenLogprob]:
    """The host side of :func:`gather_logprobs`: a ``TokenLogprob`` (with ``k <= num_top`` top entries) for each
    slot ``i`` in ``slots`` of the gathered ``values`` (read back as lists), whose token is ``tokens[i]``."""
    logprob, top_values, top_ids = values
    return [TokenLogprob(tokens[i], logprob[i], list(zip(top_ids[i * num_top: i * num_top + k],
                                                         top_values[i * num_top: i * num_top + k])))
            for i in slots]
