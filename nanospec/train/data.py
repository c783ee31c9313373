"""Training data: the prompt set, which prompts are held out, and teacher-forced examples from recordings.

Stage ``i`` learns token ``t+2+i`` from ``(h_t, tokens t+1 .. t+1+i)``: an example is a recorded position ``t`` with
its hidden state, the ``n_predict`` tokens after it (inputs) and the ``n_predict`` after those (targets, ``IGNORE``
past the end of the continuation).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from nanospec.train.record import Recording

PROMPT_SET = Path(__file__).with_name("prompts.jsonl")
IGNORE = -100


def load_prompt_set(path: str | os.PathLike) -> list[dict]:
    """``{"category", "prompt"}`` rows of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt set not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{number}: each line must be an object with a non-empty string 'prompt'")
        rows.append({"category": str(row.get("category", "")), "prompt": row["prompt"]})
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows


def encode_chat(tokenizer, text: str) -> list[int]:
    """A user prompt through the chat template, as ``benchmarks/bench_spec.py`` encodes it."""
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


@dataclass
class Examples:
    """Teacher-forced examples: ``hidden[rows]``, ``inputs`` ``[N, n]`` (tokens t+1 ..), ``targets`` ``[N, n]``
    (tokens t+2 .., ``IGNORE`` past the end)."""
    hidden: torch.Tensor   # [M, emb_dim] float16, shared storage
    rows: torch.Tensor     # [N] int64 into hidden
    inputs: torch.Tensor   # [N, n_predict] int64
    targets: torch.Tensor  # [N, n_predict] int64

    def __len__(self) -> int:
        return int(self.rows.numel())


def held_out_prompts(rows: list[dict], every: int) -> list[int]:
    """Every ``every``-th prompt of each category (rows without one form a category of their own), counted in
    the set's order from the middle of the first ``every``: each category is held out alike, however the set
    interleaves them (every 10th of a set cycling through 8 categories would hold out only 4 of them)."""
    if not every:
        return []
    seen: dict[str, int] = defaultdict(int)
    held_out = []
    for i, row in enumerate(rows):
        category = row.get("category", "")
        if seen[category] % every == every // 2:
            held_out.append(i)
        seen[category] += 1
    return held_out


def sequences_of(recording: Recording, prompts: list[int]) -> list[int]:
    """The recording's sequences that continue one of ``prompts`` (indices into the prompt set)."""
    wanted = set(prompts)
    return [s for s, p in enumerate(recording.prompt_index.tolist()) if p in wanted]


def make_examples(recording: Recording, prompts: list[int], n_predict: int, prompt_text: bool = False) -> Examples:
    """Every position t of the continuations of ``prompts`` whose first target exists (with ``prompt_text``, the
    recorded positions of the prompts themselves too)."""
    rows, inputs, targets = [], [], []
    tokens = recording.tokens
    for s in sequences_of(recording, prompts):
        start, end = int(recording.offsets[s]), int(recording.offsets[s + 1])
        n = end - start
        if n < 2:
            continue
        padded = torch.cat([tokens[start:end], torch.full((n_predict + 1,), IGNORE, dtype=torch.int64)])
        j = torch.arange(0 if prompt_text else int(recording.generated_from[s]), n - 1)
        window = padded[j[:, None] + torch.arange(n_predict + 1)]  # tokens j .. j+n_predict
        rows.append(start + j)
        inputs.append(window[:, :n_predict].clamp(min=0))  # past the end: any token (its target is ignored)
        targets.append(window[:, 1:])
    if not rows:
        empty = torch.zeros((0, n_predict), dtype=torch.int64)
        return Examples(recording.hidden, torch.zeros(0, dtype=torch.int64), empty, empty)
    return Examples(recording.hidden, torch.cat(rows), torch.cat(inputs), torch.cat(targets))


def concat_examples(parts: list[Examples]) -> Examples:
    parts = [p for p in parts if len(p)]
    hidden = torch.cat([p.hidden for p in parts])
    shifts = torch.tensor([0] + [p.hidden.shape[0] for p in parts[:-1]]).cumsum(0)
    return Examples(hidden, torch.cat([p.rows + shift for p, shift in zip(parts, shifts.tolist())]),
                    torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]))


def hot_vocabulary(recordings: list[Recording], prompts: list[int], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of the continuations of ``prompts`` (ties: the smaller id; tokens never
    seen fill up by id), in that order."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for recording in recordings:
        for s in sequences_of(recording, prompts):
            counts += torch.bincount(recording.tokens[int(recording.offsets[s]):int(recording.offsets[s + 1])],
                                     minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(order[:size], dtype=torch.int64)
