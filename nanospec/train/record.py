"""Recording: the target answers the prompt set, keeping for every generated token the final hidden state it came
from (what a decode or verify step hands the speculator at run time).

Generation runs many prompts at once (continuous batching over a paged KV cache, straight on the model layer);
the prefill computes the prompt's hidden states too, and past the prompts' common head (chat template, system
prompt) they are kept as well. With ``aux_layers`` (an EAGLE-3 head's), every kept row also keeps the residual stream
entering those layers (``Llama.forward``'s ``aux_layers``, what the head fuses at run time). Hidden states are stored
as float16; a recording is cached as safetensors with the settings that made it.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from nanospec.cache.kv_cache import KVCache
from nanospec.model.forward_batch import build_forward_batch
from nanospec.model.llama import Llama

BLOCK_SIZE = 16


@dataclass
class Recording:
    """Continuations of prompts: ``tokens[offsets[s]:offsets[s+1]]`` are sequence ``s``'s tokens and ``hidden``
    the same rows' final hidden states (row ``j``: the state whose logits gave, or predict, token ``j``); its
    first ``generated_from[s]`` rows are prompt text, the rest the target's continuation. ``aux``: the same rows'
    auxiliary states ``[N, len(aux_layers) * emb_dim]`` (float16), when recorded with ``aux_layers``."""
    prompt_index: torch.Tensor  # [S] int64: which prompt of the set
    offsets: torch.Tensor       # [S+1] int64
    tokens: torch.Tensor        # [N] int64
    hidden: torch.Tensor        # [N, emb_dim] float16
    generated_from: torch.Tensor  # [S] int64: rows before it are the prompt's own text (its hidden states)
    aux: torch.Tensor | None = None  # [N, 3 * emb_dim] float16

    def save(self, path: Path, metadata: dict) -> None:
        tmp = path.with_suffix(".tmp")
        aux = {} if self.aux is None else {"aux": self.aux.contiguous()}
        save_file({"prompt_index": self.prompt_index, "offsets": self.offsets, "tokens": self.tokens,
                   "hidden": self.hidden.contiguous(), "generated_from": self.generated_from, **aux}, str(tmp),
                  metadata={"info": json.dumps(metadata)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, metadata: dict) -> Recording | None:
        """The recording at ``path`` if it was made with ``metadata``, else None."""
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                stored = json.loads((handle.metadata() or {}).get("info", "null"))
            if stored != metadata:
                return None
            tensors = load_file(str(path))
            return cls(tensors["prompt_index"], tensors["offsets"], tensors["tokens"], tensors["hidden"],
                       tensors["generated_from"], tensors.get("aux"))
        except Exception:  # a cut or foreign file: record again
            return None

    @property
    def num_generated(self) -> int:
        return int(self.tokens.numel() - self.generated_from.sum())


@dataclass
class _Lanes:
    """``generate_with_hidden``'s batch: up to ``len(tables)`` sequences at once, each on a lane of KV blocks."""
    prompts: list[list[int]]
    tables: list[list[int]]
    out_tokens: list[list[int]]
    waiting: deque
    running: dict  # lane -> prompt index
    free: deque

    def next_step(self, max_prefill_tokens: int, prompt_rows_from: int | None):
        """This step's work: every running sequence decodes its last token, then waiting prompts are prefilled
        while the token budget lasts. Returns (token lists, start positions, block tables, rows wanted, (lane,
        prompt) in batch order, per prefill the prompt rows kept beyond its last)."""
        token_lists, starts, tables, rows, order, extra = [], [], [], [], [], []
        for lane, index in self.running.items():  # decode: feed the last generated token
            token_lists.append([self.out_tokens[index][-1]])
            starts.append(len(self.prompts[index]) + len(self.out_tokens[index]) - 1)
            tables.append(self.tables[lane])
            rows.append([0])
            order.append((lane, index))
        prefill_tokens = 0
        while self.waiting and self.free and (prefill_tokens == 0 or prefill_tokens
                                              + len(self.prompts[self.waiting[0]]) <= max_prefill_tokens):
            index, lane = self.waiting.popleft(), self.free.popleft()
            prompt = self.prompts[index]
            self.running[lane] = index
            prefill_tokens += len(prompt)
            token_lists.append(list(prompt))
            starts.append(0)
            tables.append(self.tables[lane])
            first = len(prompt) - 1 if prompt_rows_from is None else min(prompt_rows_from, len(prompt) - 1)
            rows.append(list(range(first, len(prompt))))
            extra.append(len(rows[-1]) - 1)
            order.append((lane, index))
        return token_lists, starts, tables, rows, order, extra


@torch.inference_mode()
def generate_with_hidden(model: Llama, prompts: list[list[int]], *, max_tokens: int, eos_ids: list[int],
                         temperature: float = 0.0, seed: int = 0, batch: int = 32, max_prefill_tokens: int = 4096,
                         prompt_rows_from: int | None = None, desc: str = "recording", aux_layers: tuple[int, ...] = (),
                         ) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """Continue every prompt (greedy at ``temperature`` 0, else sampled from ``softmax(logits / temperature)``
    with a generator seeded by ``seed``) for at most ``max_tokens`` tokens or until an eos token (kept), up to
    ``batch`` sequences at once (a finished one's place goes to the next prompt). Returns per prompt the generated
    tokens and their hidden states ``[n, hidden]`` (float16): row ``j`` is the final hidden state at the
    position whose logits gave token ``j`` (the last prompt token's for token 0); and, with ``prompt_rows_from``
    ``q``, the hidden states of the prompt's positions ``q .. len - 2`` (empty otherwise): computed by the prefill
    anyway, they cost only their final norm. With ``aux_layers``, each row holds the final hidden state followed by
    the auxiliary states at the same position (``[n, (1 + len(aux_layers)) * hidden]``)."""
    c = model.config
    blocks_per_lane = -(-(max(len(p) for p in prompts) + max_tokens) // BLOCK_SIZE)
    lanes = min(batch, len(prompts))
    kv = KVCache(c.num_hidden_layers, lanes * blocks_per_lane, BLOCK_SIZE, c.num_key_value_heads, c.head_dim,
                 model.dtype, model.device)
    tables = [list(range(lane * blocks_per_lane, (lane + 1) * blocks_per_lane)) for lane in range(lanes)]
    state = _Lanes(prompts, tables, [[] for _ in prompts], deque(range(len(prompts))), {}, deque(range(lanes)))
    generator = torch.Generator(device=model.device).manual_seed(seed)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.int64)
    out_hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
    prompt_hidden = [torch.zeros(0, (1 + len(aux_layers)) * c.hidden_size, dtype=torch.float16) for _ in prompts]
    bar = tqdm(total=len(prompts), desc=desc, unit="seq", dynamic_ncols=True, mininterval=2)
    generated = 0
    while state.waiting or state.running:
        token_lists, starts, tables, rows, order, extra = state.next_step(max_prefill_tokens, prompt_rows_from)
        batch = build_forward_batch(token_lists, starts, tables, BLOCK_SIZE, rows, model.device)
        if aux_layers:
            hidden, aux = model.forward(batch, kv, aux_layers)
            hidden = torch.cat([hidden, aux[batch.logits_indices].to(hidden.dtype)], dim=-1)
        else:
            hidden = model.forward(batch, kv)
        hidden = _keep_prompt_rows(hidden, order, extra, prompt_hidden)
        logits = model.compute_logits(hidden[:, :c.hidden_size])
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            next_tokens = logits.argmax(-1)
        hidden16 = hidden.to(torch.float16).cpu()
        next_list = next_tokens.cpu().tolist()
        ended = torch.isin(next_tokens.cpu(), eos).tolist()
        for r, (lane, index) in enumerate(order):
            state.out_tokens[index].append(next_list[r])
            out_hidden[index].append(hidden16[r])
            generated += 1
            if ended[r] or len(state.out_tokens[index]) >= max_tokens:
                del state.running[lane]
                state.free.append(lane)
                bar.update(1)
        bar.set_postfix(tokens=generated, refresh=False)
    bar.close()
    return state.out_tokens, [torch.stack(h) for h in out_hidden], prompt_hidden


def _keep_prompt_rows(hidden: torch.Tensor, order: list, extra: list[int], prompt_hidden: list) -> torch.Tensor:
    """Set aside the prefills' prompt rows but the last (kept, not scored); returns one row per sequence."""
    if not any(extra):
        return hidden
    last = torch.tensor([0] * (len(order) - len(extra)) + extra).cumsum(0) + torch.arange(len(order))
    split = hidden[:last[-1] + 1]
    for e, (lane, index), end in zip(extra, order[len(order) - len(extra):], last[len(order) - len(extra):]):
        prompt_hidden[index] = split[int(end) - e:int(end)].to(torch.float16).cpu()
    return hidden[last]


def record(model: Llama, prompt_ids: list[list[int]], eos_ids: list[int], *, prompt_index: list[int] | None = None,
           max_tokens: int, temperature: float, seed: int, batch: int, desc: str,
           prompt_rows_from: int | None = None, aux_layers: tuple[int, ...] = ()) -> Recording:
    """Record continuations (and, from ``prompt_rows_from``, the prompts' own text as leading rows; with
    ``aux_layers``, the auxiliary states too)."""
    tokens, hidden, prompt_hidden = generate_with_hidden(
        model, prompt_ids, max_tokens=max_tokens, eos_ids=eos_ids, temperature=temperature, seed=seed, batch=batch,
        desc=desc, prompt_rows_from=prompt_rows_from, aux_layers=aux_layers)
    firsts = [len(h) for h in prompt_hidden]  # prompt-text rows at the front of each sequence
    tokens = [ids[len(ids) - f:] + t if f else t for ids, t, f in zip(prompt_ids, tokens, firsts)]
    hidden = [torch.cat([p, h]) for p, h in zip(prompt_hidden, hidden)]
    lengths = torch.tensor([0] + [len(t) for t in tokens])
    index = torch.tensor(prompt_index if prompt_index is not None else range(len(tokens)), dtype=torch.int64)
    hidden, H = torch.cat(hidden), model.config.hidden_size
    return Recording(index, lengths.cumsum(0), torch.tensor([t for ts in tokens for t in ts]),
                     hidden[:, :H].contiguous(), torch.tensor(firsts, dtype=torch.int64),
                     hidden[:, H:].contiguous() if aux_layers else None)


@torch.inference_mode()
def teacher_forced_hidden(model: Llama, sequences: list[list[int]], max_tokens_per_forward: int = 4096,
                          ) -> list[torch.Tensor]:
    """The final hidden state of every position of every sequence (float32, ``[len, hidden]`` each), from
    prefill forwards over whole sequences: row ``t`` is the state whose logits give token ``t + 1``."""
    c = model.config
    out: list[torch.Tensor] = []
    i = 0
    while i < len(sequences):
        group = [sequences[i]]
        while i + len(group) < len(sequences) and \
                sum(map(len, group)) + len(sequences[i + len(group)]) <= max_tokens_per_forward:
            group.append(sequences[i + len(group)])
        blocks = [-(-len(s) // BLOCK_SIZE) for s in group]
        kv = KVCache(c.num_hidden_layers, sum(blocks), BLOCK_SIZE, c.num_key_value_heads, c.head_dim, model.dtype,
                     model.device)
        firsts = [sum(blocks[:k]) for k in range(len(group))]
        tables = [list(range(f, f + b)) for f, b in zip(firsts, blocks)]
        batch = build_forward_batch(group, [0] * len(group), tables, BLOCK_SIZE,
                                    [list(range(len(s))) for s in group], model.device)
        hidden = model.forward(batch, kv).float().cpu()
        for s in torch.split(hidden, [len(s) for s in group]):
            out.append(s)
        i += len(group)
    return out
