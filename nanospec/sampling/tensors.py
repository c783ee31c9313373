"""A batch's sampling settings on the device, one entry per logits row (at ``num_tokens + depth``), and the token each
row draws."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanospec.kernels.sampling import probs_from_logits, sample
from nanospec.sequence import Sequence

_INT32_MAX = 2**31 - 1


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor        # [rows] int32
    top_p: torch.Tensor        # [rows] float32
    min_p: torch.Tensor        # [rows] float32
    seeds: torch.Tensor        # [rows] int64
    offsets: torch.Tensor      # [rows] int64

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device, *, depths: list[list[int]],
           seed_salt: int = 0) -> SamplingTensors:
        rows = [(s, s.num_tokens + d) for s, ds in zip(seqs, depths) for d in ds]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(tensor([s.params.temperature for s, _ in rows], torch.float32),
                   tensor([min(s.params.top_k, _INT32_MAX) for s, _ in rows], torch.int32),
                   tensor([s.params.top_p for s, _ in rows], torch.float32),
                   tensor([s.params.min_p for s, _ in rows], torch.float32),
                   tensor([s.seed ^ seed_salt for s, _ in rows], torch.int64),
                   tensor([position for _, position in rows], torch.int64))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution each row samples from (temperature, min-p, top-k, top-p applied)."""
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p, self.min_p)


def draw_tokens(logits: torch.Tensor, seqs: list[Sequence], depths: list[list[int]]) -> torch.Tensor:
    """The token plain decoding draws from each row (rows and depths as in :meth:`SamplingTensors.of`): the argmax
    when every request is greedy, else the exponential race at the row's (seed, position). On the device."""
    if all(s.params.greedy for s in seqs):
        return logits.argmax(dim=-1)
    t = SamplingTensors.of(seqs, logits.device, depths=depths)
    return sample(logits, t.temperature, t.top_k, t.top_p, t.seeds, t.offsets, t.min_p)
