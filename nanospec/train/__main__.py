"""Train an MLP speculator (:mod:`nanospec.model.mlp_speculator`) or an EAGLE-3 head
(:mod:`nanospec.model.eagle3`) for a target model, on the target's own outputs.

    python -m nanospec.train --out DIR                 # the embedded SmolLM2, the shipped settings
    python -m nanospec.train --kind eagle3 --out DIR   # an EAGLE-3 head (see nanospec.train.eagle3_run)
    python -m nanospec.train --model M --out DIR --hot-vocab 4096 --seed 0
    python -m nanospec.train --out DIR --resume        # go on from DIR's last checkpoint

Three parts, each cached in ``DIR/cache`` (or ``--cache``) so a rerun or ``--resume`` skips what is done
(:mod:`~nanospec.train.record`, :mod:`~nanospec.train.data`, :mod:`~nanospec.train.loop`):

1. **Record.** The target answers every prompt of the prompt set (``nanospec/train/prompts.jsonl``, made by
   :mod:`nanospec.train.prompts`; never the benchmark's prompts), each through the chat template exactly as
   ``benchmarks/bench_spec.py`` encodes a prompt: greedily, then ``--sampled-runs`` times sampled at
   ``--temperature`` (seeded) for every ``--sampled-every``-th prompt. Generation runs many prompts at once
   (continuous batching over a paged KV cache, straight on the model layer) and keeps, for every generated
   token, the target's final hidden state (after its final norm) at the position whose logits gave that token:
   exactly what a decode or verify step hands the speculator at run time, so no second pass over the text is
   needed. The prefill computes the prompt's hidden states too: past the prompts' common head (chat template,
   system prompt) they are kept as well, and phase 1 learns the prompt text from them (``--no-prompt-text``:
   not). Hidden states are stored as float16. Every core by default (``--threads``); on a machine shared with other
   work, one thread avoids threads waiting on each other for a busy core.
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
import shlex
import sys
import time
from pathlib import Path

import torch

from nanospec.model.llama import Llama
from nanospec.model.loader import open_checkpoint
from nanospec.model.mlp_speculator import save_mlp_speculator
from nanospec.train.data import (PROMPT_SET, concat_examples, encode_chat, held_out_prompts, hot_vocabulary,
                                 load_prompt_set, make_examples)
from nanospec.train.eagle3_run import eagle3_aux_layers, train_eagle3
from nanospec.train.loop import Trainer, evaluate, new_speculator, plot, target_head
from nanospec.train.record import Recording, record


KIND_DEFAULTS = {
    "mlp": {"sampled_runs": 1, "n_predict": 3, "inner_dim": 0, "hot_vocab": 4096, "epochs_greedy": 6,
            "batch_size": 256, "lr": 3e-3, "warmup": 100},
    "eagle3": {"sampled_runs": 0, "n_predict": 4, "inner_dim": 768, "hot_vocab": 4096, "epochs_greedy": 4,
               "batch_size": 512, "lr": 3e-3, "warmup": 50},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nanospec.train", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kind", choices=sorted(KIND_DEFAULTS), default="mlp",
                   help="what to train: an MLP speculator or an EAGLE-3 head (nanospec.train.eagle3_run)")
    p.add_argument("--model", default=None, help="target: HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--prompts", default=str(PROMPT_SET), help="JSONL prompt set ({'prompt': ...} per line)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--cache", default=None, help="where recordings are kept (default OUT/cache)")
    p.add_argument("--max-tokens", type=int, default=96, help="longest recorded continuation")
    p.add_argument("--record-batch", type=int, default=64, help="sequences generated at once")
    p.add_argument("--sampled-runs", type=int, default=None,
                   help="sampled continuations per prompt (0: greedy only; mlp 1, eagle3 0: it trains on greedy)")
    p.add_argument("--sampled-every", type=int, default=8,
                   help="sampled continuations for every N-th prompt only (1: all of them)")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled continuations")
    p.add_argument("--n-predict", type=int, default=None,
                   help="stages (tokens guessed per step; mlp 3), or an EAGLE-3 head's unrolled steps (eagle3 4)")
    p.add_argument("--inner-dim", type=int, default=None,
                   help="stage width (mlp 0: the target's hidden size), or an EAGLE-3 head's intermediate_size "
                        "(eagle3 768; 0: the target's)")
    p.add_argument("--hot-vocab", type=int, default=None,
                   help="score only the K most frequent tokens (0: all; mlp 4096), or an EAGLE-3 head's draft "
                        "vocabulary (eagle3 4096)")
    p.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="share emb/head/ln across stages")
    p.add_argument("--scale-input", action=argparse.BooleanOptionalAction, default=True,
                   help="normalize the hidden state first")
    p.add_argument("--init-from-target", action=argparse.BooleanOptionalAction, default=True,
                   help="start emb and head from the target's embeddings (needs inner-dim = hidden size)")
    p.add_argument("--prompt-text", action=argparse.BooleanOptionalAction, default=True,
                   help="phase 1 also learns the prompts' own text (its hidden states come free with the prefill)")
    p.add_argument("--epochs-greedy", type=int, default=None,
                   help="phase 1: epochs over the greedy continuations (mlp 6, eagle3 4)")
    p.add_argument("--epochs-mixed", type=int, default=1, help="phase 2: epochs over greedy + sampled")
    p.add_argument("--distill", type=float, default=0.5,
                   help="weight w of the target's own next-token distribution in the loss: (1 - w) * CE(token) + "
                        "w * CE(target's distribution), both over the scored set (0: the tokens alone)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="examples per step (mlp 256), or padded rows per step, whole sequences (eagle3 512)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (mlp 3e-3, eagle3 3e-3)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (mlp 100, eagle3 50)")
    p.add_argument("--val-every", type=int, default=10,
                   help="every N-th prompt of each category is held out (0: none; else at least 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default, every core); on a busy machine use 1")
    p.add_argument("--resume", action="store_true", help="go on from OUT/checkpoint")
    p.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (with a checkpoint) after this many steps, as if interrupted; --resume goes on")
    args = p.parse_args(argv)
    for name, value in KIND_DEFAULTS[args.kind].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
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
    if not -2**62 <= args.seed <= 2**62:  # it seeds torch generators (64-bit), offset per run and phase
        raise ValueError(f"--seed must be between -2**62 and 2**62, got {args.seed}")
    if args.val_every == 1:
        raise ValueError("--val-every 1 holds out every prompt, leaving none to train on: give 0 (none held out) or "
                         "at least 2")
    if args.epochs_greedy + args.epochs_mixed < 1:
        raise ValueError("nothing to train: --epochs-greedy and --epochs-mixed are both 0")
    if args.sampled_runs and not 0 < args.temperature < math.inf:
        raise ValueError(f"--temperature must be a finite number > 0 for sampled runs, got {args.temperature}")
    if not 0 <= args.distill <= 1:
        raise ValueError(f"--distill must be in [0, 1], got {args.distill}")
    if not 0 < args.lr < math.inf:
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    if not 0 <= args.weight_decay < math.inf:
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    for name, path in (("--out", args.out), ("--cache", args.cache)):
        if path == "":
            raise ValueError(f"{name} is empty: give a directory")
        if path is not None:
            nearest = next(p for p in (Path(path), *Path(path).parents) if p.exists())
            if not nearest.is_dir():
                raise ValueError(f"{name} {path}: {nearest} exists and is not a directory")
    if args.model and Path(args.out).exists() and Path(args.out).resolve() == Path(args.model).resolve():
        raise ValueError(f"--out {args.out} is the target model's directory, whose config.json and "
                         "model.safetensors the output would replace: choose another one")
    if args.kind == "eagle3" and args.sampled_runs:
        raise ValueError("--kind eagle3 trains on the greedy continuations only: pass --sampled-runs 0")
    if args.kind == "mlp" and args.tie_weights and args.n_predict < 2:
        raise ValueError("--tie-weights needs --n-predict >= 2 (or pass --no-tie-weights)")
    if vocab_size is not None and args.hot_vocab > vocab_size:
        raise ValueError(f"--hot-vocab {args.hot_vocab} is larger than the target's vocabulary ({vocab_size})")


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        check_args(args)
        return train(args, command=["python", "-m", "nanospec.train", *(sys.argv[1:] if argv is None else argv)])
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
    if args.resume and not (out / "checkpoint" / "state.json").is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoint'}")
    prompt_rows = load_prompt_set(args.prompts)[:args.limit or None]
    opened = open_checkpoint(args.model)  # the config and tokenizer, checked against the arguments before any weight
    config, tokenizer = opened.config, opened.tokenizer()
    check_args(args, config.vocab_size)
    if args.kind == "eagle3":
        eagle3_aux_layers(config.num_hidden_layers)
    if args.kind == "mlp" and args.inner_dim and args.init_from_target and args.inner_dim != config.hidden_size:
        print(f"--init-from-target needs --inner-dim {config.hidden_size} (the target's hidden size): random init")
    prompt_ids = [encode_chat(tokenizer, row["prompt"]) for row in prompt_rows]
    longest = max(map(len, prompt_ids))
    if longest + args.max_tokens > config.max_position_embeddings:
        raise ValueError(f"--max-tokens {args.max_tokens}: the longest prompt ({longest} tokens) and its continuation "
                         f"would pass the target's context of {config.max_position_embeddings} tokens")
    checkpoint = opened.load(torch.float32)
    target = Llama(config, checkpoint.tensors, "cpu", torch.float32, max_len=longest + args.max_tokens)
    del checkpoint
    eos_ids = list(tokenizer.eos_token_ids)
    if args.kind == "eagle3":
        def record_aux(args, target, prompt_ids, aux_layers):
            return record_runs(args, target, prompt_ids, eos_ids, aux_layers)
        return train_eagle3(args, target, prompt_rows, prompt_ids, record_aux, command, started)
    runs, recordings, timings = record_runs(args, target, prompt_ids, eos_ids)
    phases, validation, held_out, hot_ids = training_data(args, prompt_rows, recordings, config.vocab_size)
    model = new_speculator(args, config.hidden_size, config.vocab_size, hot_ids, target, args.seed)
    teacher_head = target_head(target)[model.hot_token_ids].float() if args.distill else None
    del target
    total_steps = sum(-(-len(data) // args.batch_size) * epochs for _, data, epochs in phases)
    trainer = Trainer(model, args, teacher_head, total_steps, out, timings, settings_of(args))
    exit_code = trainer.run_to_end(phases, validation, args.resume, started)
    if exit_code is not None:
        return exit_code
    write_outputs(args, command, trainer, prompt_rows, runs, recordings, held_out)
    return 0


def record_runs(args, target: Llama, prompt_ids: list[list[int]], eos_ids: list[int], aux_layers: tuple = ()):
    """The greedy recording of every prompt and the sampled ones of every ``sampled_every``-th, each from the cache
    when it holds one made with the same settings. Returns (runs, recordings, timings). With ``aux_layers`` (an
    EAGLE-3 head's), the greedy one keeps every prompt row from position 0 and the auxiliary states too."""
    cache = Path(args.cache) if args.cache else Path(args.out) / "cache"
    digest = hashlib.sha256(json.dumps([args.model and str(Path(args.model).resolve()), prompt_ids]).encode())
    runs = [("greedy", 0.0, args.seed)] + [(f"sampled{r}", args.temperature, args.seed + 1 + r)
                                           for r in range(args.sampled_runs)]
    cache.mkdir(parents=True, exist_ok=True)
    recordings, timings = [], {}
    shared = 0  # the prompts' common head (chat template, system prompt) is not kept as prompt text
    while all(len(ids) > shared + 1 and ids[shared] == prompt_ids[0][shared] for ids in prompt_ids):
        shared += 1
    for name, temperature, seed in runs:
        chosen = list(range(len(prompt_ids))) if name == "greedy" else \
            list(range(0, len(prompt_ids), args.sampled_every))
        meta = {"prompts": digest.hexdigest(), "max_tokens": args.max_tokens, "temperature": temperature,
                "seed": seed, "batch": args.record_batch, "chosen": len(chosen),
                "prompt_rows_from": (0 if aux_layers else shared) if name == "greedy" else None}
        if aux_layers:
            meta["aux_layers"] = list(aux_layers)
        path = cache / f"{name}{'-aux' if aux_layers else ''}.safetensors"
        recording = Recording.load(path, meta)
        if recording is None:
            t0 = time.time()
            recording = record(target, [prompt_ids[i] for i in chosen], eos_ids, prompt_index=chosen,
                               max_tokens=args.max_tokens, temperature=temperature, seed=seed,
                               batch=args.record_batch, desc=f"recording {name}",
                               prompt_rows_from=meta["prompt_rows_from"], aux_layers=aux_layers)
            seconds = time.time() - t0
            recording.save(path, meta)
            timings[f"record_{name}_s"] = round(seconds, 1)
            print(f"recorded {name}: {recording.num_generated} tokens of {len(chosen)} prompts in {seconds:.0f} s "
                  f"({recording.num_generated / seconds * 60:.0f} tokens/min)")
        else:
            print(f"{name}: {recording.num_generated} tokens, from the cache {path}")
        recordings.append(recording)
    return runs, recordings, timings


def training_data(args, prompt_rows: list[dict], recordings: list[Recording], vocab_size: int):
    """Every ``val_every``-th prompt of each category held out (all its continuations); phase 1 on the greedy
    continuations (and the prompts' own text), phase 2 on greedy and sampled. Returns (phases, held-out examples,
    held-out prompts, hot vocabulary or None)."""
    held_out = held_out_prompts(prompt_rows, args.val_every)
    held = set(held_out)
    train_ids = [i for i in range(len(prompt_rows)) if i not in held]
    n = args.n_predict
    greedy_train = make_examples(recordings[0], train_ids, n, prompt_text=args.prompt_text)
    mixed_train = concat_examples([make_examples(r, train_ids, n) for r in recordings])
    validation = make_examples(recordings[0], held_out, n)  # greedy: what the benchmark measures
    hot_ids = None
    if args.hot_vocab:
        hot_ids = hot_vocabulary(recordings, train_ids, args.hot_vocab, vocab_size)
        covered = torch.isin(validation.targets[:, 0], hot_ids).float().mean().item() if len(validation) else 0
        print(f"hot vocabulary: {args.hot_vocab} tokens cover {covered:.1%} of the held-out targets")
    phases = [("greedy", greedy_train, args.epochs_greedy), ("mixed", mixed_train, args.epochs_mixed)]
    phases = [p for p in phases if p[2] > 0 and len(p[1])]
    if not phases:
        raise ValueError("no training examples: the recorded continuations are all shorter than 2 tokens")
    steps = sum(-(-len(data) // args.batch_size) * epochs for _, data, epochs in phases)
    print(f"training: {len(greedy_train)} greedy / {len(mixed_train)} mixed examples, {len(validation)} held-out; "
          f"{' then '.join(f'{e} epochs {name}' for name, _, e in phases)} = {steps} steps of {args.batch_size}")
    return phases, validation, held_out, hot_ids


def write_outputs(args, command: list[str], trainer: Trainer, prompt_rows: list[dict], runs: list,
                  recordings: list[Recording], held_out: list[int]) -> None:
    """The speculator (config.json + model.safetensors), ``training_summary.json`` and ``training.png``."""
    out, model, n, timings = Path(args.out), trainer.model, args.n_predict, trainer.timings
    final = next((r for r in reversed(trainer.log) if r["kind"] == "eval"), None)
    metadata = {"command": " ".join(shlex.quote(c) for c in command), "seed": args.seed,
                "target": str(args.model or "embedded SmolLM2-135M-Instruct"),
                "data": f"{Path(args.prompts).name}: {len(prompt_rows)} prompts ({len(held_out)} held out), "
                        f"{' + '.join(f'{r.num_generated} {name}' for (name, _, _), r in zip(runs, recordings))} "
                        f"tokens, max {args.max_tokens} per continuation",
                "settings": json.dumps(settings_of(args)), "timings": json.dumps(timings),
                "held_out": json.dumps(final and {k: final[k] for k in ("loss", "acc", "tau")})}
    save_mlp_speculator(model, out, metadata=metadata)
    by_category = {}
    for category in sorted({prompt_rows[i].get("category") for i in held_out} - {None, ""}):
        prompts = [i for i in held_out if prompt_rows[i].get("category") == category]
        result = evaluate(model, make_examples(recordings[0], prompts, n))
        by_category[category] = {k: result[k] for k in ("acc", "tau", "positions")}
        print(f"held out, {category}: tau@{n} ~ {result['tau']:.2f}, top-1 accuracy "
              f"{' '.join(f'{x:.2f}' for x in result['acc'])}")
    (out / "training_summary.json").write_text(json.dumps(metadata | {
        "settings": settings_of(args), "timings": timings, "held_out": final and {
            k: final[k] for k in ("loss", "acc", "tau", "positions")},
        "held_out_by_category": by_category}, indent=1) + "\n")
    plot(trainer.log, out / "training.png", n)
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} "
          f"({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB); timings {timings}")


def settings_of(args) -> dict:
    keys = ("model", "prompts", "limit", "max_tokens", "sampled_runs", "sampled_every", "prompt_text", "temperature",
            "n_predict", "inner_dim", "hot_vocab",
            "tie_weights", "scale_input", "init_from_target", "epochs_greedy", "epochs_mixed", "distill", "batch_size",
            "lr", "weight_decay", "warmup", "val_every", "seed")
    return {k: getattr(args, k) for k in keys}


if __name__ == "__main__":
    sys.exit(main())
