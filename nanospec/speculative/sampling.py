"""A batch's sampling settings on the device, made once per use from its sequences' ``SamplingParams``.

``temperature``, ``top_k`` and ``top_p`` have one entry per logits row (``repeat`` rows per sequence);
``seeds`` and ``offsets`` one per sequence: the request's seed (xor a salt, for a stream of its own) and
the position of the first token drawn (``num_tokens + offset``), the counters of
:mod:`nanospec.kernels.random`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanospec.kernels.sampling import probs_from_logits
from nanospec.sequence import Sequence


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor        # [rows] int32
    top_p: torch.Tensor        # [rows] float32
    seeds: torch.Tensor        # [seqs] int64
    offsets: torch.Tensor      # [seqs] int64

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device, *, repeat: int = 1, offset: int = 0,
           seed_salt: int = 0) -> SamplingTensors:
        params = [s.params for s in seqs]

        def per_row(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device).repeat_interleave(repeat)

        return cls(per_row([p.temperature for p in params], torch.float32),
                   per_row([p.top_k for p in params], torch.int32),
                   per_row([p.top_p for p in params], torch.float32),
                   torch.tensor([s.seed ^ seed_salt for s in seqs], dtype=torch.int64, device=device),
                   torch.tensor([s.num_tokens + offset for s in seqs], dtype=torch.int64, device=device))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution each row samples from (temperature, top-k, top-p applied)."""
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)
