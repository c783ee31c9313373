"""The training loop: the speculator's stages teacher-forced on recorded examples, with the target's own
distribution as a second target (distillation), AdamW, checkpoints that resume to exactly a straight run's weights.

The loss of stage ``i`` mixes the recorded token with the target's next-token distribution there (``distill w``:
``(1 - w) * CE(token) + w * CE(softmax(lm_head @ h_{t+1+i}))``), both over the scored (hot) vocabulary. The learning
rate warms up linearly, then decays along a cosine to 5% of its peak. The data order of every epoch comes from a
``torch.Generator`` seeded by (seed, phase, epoch), so a run is reproducible on one machine. Checkpoints (weights,
AdamW state, step and RNG state as safetensors + JSON, never pickle) are written every ``save_every`` steps, at
every epoch's end and on Ctrl-C.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from nanospec.model.llama import Llama
from nanospec.model.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from nanospec.train.data import IGNORE, Examples


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


def save_checkpoint(directory: Path, model: MLPSpeculator, optimizer: torch.optim.Optimizer, step: int,
                    state: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    names = [name for name, _ in model.named_parameters()]
    tensors = {f"model.{name}": p.detach().clone() for name, p in model.named_parameters()}
    tensors |= {f"buffer.{name}": b.detach().clone() for name, b in _buffers(model).items()}
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


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps besides the parameters: the MLP speculator's hot vocabulary, any other module's
    buffers."""
    if isinstance(model, MLPSpeculator):
        return {"hot_token_ids": model.hot_token_ids}
    return dict(model.named_buffers())


def load_checkpoint_into(directory: Path, model: MLPSpeculator, optimizer: torch.optim.Optimizer) -> dict:
    tensors = load_file(str(directory / "checkpoint.safetensors"))
    state = json.loads((directory / "state.json").read_text())
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[f"model.{name}"])
        if isinstance(model, MLPSpeculator):
            model.set_hot_vocabulary(tensors["buffer.hot_token_ids"])
        else:
            for name, b in _buffers(model).items():
                b.copy_(tensors[f"buffer.{name}"])
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


class Trainer:
    """One run's model, optimizer, step and log; :meth:`run` goes through the phases from wherever the step is."""

    def __init__(self, model: torch.nn.Module, args, teacher_head: torch.Tensor | None, total_steps: int, out: Path,
                 timings: dict, settings: dict):
        self.model, self.args, self.teacher_head, self.total_steps = model, args, teacher_head, total_steps
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                           betas=(0.9, 0.99))
        self.checkpoint_dir, self.log_path = out / "checkpoint", out / "training_log.jsonl"
        self.step, self.log, self.train_seconds, self.timings, self.settings = 0, [], 0.0, timings, settings
        self._window: list = []

    def resume(self) -> None:
        """Go on from the checkpoint, which must have been made with the same settings and data."""
        state = load_checkpoint_into(self.checkpoint_dir, self.model, self.optimizer)
        if state["total_steps"] != self.total_steps or state["settings"] != self.settings:
            raise ValueError(f"--resume: {self.checkpoint_dir} was made with other settings or data "
                             f"({state['total_steps']} steps, {state['settings']})")
        self.step, self.train_seconds = state["step"], state["train_seconds"]
        log = [json.loads(line) for line in self.log_path.read_text().splitlines()] if self.log_path.is_file() else []
        self.log = [r for r in log if r["step"] <= self.step]
        self.timings = state.get("timings", {}) | self.timings
        print(f"resuming at step {self.step} of {self.total_steps}")

    def checkpoint(self) -> None:
        save_checkpoint(self.checkpoint_dir, self.model, self.optimizer, self.step, {
            "total_steps": self.total_steps, "settings": self.settings, "train_seconds": self.train_seconds,
            "timings": self.timings})
        self.log_path.write_text("".join(json.dumps(r) + "\n" for r in self.log))

    def run_to_end(self, phases: list[tuple[str, Examples, int]], validation: Examples, resume: bool,
                   started: float) -> int | None:
        """From the last checkpoint if ``resume``, :meth:`run`: None when every step is done (``timings`` then holds
        the training's and this run's seconds, this run from ``started``), else the exit code: 130 after Ctrl-C, 0
        when ``stop_after`` stopped it (a checkpoint is saved either way, and ``--resume`` goes on from it)."""
        if resume:
            self.resume()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            finished = self.run(phases, validation)
        except KeyboardInterrupt:
            print(f"\ninterrupted at step {self.step}: checkpoint saved, --resume goes on from it")
            return 130
        if not finished:
            print(f"stopped at step {self.step} of {self.total_steps} (--stop-after): --resume goes on")
            return 0
        self.timings["train_s"] = round(self.train_seconds, 1)
        self.timings["this_run_s"] = round(time.time() - started, 1)
        return None

    def run(self, phases: list[tuple[str, Examples, int]], validation: Examples) -> bool:
        """Every epoch of every phase not yet done (a checkpoint and an evaluation after each); False when
        ``stop_after`` stopped it first. Ctrl-C propagates after a checkpoint."""
        self.model.train()
        stop, first_step = self.args.stop_after, 0
        bar = tqdm(total=self.total_steps, initial=self.step, desc="training", unit="step", dynamic_ncols=True,
                   mininterval=2)
        try:
            for phase_index, (phase, data, epochs) in enumerate(phases):
                per_epoch = -(-len(data) // self.args.batch_size)
                for epoch in range(epochs):
                    if self.step < first_step + per_epoch:
                        self._epoch(phase_index, phase, data, epoch, self.step - first_step, per_epoch, bar)
                        if stop is not None and self.step >= stop:
                            return False
                        self._evaluate(phase, epoch, epochs, validation)
                        self.checkpoint()
                    first_step += per_epoch
        except KeyboardInterrupt:
            bar.close()
            self.checkpoint()
            raise
        finally:
            bar.close()
        return True

    def _epoch(self, phase_index: int, phase: str, data: Examples, epoch: int, start: int, per_epoch: int,
               bar) -> None:
        args = self.args
        generator = torch.Generator().manual_seed(args.seed * 1000 + phase_index * 100 + epoch)
        order = torch.randperm(len(data), generator=generator)
        for b in range(start, per_epoch):
            t0 = time.time()
            losses, hits, counts, lr = self._train_step(data, order[b * args.batch_size:(b + 1) * args.batch_size])
            self.step += 1
            self.train_seconds += time.time() - t0
            self._window.append(([float(x.detach()) for x in losses],
                                 [int(h) / max(c, 1) for h, c in zip(hits, counts)]))
            if len(self._window) == 50 or b == per_epoch - 1:
                self._log_window(phase, epoch, lr, bar)
            bar.update(1)
            if args.stop_after is not None and self.step >= args.stop_after:
                self.checkpoint()
                return
            if self.step % args.save_every == 0:
                self.checkpoint()

    def _train_step(self, data: Examples, pick: torch.Tensor):
        args, n = self.args, self.model.config.n_predict
        hidden = data.hidden[data.rows[pick]].float()
        lr = lr_at(self.step, self.total_steps, args.lr, args.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        teacher = (teacher_hidden(data, pick, n), self.teacher_head, args.distill) if args.distill else None
        losses, hits, counts = stage_losses(self.model, hidden, data.inputs[pick], data.targets[pick], teacher)
        self.optimizer.zero_grad(set_to_none=True)
        sum(losses).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return losses, hits, counts, lr

    def _log_window(self, phase: str, epoch: int, lr: float, bar) -> None:
        window, n = self._window, self.args.n_predict
        self.log.append({"kind": "train", "step": self.step, "phase": phase, "epoch": epoch, "lr": lr,
                         "loss": [sum(w[0][i] for w in window) / len(window) for i in range(n)],
                         "acc": [sum(w[1][i] for w in window) / len(window) for i in range(n)]})
        self._window = []
        bar.set_postfix(loss=" ".join(f"{x:.2f}" for x in self.log[-1]["loss"]),
                        acc=" ".join(f"{x:.2f}" for x in self.log[-1]["acc"]), refresh=False)

    def evaluate(self, data: Examples) -> dict:
        return evaluate(self.model, data)

    def _evaluate(self, phase: str, epoch: int, epochs: int, validation: Examples) -> None:
        if not len(validation):
            return
        result = self.evaluate(validation)
        self.log.append({"kind": "eval", "step": self.step, "phase": phase, "epoch": epoch, **result})
        tqdm.write(f"{phase} epoch {epoch + 1}/{epochs} (step {self.step}): held-out loss "
                   f"{' '.join(f'{x:.3f}' for x in result['loss'])}, top-1 accuracy "
                   f"{' '.join(f'{x:.3f}' for x in result['acc'])}, tau@{self.args.n_predict} ~ "
                   f"{result['tau']:.3f}")


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
