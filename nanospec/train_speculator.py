"""Train an MLP speculator (:mod:`nanospec.model.mlp_speculator`) for a target model, on the target's own outputs.

    python -m nanospec.train_speculator --out DIR                 # the embedded SmolLM2, the shipped settings
    python -m nanospec.train_speculator --model M --out DIR --hot-vocab 4096 --seed 0
    python -m nanospec.train_speculator --out DIR --resume        # go on from DIR's last checkpoint

Three parts, each cached in ``DIR/cache`` (or ``--cache``) so a rerun or ``--resume`` skips what is done:

1. **Record.** The target answers every prompt of the prompt set (``nanospec/speculators/prompts.jsonl``, see
   ``make_prompts.py`` beside it; never the benchmark's prompts), each through the chat template exactly as
   ``benchmarks/bench_spec.py`` encodes a prompt: greedily, then ``--sampled-runs`` times sampled at
   ``--temperature`` (seeded) for every ``--sampled-every``-th prompt. Generation runs many prompts at once
   (continuous batching over a paged KV cache, straight on the model layer) and keeps, for every generated
   token, the target's final hidden state (after its final norm) at the position whose logits gave that token:
   exactly what a decode or verify step hands the speculator at run time, so no second pass over the text is
   needed. The prefill computes the prompt's hidden states too: past the prompts' common head (chat template,
   system prompt) they are kept as well, and phase 1 learns the prompt text from them (``--no-prompt-text``:
   not). Hidden states are stored as float16. Every core by default (``--threads``); on a busy machine use one:
   on this project's shared 2-core machine two threads waiting on each other ran the target 3x slower.
2. **Train.** Stage ``i`` learns token ``t+2+i`` from ``(h_t, tokens t+1 .. t+1+i)``, teacher-forced: phase 1 on
   the greedy continuations, phase 2 on greedy and sampled together. The loss mixes the recorded token with the
   target's own next-token distribution there (``--distill w``: ``(1 - w) * CE(token) + w * CE(softmax(lm_head @
   h_{t+1+i}))``, 0.5 by default, from the hidden states already recorded). AdamW, linear warm-up then cosine
   decay, seeded (the data order of every epoch comes from a ``torch.Generator`` seeded by (seed, phase, epoch)), so a
   run is reproducible on one machine. A held-out tenth of the prompts (their continuations) measures per-stage
   loss and top-1 accuracy after every epoch: with the true earlier tokens fed in, stage ``i``'s accuracy is the
   chance its guess is accepted given the earlier ones were, and ``tau`` (tokens per target forward at k =
   n_predict, one position) is estimated by running the stages greedily as the runtime does.
   ``--hot-vocab K`` scores only the K most frequent tokens of the recorded outputs (a target outside them is
   left out of the loss, and counted as a miss in the accuracy): guesses are one-hot, so any head stays lossless.
   Checkpoints (``DIR/checkpoint``: weights, AdamW state, step and RNG state as safetensors + JSON, never pickle)
   are written every ``--save-every`` steps, at every epoch's end and on Ctrl-C; ``--resume`` goes on from one
   and ends with exactly the weights of a straight run.
3. **Output.** ``DIR/config.json`` + ``DIR/model.safetensors`` (float16; load with
   ``nanospec.model.mlp_speculator.load_mlp_speculator``), ``DIR/training_log.jsonl`` and ``DIR/training.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from nanospec.cache.kv_cache import KVCache
from nanospec.model.forward_batch import build_forward_batch
from nanospec.model.llama import Llama
from nanospec.model.loader import load_checkpoint
from nanospec.model.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig, save_mlp_speculator

PROMPT_SET = Path(__file__).with_name("speculators") / "prompts.jsonl"
IGNORE = -100
BLOCK_SIZE = 16


# ---------------------------------------------------------------- prompts
def load_prompt_set(path: str | os.PathLike) -> list[dict]:
    """``{"category", "prompt"}`` rows of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt set not found: {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
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


# ---------------------------------------------------------------- recording
@dataclass
class Recording:
    """Continuations of prompts: ``tokens[offsets[s]:offsets[s+1]]`` are sequence ``s``'s tokens and ``hidden``
    the same rows' final hidden states (row ``j``: the state whose logits gave, or predict, token ``j``); its
    first ``generated_from[s]`` rows are prompt text, the rest the target's continuation."""
    prompt_index: torch.Tensor  # [S] int64: which prompt of the set
    offsets: torch.Tensor       # [S+1] int64
    tokens: torch.Tensor        # [N] int64
    hidden: torch.Tensor        # [N, emb_dim] float16
    generated_from: torch.Tensor  # [S] int64: rows before it are the prompt's own text (its hidden states)

    def save(self, path: Path, metadata: dict) -> None:
        tmp = path.with_suffix(".tmp")
        save_file({"prompt_index": self.prompt_index, "offsets": self.offsets, "tokens": self.tokens,
                   "hidden": self.hidden.contiguous(),
                   "generated_from": self.generated_from}, str(tmp), metadata={"info": json.dumps(metadata)})
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
                       tensors["generated_from"])
        except Exception:  # a cut or foreign file: record again
            return None

    @property
    def num_generated(self) -> int:
        return int(self.tokens.numel() - self.generated_from.sum())


@torch.inference_mode()
def generate_with_hidden(model: Llama, prompts: list[list[int]], *, max_tokens: int, eos_ids: list[int],
                         temperature: float = 0.0, seed: int = 0, batch: int = 32, max_prefill_tokens: int = 4096,
                         prompt_rows_from: int | None = None, desc: str = "recording",
                         ) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """Continue every prompt (greedy at ``temperature`` 0, else sampled from ``softmax(logits / temperature)``
    with a generator seeded by ``seed``) for at most ``max_tokens`` tokens or until an eos token (kept), up to
    ``batch`` sequences at once (a finished one's place goes to the next prompt). Returns per prompt the generated
    tokens and their hidden states ``[n, hidden]`` (float16): row ``j`` is the final hidden state at the
    position whose logits gave token ``j`` (the last prompt token's for token 0); and, with ``prompt_rows_from``
    ``q``, the hidden states of the prompt's positions ``q .. len - 2`` (empty otherwise): computed by the prefill
    anyway, they cost only their final norm."""
    c = model.config
    longest = max(len(p) for p in prompts) + max_tokens
    blocks_per_lane = -(-longest // BLOCK_SIZE)
    lanes = min(batch, len(prompts))
    kv = KVCache(c.num_hidden_layers, lanes * blocks_per_lane, BLOCK_SIZE, c.num_key_value_heads, c.head_dim,
                 model.dtype, model.device)
    tables = [list(range(lane * blocks_per_lane, (lane + 1) * blocks_per_lane)) for lane in range(lanes)]
    generator = torch.Generator(device=model.device).manual_seed(seed)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.int64)
    waiting = deque(range(len(prompts)))
    running: dict[int, int] = {}  # lane -> prompt index
    free_lanes = deque(range(lanes))
    out_tokens: list[list[int]] = [[] for _ in prompts]
    out_hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
    prompt_hidden: list[torch.Tensor] = [torch.zeros(0, c.hidden_size, dtype=torch.float16) for _ in prompts]
    bar = tqdm(total=len(prompts), desc=desc, unit="seq", dynamic_ncols=True, mininterval=2)
    generated = 0
    while waiting or running:
        token_lists, starts, table_list, rows, order, extra = [], [], [], [], [], []
        prefill_tokens = 0
        for lane, index in running.items():  # decode: feed the last generated token
            length = len(prompts[index]) + len(out_tokens[index])
            token_lists.append([out_tokens[index][-1]])
            starts.append(length - 1)
            table_list.append(tables[lane])
            rows.append([0])
            order.append((lane, index))
        while waiting and free_lanes and (prefill_tokens == 0 or
                                          prefill_tokens + len(prompts[waiting[0]]) <= max_prefill_tokens):
            index, lane = waiting.popleft(), free_lanes.popleft()
            running[lane] = index
            prefill_tokens += len(prompts[index])
            token_lists.append(list(prompts[index]))
            starts.append(0)
            table_list.append(tables[lane])
            first = len(prompts[index]) - 1 if prompt_rows_from is None else \
                min(prompt_rows_from, len(prompts[index]) - 1)
            rows.append(list(range(first, len(prompts[index]))))
            extra.append(len(rows[-1]) - 1)
            order.append((lane, index))
        batch_ = build_forward_batch(token_lists, starts, table_list, BLOCK_SIZE, rows, model.device)
        hidden = model.forward(batch_, kv)
        if any(extra):  # the prompts' rows but the last: kept, not scored
            last = torch.tensor([0] * (len(order) - len(extra)) + extra).cumsum(0) + torch.arange(len(order))
            split = hidden[:last[-1] + 1]
            for e, (lane, index), end in zip(extra, order[len(order) - len(extra):], last[len(order) - len(extra):]):
                prompt_hidden[index] = split[int(end) - e:int(end)].to(torch.float16).cpu()
            hidden = hidden[last]
        logits = model.compute_logits(hidden)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            next_tokens = logits.argmax(-1)
        hidden16 = hidden.to(torch.float16).cpu()
        next_list = next_tokens.cpu().tolist()
        ended = torch.isin(next_tokens.cpu(), eos).tolist()
        for r, (lane, index) in enumerate(order):
            out_tokens[index].append(next_list[r])
            out_hidden[index].append(hidden16[r])
            generated += 1
            if ended[r] or len(out_tokens[index]) >= max_tokens:
                del running[lane]
                free_lanes.append(lane)
                bar.update(1)
        bar.set_postfix(tokens=generated, refresh=False)
    bar.close()
    return out_tokens, [torch.stack(h) for h in out_hidden], prompt_hidden


def record(model: Llama, prompt_ids: list[list[int]], eos_ids: list[int], *, prompt_index: list[int] | None = None,
           max_tokens: int, temperature: float, seed: int, batch: int, desc: str,
           prompt_rows_from: int | None = None) -> Recording:
    """Record continuations (and, from ``prompt_rows_from``, the prompts' own text as leading rows)."""
    tokens, hidden, prompt_hidden = generate_with_hidden(
        model, prompt_ids, max_tokens=max_tokens, eos_ids=eos_ids, temperature=temperature, seed=seed, batch=batch,
        desc=desc, prompt_rows_from=prompt_rows_from)
    firsts = [len(h) for h in prompt_hidden]  # prompt-text rows at the front of each sequence
    tokens = [ids[len(ids) - f:] + t if f else t for ids, t, f in zip(prompt_ids, tokens, firsts)]
    hidden = [torch.cat([p, h]) for p, h in zip(prompt_hidden, hidden)]
    lengths = torch.tensor([0] + [len(t) for t in tokens])
    index = torch.tensor(prompt_index if prompt_index is not None else range(len(tokens)), dtype=torch.int64)
    return Recording(index, lengths.cumsum(0), torch.tensor([t for ts in tokens for t in ts]), torch.cat(hidden),
                     torch.tensor(firsts, dtype=torch.int64))


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


# ---------------------------------------------------------------- training data
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


# ---------------------------------------------------------------- the speculator
def target_head(target: Llama) -> torch.Tensor:
    """The target's output embedding ``[vocab, hidden]`` (its logits are ``head @ final hidden state``)."""
    return target.lm_head.weight.detach().cpu()


def new_speculator(args, emb_dim: int, vocab_size: int, hot_ids: torch.Tensor | None, target: Llama | None,
                   seed: int) -> MLPSpeculator:
    config = MLPSpeculatorConfig(emb_dim=emb_dim, inner_dim=args.inner_dim or emb_dim, n_predict=args.n_predict,
                                 vocab_size=vocab_size, tie_weights=args.tie_weights, scale_input=args.scale_input,
                                 hot_vocab_size=args.hot_vocab)
    torch.manual_seed(seed)
    model = MLPSpeculator(config)
    if hot_ids is not None:
        model.set_hot_vocabulary(hot_ids)
    with torch.no_grad():
        d = config.inner_dim
        for i in range(config.n_predict):  # IBM's initialisation: N(0, 1/sqrt(dim)) embeddings and heads
            model.emb[i].weight.normal_(0, 1 / math.sqrt(d))
            model.head[i].weight.normal_(0, 1 / math.sqrt(d))
            model.proj[i].weight.normal_(0, 1 / math.sqrt(model.proj[i].weight.shape[1]))
        if args.init_from_target and target is not None and d == emb_dim:
            # the target's own (tied) embeddings as the stages' token embeddings and heads: a speculator that
            # starts out knowing which tokens are alike
            table = target_head(target).float()[model.hot_token_ids.cpu()]
            for i in range(config.n_predict):
                model.head[i].weight.copy_(table / table.norm(dim=1, keepdim=True).mean() * math.sqrt(1 / d) * 8)
                emb = table / table.norm(dim=1, keepdim=True).mean()
                if config.hot_vocab_size:
                    model.emb[i].weight[:-1].copy_(emb)
                else:
                    model.emb[i].weight.copy_(emb)
    return model


def teacher_hidden(data: Examples, pick: torch.Tensor, n_predict: int) -> torch.Tensor:
    """``[B, n_predict, emb_dim]``: the target's final hidden state at the position that predicts each stage's
    target (row ``t + 1 + i`` for stage ``i``; any row where the target is past the end, which is ignored)."""
    rows = data.rows[pick, None] + 1 + torch.arange(n_predict)
    return data.hidden[rows.clamp(max=data.hidden.shape[0] - 1)].float()


def stage_losses(model: MLPSpeculator, hidden: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor,
                 teacher: tuple[torch.Tensor, torch.Tensor, float] | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Per stage: mean cross-entropy over its targets in the scored set, top-1 hits (a target outside the hot
    set is a miss), and how many targets it had.

    With ``teacher = (states [B, n, emb_dim], head [K, emb_dim], w)`` (distillation) the loss is
    ``(1 - w) * CE(target) + w * CE(p)``, ``p = softmax(head @ state)``: the target's own next-token
    distribution over the scored set, at the position that produced the stage's target. Its argmax is what a
    greedy verify accepts; the rest of it tells the stage which wrong guesses are nearly right."""
    logits = model(hidden, inputs)
    losses, hits, counts = [], [], []
    for i, stage_logits in enumerate(logits):
        target = targets[:, i]
        valid = target != IGNORE
        index = model.hot_index[target.clamp(min=0)]
        scored = valid & (model.hot_token_ids[index.clamp(max=model.config.num_scored - 1)] == target.clamp(min=0))
        index = torch.where(scored, index, torch.full_like(index, IGNORE))
        loss = F.cross_entropy(stage_logits, index, ignore_index=IGNORE, reduction="sum") / max(int(scored.sum()), 1)
        if teacher is not None:
            states, head, w = teacher
            p = torch.softmax(states[:, i] @ head.T, dim=-1)
            soft = -(p * torch.log_softmax(stage_logits, dim=-1)).sum(-1)
            loss = (1 - w) * loss + w * (soft * valid).sum() / max(int(valid.sum()), 1)
        losses.append(loss)
        hits.append(((stage_logits.argmax(-1) == index) & scored).sum())
        counts.append(int(valid.sum()))
    return losses, hits, counts


@torch.no_grad()
def evaluate(model: MLPSpeculator, data: Examples, batch_size: int = 2048) -> dict:
    """Per-stage loss and teacher-forced top-1 accuracy, and the greedy chain: the mean number of guesses
    accepted at one position (all stages run on their own guesses, as at run time) and tau = that + 1."""
    model.eval()
    n = model.config.n_predict
    loss_sum, hit_sum, count_sum = [0.0] * n, [0] * n, [0] * n
    accepted_sum, positions = 0, 0
    for start in range(0, len(data), batch_size):
        rows = data.rows[start:start + batch_size]
        hidden = data.hidden[rows].float()
        inputs, targets = data.inputs[start:start + batch_size], data.targets[start:start + batch_size]
        losses, hits, counts = stage_losses(model, hidden, inputs, targets)
        for i in range(n):
            scored = int(((targets[:, i] != IGNORE)).sum())
            loss_sum[i] += float(losses[i]) * scored
            hit_sum[i] += int(hits[i])
            count_sum[i] += counts[i]
        guesses = model.propose(hidden, inputs[:, 0], n)
        match = (guesses == targets).long().cumprod(1)  # a guess past the end never matches
        accepted_sum += int(match.sum())
        positions += rows.numel()
    model.train()
    return {"loss": [loss_sum[i] / max(count_sum[i], 1) for i in range(n)],
            "acc": [hit_sum[i] / max(count_sum[i], 1) for i in range(n)],
            "tau": 1 + accepted_sum / max(positions, 1), "positions": positions}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ---------------------------------------------------------------- checkpoints (safetensors + JSON)
def save_checkpoint(directory: Path, model: MLPSpeculator, optimizer: torch.optim.Optimizer, step: int,
                    state: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    names = [name for name, _ in model.named_parameters()]
    tensors = {f"model.{name}": p.detach().clone() for name, p in model.named_parameters()}
    tensors["model.hot_token_ids"] = model.hot_token_ids.clone()
    opt = optimizer.state_dict()
    for index, name in enumerate(names):
        for key, value in opt["state"].get(index, {}).items():
            tensors[f"optim.{name}.{key}"] = value.detach().clone().reshape(-1) if value.dim() == 0 else value.clone()
    tensors["rng.torch"] = torch.get_rng_state()
    tmp = directory / "checkpoint.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / "checkpoint.safetensors")
    (directory / "state.json.tmp").write_text(json.dumps({"step": step, **state}, indent=1) + "\n")
    os.replace(directory / "state.json.tmp", directory / "state.json")


def load_checkpoint_into(directory: Path, model: MLPSpeculator, optimizer: torch.optim.Optimizer) -> dict:
    tensors = load_file(str(directory / "checkpoint.safetensors"))
    state = json.loads((directory / "state.json").read_text())
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[f"model.{name}"])
        model.set_hot_vocabulary(tensors["model.hot_token_ids"])
    opt = optimizer.state_dict()
    for index, name in enumerate(names):
        entry = {}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if f"optim.{name}.{key}" in tensors:
                value = tensors[f"optim.{name}.{key}"]
                entry[key] = value.reshape(()) if key == "step" else value
        if entry:
            opt["state"][index] = entry
    optimizer.load_state_dict(opt)
    torch.set_rng_state(tensors["rng.torch"])
    return state


# ---------------------------------------------------------------- plot and log
def plot(log: list[dict], path: Path, n_predict: int) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'nanospec[train]' or pip install matplotlib)")
        return False
    train = [r for r in log if r["kind"] == "train"]
    evals = [r for r in log if r["kind"] == "eval"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for i in range(n_predict):
        color = f"C{i}"
        if train:
            ax_loss.plot([r["step"] for r in train], [r["loss"][i] for r in train], color=color, alpha=0.5,
                         label=f"stage {i} train")
        if evals:
            ax_loss.plot([r["step"] for r in evals], [r["loss"][i] for r in evals], "o-", color=color,
                         label=f"stage {i} held-out")
            ax_acc.plot([r["step"] for r in evals], [r["acc"][i] for r in evals], "o-", color=color,
                        label=f"stage {i}")
    if evals:
        ax_acc.plot([r["step"] for r in evals], [r["tau"] - 1 for r in evals], "k--", label="accepted / position")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.set_title("loss per stage")
    ax_loss.legend(fontsize=7)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("top-1 accuracy (held-out, teacher-forced)")
    ax_acc.set_title("held-out accuracy per stage")
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nanospec.train_speculator", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="target: HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--prompts", default=str(PROMPT_SET), help="JSONL prompt set ({'prompt': ...} per line)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--cache", default=None, help="where recordings are kept (default OUT/cache)")
    p.add_argument("--max-tokens", type=int, default=96, help="longest recorded continuation")
    p.add_argument("--record-batch", type=int, default=64, help="sequences generated at once")
    p.add_argument("--sampled-runs", type=int, default=1, help="sampled continuations per prompt (0: greedy only)")
    p.add_argument("--sampled-every", type=int, default=8,
                   help="sampled continuations for every N-th prompt only (1: all of them)")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled continuations")
    p.add_argument("--n-predict", type=int, default=3, help="stages (tokens guessed per step)")
    p.add_argument("--inner-dim", type=int, default=0, help="stage width (0: the target's hidden size)")
    p.add_argument("--hot-vocab", type=int, default=4096, help="score only the K most frequent tokens (0: all)")
    p.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="share emb/head/ln across stages")
    p.add_argument("--scale-input", action=argparse.BooleanOptionalAction, default=True,
                   help="normalize the hidden state first")
    p.add_argument("--init-from-target", action=argparse.BooleanOptionalAction, default=True,
                   help="start emb and head from the target's embeddings (needs inner-dim = hidden size)")
    p.add_argument("--prompt-text", action=argparse.BooleanOptionalAction, default=True,
                   help="phase 1 also learns the prompts' own text (its hidden states come free with the prefill)")
    p.add_argument("--epochs-greedy", type=int, default=6, help="phase 1: epochs over the greedy continuations")
    p.add_argument("--epochs-mixed", type=int, default=1, help="phase 2: epochs over greedy + sampled")
    p.add_argument("--distill", type=float, default=0.5,
                   help="weight w of the target's own next-token distribution in the loss: (1 - w) * CE(token) + "
                        "w * CE(target's distribution), both over the scored set (0: the tokens alone)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    p.add_argument("--val-every", type=int, default=10,
                   help="every N-th prompt of each category is held out (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default, every core); on a busy machine use 1 (2 threads waiting "
                        "on each other for a shared core ran SmolLM2 3x slower here)")
    p.add_argument("--resume", action="store_true", help="go on from OUT/checkpoint")
    p.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (with a checkpoint) after this many steps, as if interrupted; --resume goes on")
    args = p.parse_args(argv)
    return args


def check_args(args, vocab_size: int | None = None) -> None:
    def positive(name, value, low=1):
        if value is None or value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    positive("n_predict", args.n_predict)
    positive("max_tokens", args.max_tokens, 2)
    positive("record_batch", args.record_batch)
    positive("batch_size", args.batch_size)
    positive("save_every", args.save_every)
    positive("sampled_every", args.sampled_every)
    for name in ("threads", "sampled_runs", "hot_vocab", "inner_dim", "epochs_greedy", "epochs_mixed", "warmup",
                 "val_every"):
        positive(name, getattr(args, name), 0)
    if args.limit is not None:
        positive("limit", args.limit)
    if args.stop_after is not None:
        positive("stop_after", args.stop_after)
    if args.epochs_greedy + args.epochs_mixed < 1:
        raise ValueError("nothing to train: --epochs-greedy and --epochs-mixed are both 0")
    if args.sampled_runs and not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0 for sampled runs, got {args.temperature}")
    if not 0 <= args.distill <= 1:
        raise ValueError(f"--distill must be in [0, 1], got {args.distill}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.tie_weights and args.n_predict < 2:
        raise ValueError("--tie-weights needs --n-predict >= 2 (or pass --no-tie-weights)")
    if vocab_size is not None and args.hot_vocab > vocab_size:
        raise ValueError(f"--hot-vocab {args.hot_vocab} is larger than the target's vocabulary ({vocab_size})")


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        check_args(args)
        return train(args, command=["python", "-m", "nanospec.train_speculator",
                                    *(sys.argv[1:] if argv is None else argv)])
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)


def train(args, command: list[str]) -> int:
    started = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    out = Path(args.out)
    cache = Path(args.cache) if args.cache else out / "cache"
    checkpoint_dir = out / "checkpoint"
    if args.resume and not (checkpoint_dir / "state.json").is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {checkpoint_dir}")
    prompt_rows = load_prompt_set(args.prompts)
    if args.limit:
        prompt_rows = prompt_rows[:args.limit]

    checkpoint = load_checkpoint(args.model, torch.float32)
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    check_args(args, config.vocab_size)
    if args.inner_dim and args.init_from_target and args.inner_dim != config.hidden_size:
        print(f"--init-from-target needs --inner-dim {config.hidden_size} (the target's hidden size): random init")
    prompt_ids = [encode_chat(tokenizer, row["prompt"]) for row in prompt_rows]
    target = Llama(config, checkpoint.tensors, "cpu", torch.float32,
                   max_len=max(map(len, prompt_ids)) + args.max_tokens)
    del checkpoint
    eos_ids = list(tokenizer.eos_token_ids)

    # 1. record (or reuse the cached recordings)
    digest = hashlib.sha256(json.dumps([args.model and str(Path(args.model).resolve()), prompt_ids]).encode())
    runs = [("greedy", 0.0, args.seed)] + [(f"sampled{r}", args.temperature, args.seed + 1 + r)
                                           for r in range(args.sampled_runs)]
    cache.mkdir(parents=True, exist_ok=True)
    recordings, timings = [], {}
    shared = 0  # the prompts' common head (chat template, system prompt) is not kept as prompt text
    while all(len(ids) > shared + 1 and ids[shared] == prompt_ids[0][shared] for ids in prompt_ids):
        shared += 1
    for name, temperature, seed in runs:
        meta = {"prompts": digest.hexdigest(), "max_tokens": args.max_tokens, "temperature": temperature,
                "seed": seed, "batch": args.record_batch}
        path = cache / f"{name}.safetensors"
        chosen = list(range(len(prompt_ids))) if name == "greedy" else \
            list(range(0, len(prompt_ids), args.sampled_every))
        meta["chosen"] = len(chosen)
        meta["prompt_rows_from"] = shared if name == "greedy" else None
        recording = Recording.load(path, meta)
        if recording is None:
            t0 = time.time()
            recording = record(target, [prompt_ids[i] for i in chosen], eos_ids, prompt_index=chosen,
                               max_tokens=args.max_tokens, temperature=temperature, seed=seed,
                               batch=args.record_batch, desc=f"recording {name}",
                               prompt_rows_from=shared if name == "greedy" else None)
            seconds = time.time() - t0
            recording.save(path, meta)
            timings[f"record_{name}_s"] = round(seconds, 1)
            print(f"recorded {name}: {recording.num_generated} tokens of {len(chosen)} prompts in {seconds:.0f} s "
                  f"({recording.num_generated / seconds * 60:.0f} tokens/min)")
        else:
            print(f"{name}: {recording.num_generated} tokens, from the cache {path}")
        recordings.append(recording)

    # 2. data: every val_every-th prompt of each category is held out (all its continuations)
    held_out = held_out_prompts(prompt_rows, args.val_every)
    held = set(held_out)
    train_ids = [i for i in range(len(prompt_ids)) if i not in held]
    n = args.n_predict
    greedy_train = make_examples(recordings[0], train_ids, n, prompt_text=args.prompt_text)
    mixed_train = concat_examples([make_examples(r, train_ids, n) for r in recordings])
    validation = make_examples(recordings[0], held_out, n)  # greedy: what the benchmark measures
    hot_ids = None
    if args.hot_vocab:
        hot_ids = hot_vocabulary(recordings, train_ids, args.hot_vocab, config.vocab_size)
        covered = torch.isin(validation.targets[:, 0], hot_ids).float().mean().item() if len(validation) else 0
        print(f"hot vocabulary: {args.hot_vocab} tokens cover {covered:.1%} of the held-out targets")
    phases = [("greedy", greedy_train, args.epochs_greedy), ("mixed", mixed_train, args.epochs_mixed)]
    phases = [p for p in phases if p[2] > 0 and len(p[1])]
    if not phases:
        raise ValueError("no training examples: the recorded continuations are all shorter than 2 tokens")
    steps_per_epoch = {name: -(-len(data) // args.batch_size) for name, data, _ in phases}
    total_steps = sum(steps_per_epoch[name] * epochs for name, _, epochs in phases)
    print(f"training: {len(greedy_train)} greedy / {len(mixed_train)} mixed examples, {len(validation)} held-out; "
          f"{' then '.join(f'{e} epochs {name}' for name, _, e in phases)} = {total_steps} steps of "
          f"{args.batch_size}")

    # 3. train
    model = new_speculator(args, config.hidden_size, config.vocab_size, hot_ids, target, args.seed)
    teacher_head = target_head(target)[model.hot_token_ids].float() if args.distill else None
    del target
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.99))
    step, log, train_seconds = 0, [], 0.0
    log_path = out / "training_log.jsonl"
    if args.resume:
        state = load_checkpoint_into(checkpoint_dir, model, optimizer)
        if state["total_steps"] != total_steps or state["settings"] != settings_of(args):
            raise ValueError(f"--resume: {checkpoint_dir} was made with other settings or data "
                             f"({state['total_steps']} steps, {state['settings']})")
        step, train_seconds = state["step"], state["train_seconds"]
        log = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.is_file() else []
        log = [r for r in log if r["step"] <= step]
        timings = state.get("timings", {}) | timings
        print(f"resuming at step {step} of {total_steps}")
    out.mkdir(parents=True, exist_ok=True)

    def checkpoint_now():
        save_checkpoint(checkpoint_dir, model, optimizer, step, {
            "total_steps": total_steps, "settings": settings_of(args), "train_seconds": train_seconds,
            "timings": timings})
        log_path.write_text("".join(json.dumps(r) + "\n" for r in log))

    model.train()
    stop = args.stop_after
    first_step = 0
    bar = tqdm(total=total_steps, initial=step, desc="training", unit="step", dynamic_ncols=True, mininterval=2)
    window = []
    try:
        for phase_index, (phase, data, epochs) in enumerate(phases):
            for epoch in range(epochs):
                per_epoch = steps_per_epoch[phase]
                if step >= first_step + per_epoch:
                    first_step += per_epoch
                    continue
                generator = torch.Generator().manual_seed(args.seed * 1000 + phase_index * 100 + epoch)
                order = torch.randperm(len(data), generator=generator)
                for b in range(step - first_step, per_epoch):
                    t0 = time.time()
                    pick = order[b * args.batch_size:(b + 1) * args.batch_size]
                    hidden = data.hidden[data.rows[pick]].float()
                    lr = lr_at(step, total_steps, args.lr, args.warmup)
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    teacher = (teacher_hidden(data, pick, n), teacher_head, args.distill) if args.distill else None
                    losses, hits, counts = stage_losses(model, hidden, data.inputs[pick], data.targets[pick], teacher)
                    loss = sum(losses)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    step += 1
                    train_seconds += time.time() - t0
                    window.append(([float(x.detach()) for x in losses],
                                   [int(h) / max(c, 1) for h, c in zip(hits, counts)]))
                    if len(window) == 50 or b == per_epoch - 1:
                        log.append({"kind": "train", "step": step, "phase": phase, "epoch": epoch, "lr": lr,
                                    "loss": [sum(w[0][i] for w in window) / len(window) for i in range(n)],
                                    "acc": [sum(w[1][i] for w in window) / len(window) for i in range(n)]})
                        window = []
                        bar.set_postfix(loss=" ".join(f"{x:.2f}" for x in log[-1]["loss"]),
                                        acc=" ".join(f"{x:.2f}" for x in log[-1]["acc"]), refresh=False)
                    bar.update(1)
                    if stop is not None and step >= stop:
                        break
                    if step % args.save_every == 0:
                        checkpoint_now()
                if stop is not None and step >= stop:
                    break
                first_step += per_epoch
                if len(validation):
                    result = evaluate(model, validation)
                    log.append({"kind": "eval", "step": step, "phase": phase, "epoch": epoch, **result})
                    tqdm.write(f"{phase} epoch {epoch + 1}/{epochs} (step {step}): held-out loss "
                               f"{' '.join(f'{x:.3f}' for x in result['loss'])}, top-1 accuracy "
                               f"{' '.join(f'{x:.3f}' for x in result['acc'])}, tau@{n} ~ {result['tau']:.3f}")
                checkpoint_now()
            if stop is not None and step >= stop:
                break
    except KeyboardInterrupt:
        bar.close()
        checkpoint_now()
        print(f"\ninterrupted at step {step}: checkpoint saved, --resume goes on from it")
        return 130
    bar.close()
    checkpoint_now()
    if step < total_steps:
        print(f"stopped at step {step} of {total_steps} (--stop-after): --resume goes on")
        return 0

    timings["train_s"] = round(train_seconds, 1)
    timings["this_run_s"] = round(time.time() - started, 1)
    final = next((r for r in reversed(log) if r["kind"] == "eval"), None)
    metadata = {"command": " ".join(shlex.quote(c) for c in command), "seed": args.seed,
                "target": str(args.model or "embedded SmolLM2-135M-Instruct"),
                "data": f"{Path(args.prompts).name}: {len(prompt_ids)} prompts ({len(held_out)} held out), "
                        f"{' + '.join(f'{r.num_generated} {name}' for (name, _, _), r in zip(runs, recordings))} "
                        f"tokens, max {args.max_tokens} per continuation",
                "settings": json.dumps(settings_of(args)), "timings": json.dumps(timings),
                "held_out": json.dumps(final and {k: final[k] for k in ("loss", "acc", "tau")})}
    save_mlp_speculator(model, out, metadata=metadata)
    held_out_by_category = {}
    for category in sorted({prompt_rows[i].get("category") for i in held_out} - {None, ""}):
        prompts = [i for i in held_out if prompt_rows[i].get("category") == category]
        result = evaluate(model, make_examples(recordings[0], prompts, n))
        held_out_by_category[category] = {k: result[k] for k in ("acc", "tau", "positions")}
        print(f"held out, {category}: tau@{n} ~ {result['tau']:.2f}, top-1 accuracy "
              f"{' '.join(f'{x:.2f}' for x in result['acc'])}")
    (out / "training_summary.json").write_text(json.dumps(metadata | {
        "settings": settings_of(args), "timings": timings, "held_out": final and {
            k: final[k] for k in ("loss", "acc", "tau", "positions")},
        "held_out_by_category": held_out_by_category}, indent=1) + "\n")
    plot(log, out / "training.png", n)
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} "
          f"({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB); timings {timings}")
    return 0


def settings_of(args) -> dict:
    keys = ("prompts", "limit", "max_tokens", "sampled_runs", "sampled_every", "prompt_text", "temperature",
            "n_predict", "inner_dim", "hot_vocab",
            "tie_weights", "scale_input", "init_from_target", "epochs_greedy", "epochs_mixed", "distill", "batch_size",
            "lr", "weight_decay", "warmup", "val_every", "seed")
    return {k: getattr(args, k) for k in keys}


if __name__ == "__main__":
    sys.exit(main())
