"""Log-probabilities of drawn tokens (``SamplingParams.logprobs``): the target's own numbers, from ``log_softmax`` of
the raw logits (before the ``min_tokens`` ban and the penalties), gathered on the device and read with the step's
tokens, so that a speculative step reports what plain decoding reports."""

from __future__ import annotations

import torch

from nanospec.outputs import TokenLogprob


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
            num_top = seq.params.prompt_logprobs
            raw = torch.log_softmax(logits[start:start + len(prompt) - 1].float(), dim=-1)
            targets = torch.tensor(prompt[1:], dtype=torch.int64, device=logits.device)
            values = [v.tolist() for v in gather_logprobs(raw, torch.arange(len(targets), device=logits.device),
                                                          targets, min(num_top, raw.shape[-1]))]
            seq.prompt_logprobs = [None] + token_logprobs(prompt[1:], range(len(targets)), values, num_top, num_top)
            start += len(prompt) - 1
        keep.extend(range(start, start + num_rows))
        start += num_rows
    index = torch.tensor(keep, dtype=torch.int64, device=logits.device)
    return logits[index], hidden[index] if hidden is not None else None


def token_logprobs(tokens: list[int], slots: range, values: list[list], num_top: int, k: int) -> list[TokenLogprob]:
    """The host side of :func:`gather_logprobs`: a ``TokenLogprob`` (with ``k <= num_top`` top entries) for each
    slot ``i`` in ``slots`` of the gathered ``values`` (read back as lists), whose token is ``tokens[i]``."""
    logprob, top_values, top_ids = values
    return [TokenLogprob(tokens[i], logprob[i], list(zip(top_ids[i * num_top: i * num_top + k],
                                                         top_values[i * num_top: i * num_top + k])))
            for i in slots]
