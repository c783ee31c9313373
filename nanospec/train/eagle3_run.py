"""``python -m nanospec.train --kind eagle3``: an EAGLE-3 head for the target, on its own greedy outputs.

The recording (:func:`nanospec.train.record.record`, cached like the MLP speculator's) keeps every position of every
sequence from position 0, with the final hidden state and the residual stream entering the head's auxiliary layers
(the default ``(2, L // 2, L - 3)`` of :mod:`nanospec.model.eagle3`, the rows the proposer fuses at run time).
Batches are whole sequences, sorted by length and padded, at most ``--batch-size`` rows each; the loss counts the rows
past the prompts' common head (chat template, system prompt), or only the continuations with ``--no-prompt-text``.
The head (:mod:`nanospec.train.eagle3`) is unrolled ``--n-predict`` steps; the held-out prompts' continuations
give per-step accuracy and tau (overall and per category). The output directory loads with
``speculative_config={"method": "eagle3", "model": DIR}``.
"""

from __future__ import annotations

import json
import shlex
from argparse import Namespace
from pathlib import Path

import torch

from nanospec.model.eagle3 import default_aux_layers
from nanospec.model.llama import Llama
from nanospec.train.data import IGNORE, held_out_prompts, hot_vocabulary, sequences_of
from nanospec.train.eagle3 import (Batch, Unroller, aux_scale, draft_vocabulary_index, head_config, new_head,
                                   save_head, step_losses, total_loss)
from nanospec.train.loop import Trainer, lr_at, plot, target_head
from nanospec.train.record import Recording


class Batches:
    """Sequences of a recording in fixed batches (sorted by length, at most ``max_rows`` padded rows each);
    ``batch(i)`` builds batch ``i``. Row ``r`` of sequence ``s`` counts from ``loss_from[s]``."""

    def __init__(self, recording: Recording, seqs: list[int], loss_from: list[int], max_rows: int, steps: int):
        self.recording, self.steps = recording, steps
        lengths = (recording.offsets[1:] - recording.offsets[:-1]).tolist()
        order = sorted(range(len(seqs)), key=lambda i: (lengths[seqs[i]], seqs[i]))
        self.groups: list[list[tuple[int, int]]] = []
        for i in order:
            group = self.groups[-1] if self.groups else None
            if group is None or (len(group) + 1) * lengths[seqs[i]] > max_rows:
                self.groups.append(group := [])
            group.append((seqs[i], loss_from[i]))
        self.rows = sum(lengths[s] for s in seqs)

    def __len__(self) -> int:
        return len(self.groups)

    def batch(self, i: int) -> Batch:
        rec, K = self.recording, self.steps
        spans = [(int(rec.offsets[s]), int(rec.offsets[s + 1]), start) for s, start in self.groups[i]]
        L = max(end - begin for begin, end, _ in spans)
        aux = torch.zeros(len(spans), L, rec.aux.shape[1])
        tokens = torch.full((len(spans), L + K + 1), IGNORE, dtype=torch.int64)
        rows = torch.zeros((len(spans), L + K + 1), dtype=torch.int64)
        scored = torch.zeros(len(spans), L, dtype=torch.bool)
        for b, (begin, end, start) in enumerate(spans):
            aux[b, :end - begin] = rec.aux[begin:end].float()
            tokens[b, :end - begin] = rec.tokens[begin:end]
            rows[b, :end - begin] = torch.arange(begin, end)
            scored[b, start:end - begin] = True
        return Batch(aux, tokens, rows, scored)


def batches_of(recording: Recording, prompts: list[int], max_rows: int, steps: int, loss_from_row: int | None
               ) -> Batches:
    """The sequences continuing ``prompts``; losses from row ``loss_from_row`` (None: the continuation's first)."""
    seqs = sequences_of(recording, prompts)
    starts = [int(recording.generated_from[s]) if loss_from_row is None else loss_from_row for s in seqs]
    return Batches(recording, seqs, starts, max_rows, steps)


@torch.no_grad()
def evaluate(unroller: Unroller, data: Batches, draft_index: torch.Tensor) -> dict:
    """Per-step loss and teacher-forced top-1 accuracy over the scored rows, and tau = 1 + the mean count of leading
    hits per row (the chain the head drafts there, as at run time)."""
    head, n = unroller.head, unroller.steps
    head.eval()
    loss_sum, hit_sum, count_sum = [0.0] * n, [0] * n, [0] * n
    accepted, positions = 0, 0
    for i in range(len(data)):
        batch = data.batch(i)
        losses, hits, counts = step_losses(head, unroller(batch), batch, draft_index)
        for k in range(n):
            loss_sum[k] += float(losses[k]) * counts[k]
            hit_sum[k] += int(hits[k].sum())
            count_sum[k] += counts[k]
        first = batch.scored & (batch.tokens[:, 1:1 + batch.scored.shape[1]] != IGNORE)
        accepted += int(torch.stack(hits, dim=-1).long().cumprod(-1)[first].sum())
        positions += int(first.sum())
    head.train()
    return {"loss": [loss_sum[k] / max(count_sum[k], 1) for k in range(n)],
            "acc": [hit_sum[k] / max(count_sum[k], 1) for k in range(n)],
            "tau": 1 + accepted / max(positions, 1), "positions": positions}


class Eagle3Trainer(Trainer):
    """:class:`~nanospec.train.loop.Trainer` over :class:`Batches` (one batch a step) with the unrolled head."""

    def __init__(self, unroller: Unroller, args, draft_index: torch.Tensor, teacher, total_steps: int, out: Path,
                 timings: dict, settings: dict):
        super().__init__(unroller.head, Namespace(**{**vars(args), "batch_size": 1}), None, total_steps, out,
                         timings, settings)
        self.unroller, self.draft_index, self.teacher = unroller, draft_index, teacher

    def _train_step(self, data: Batches, pick: torch.Tensor):
        lr = lr_at(self.step, self.total_steps, self.args.lr, self.args.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = data.batch(int(pick[0]))
        losses, hits, counts = step_losses(self.model, self.unroller(batch), batch, self.draft_index, self.teacher)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss(losses).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return losses, [h.sum() for h in hits], counts, lr

    def evaluate(self, data: Batches) -> dict:
        return evaluate(self.unroller, data, self.draft_index)


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a new head fuses: the default ``(2, L // 2, L - 3)``; ValueError where those are not three
    distinct layers of the target (a target of 1, 2, 4, 5 or 6 layers)."""
    ids = default_aux_layers(num_layers)
    if len(set(ids)) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"--kind eagle3: the head fuses the states entering layers (2, L // 2, L - 3) = {list(ids)}, "
                         f"which must be three distinct layers of the target, which has L = {num_layers}: a target "
                         f"of 3 or at least 7 layers")
    return ids


def train_eagle3(args, target: Llama, prompt_rows: list[dict], prompt_ids: list[list[int]], record_runs,
                 command: list[str], started: float) -> int:
    """Record (or read from the cache), train, write the head and its summary; ``record_runs`` is the trainer's
    cached recording (``aux_layers`` given)."""
    config, out = target.config, Path(args.out)
    aux_layers = eagle3_aux_layers(config.num_hidden_layers)
    runs, recordings, timings = record_runs(args, target, prompt_ids, aux_layers=aux_layers)
    recording = recordings[0]
    held_out = held_out_prompts(prompt_rows, args.val_every)
    train_ids = [i for i in range(len(prompt_rows)) if i not in set(held_out)]
    draft_ids = hot_vocabulary([recording], train_ids, args.hot_vocab or config.vocab_size, config.vocab_size)
    lm_head = target_head(target).float()
    intermediate = args.inner_dim or config.intermediate_size
    head = new_head(config, draft_ids, aux_layers, intermediate, target.norm.float().cpu(), lm_head, args.seed)
    unroller = Unroller(head, target.embed(torch.arange(config.vocab_size)).float().cpu(), args.n_predict,
                        int((recording.offsets[1:] - recording.offsets[:-1]).max()), aux_scale(recording.aux))
    draft_index = draft_vocabulary_index(draft_ids, config.vocab_size)
    teacher = (recording.hidden, lm_head[draft_ids], args.distill) if args.distill else None
    shared = common_head(prompt_ids)
    train = batches_of(recording, train_ids, args.batch_size, args.n_predict, shared if args.prompt_text else None)
    validation = batches_of(recording, held_out, args.batch_size, args.n_predict, None)
    offsets, firsts = recording.offsets, recording.generated_from
    held_tokens = [recording.tokens[int(offsets[s] + firsts[s]):int(offsets[s + 1])]
                   for s in sequences_of(recording, held_out)]
    if held_tokens:
        covered = torch.isin(torch.cat(held_tokens), draft_ids).float().mean()
        print(f"draft vocabulary: {len(draft_ids)} tokens cover {covered:.1%} of the held-out continuations' tokens")
    total_steps = len(train) * args.epochs_greedy
    print(f"training: {len(train)} batches of up to {args.batch_size} rows ({train.rows} rows), "
          f"{len(validation)} held-out batches; {args.epochs_greedy} epochs = {total_steps} steps")
    trainer = Eagle3Trainer(unroller, args, draft_index, teacher, total_steps, out, timings, settings_of(args))
    exit_code = trainer.run_to_end([("greedy", train, args.epochs_greedy)], validation, args.resume, started)
    if exit_code is not None:
        return exit_code
    config_dict = head_config(config, len(draft_ids), aux_layers, intermediate)
    write_outputs(args, command, trainer, config_dict, prompt_rows, recording, held_out)
    return 0


def common_head(prompt_ids: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (the chat template's head)."""
    shared = 0
    while all(len(ids) > shared + 1 and ids[shared] == prompt_ids[0][shared] for ids in prompt_ids):
        shared += 1
    return shared


def write_outputs(args, command: list[str], trainer: Eagle3Trainer, config: dict, prompt_rows: list[dict],
                  recording: Recording, held_out: list[int]) -> None:
    """The head (config.json + model.safetensors), ``training_summary.json`` and ``training.png``."""
    out, n, timings = Path(args.out), args.n_predict, trainer.timings
    final = next((r for r in reversed(trainer.log) if r["kind"] == "eval"), None)
    metadata = {"command": " ".join(shlex.quote(c) for c in command), "seed": args.seed, "kind": "eagle3",
                "target": str(args.model or "embedded SmolLM2-135M-Instruct"),
                "data": f"{Path(args.prompts).name}: {len(prompt_rows)} prompts ({len(held_out)} held out), "
                        f"{recording.num_generated} greedy tokens, max {args.max_tokens} per continuation",
                "held_out": final and {k: final[k] for k in ("loss", "acc", "tau", "positions")}}
    save_head(trainer.model, config, out, {k: json.dumps(v) for k, v in metadata.items()}, trainer.unroller.scale)
    by_category = {}
    for category in sorted({prompt_rows[i].get("category") for i in held_out} - {None, ""}):
        prompts = [i for i in held_out if prompt_rows[i].get("category") == category]
        result = trainer.evaluate(batches_of(recording, prompts, args.batch_size, n, None))
        by_category[category] = {k: result[k] for k in ("acc", "tau", "positions")}
        print(f"held out, {category}: tau@{n} ~ {result['tau']:.2f}, top-1 accuracy "
              f"{' '.join(f'{x:.2f}' for x in result['acc'])}")
    (out / "training_summary.json").write_text(json.dumps(metadata | {
        "settings": settings_of(args), "timings": timings, "held_out_by_category": by_category}, indent=1) + "\n")
    plot(trainer.log, out / "training.png", n)
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} "
          f"({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB); timings {timings}")


def settings_of(args) -> dict:
    keys = ("kind", "model", "prompts", "limit", "max_tokens", "prompt_text", "n_predict", "inner_dim", "hot_vocab",
            "epochs_greedy", "distill", "batch_size", "lr", "weight_decay", "warmup", "val_every", "seed")
    return {k: getattr(args, k) for k in keys}
