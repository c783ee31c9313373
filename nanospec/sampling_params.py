"""How to sample one request; validated on construction so bad values fail before any work."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling settings of one request (vLLM-shaped).

    temperature: 0 means greedy (argmax). top_k: -1 keeps every token. top_p: nucleus mass in (0, 1].
    seed: per-request seed; the same seed gives the same tokens, on any backend and batch.
    stop: strings that end generation (not included in the text). speculate: False opts this
    request out of speculative decoding.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    speculate: bool = True
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_list = stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
