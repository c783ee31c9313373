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


def token_logprobs(tokens: list[int], slots: range, values: list[list], num_top: int, k: int) -> list[TokenLogprob]:
    """The host side of :func:`gather_logprobs`: a ``TokenLogprob`` (with ``k <= num_top`` top entries) for each
    slot ``i`` in ``slots`` of the gathered ``values`` (read back as lists), whose token is ``tokens[i]``."""
    logprob, top_values, top_ids = values
    return [TokenLogprob(tokens[i], logprob[i], list(zip(top_ids[i * num_top: i * num_top + k],
                                                         top_values[i * num_top: i * num_top + k])))
            for i in slots]
