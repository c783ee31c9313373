"""python -m nanospec.train on a tiny random Llama: what it writes, that it is reproducible and
resumable, that its recorded hidden states are the target's, and that bad arguments fail clearly."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanospec.model.llama import Llama
from nanospec.model.loader import load_checkpoint
from nanospec.model.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig, load_mlp_speculator
from nanospec.train.__main__ import main
from nanospec.train.data import IGNORE, PROMPT_SET, Examples, encode_chat, held_out_prompts, load_prompt_set
from nanospec.train.loop import stage_losses, teacher_hidden
from nanospec.train.record import generate_with_hidden, teacher_forced_hidden
from tiny import make_tiny_llama

SHIPPED = Path(__file__).resolve().parent.parent / "nanospec" / "speculators" / "smollm2-135m-instruct"
PROMPTS = ["Say hi.", "Add 2 and 3.", "Name a colour.", "Translate: cat", "Count to three.", "List two fruits."]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_tiny_llama(path, seed=3, tie=True, layers=2, max_pos=512)
    return path


def run(target, prompts, recordings, out, *extra) -> int:
    return main(["--model", str(target), "--out", str(out), "--prompts", str(prompts), "--cache", str(recordings),
                 "--max-tokens", "8", "--record-batch", "4", "--sampled-every", "2", "--hot-vocab", "48",
                 "--n-predict", "3", "--epochs-greedy", "1", "--epochs-mixed", "1", "--batch-size", "16",
                 "--warmup", "2", "--val-every", "3", "--save-every", "3", *extra])


@pytest.fixture(scope="module")
def trained(target, prompts, recordings, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    assert run(target, prompts, recordings, out) == 0
    return out


def test_output_loads_with_the_config_asked(trained):
    model = load_mlp_speculator(trained, emb_dim=64, vocab_size=320)
    c = model.config
    assert (c.emb_dim, c.inner_dim, c.n_predict, c.vocab_size, c.hot_vocab_size) == (64, 64, 3, 320, 48)
    assert c.tie_weights and c.scale_input
    assert model.hot_token_ids.unique().numel() == 48
    assert all(v.dtype in (torch.float16, torch.int64) for v in load_file(trained / "model.safetensors").values())
    log = [json.loads(line) for line in (trained / "training_log.jsonl").read_text().splitlines()]
    evals = [r for r in log if r["kind"] == "eval"]
    assert evals and len(evals[-1]["acc"]) == 3 and evals[-1]["tau"] >= 1
    summary = json.loads((trained / "training_summary.json").read_text())
    assert summary["seed"] == 0 and "train_s" in summary["timings"]
    assert set(summary["held_out_by_category"]) == {"test"} and summary["held_out_by_category"]["test"]["tau"] >= 1
    guesses = model.propose(torch.randn(2, 64), torch.tensor([5, 6]), 3)
    assert guesses.shape == (2, 3) and bool(torch.isin(guesses, model.hot_token_ids).all())


def test_same_seed_same_weights(trained, target, prompts, recordings, tmp_path):
    assert run(target, prompts, recordings, tmp_path) == 0
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(trained / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_resume_equals_a_straight_run(trained, target, prompts, recordings, tmp_path):
    assert run(target, prompts, recordings, tmp_path, "--stop-after", "4") == 0
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text())["step"] == 4
    assert not (tmp_path / "model.safetensors").exists()
    assert run(target, prompts, recordings, tmp_path, "--resume") == 0
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(trained / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    straight = load_file(trained / "checkpoint" / "checkpoint.safetensors")  # fp32 weights and AdamW state too
    resumed = load_file(tmp_path / "checkpoint" / "checkpoint.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight if not k.startswith("rng."))


def test_recorded_hidden_states_are_the_targets(target):
    """Each recorded row is the final hidden state that gave its token: equal to a teacher-forced forward over
    prompt + continuation, and greedy tokens are its argmax."""
    checkpoint = load_checkpoint(target, torch.float32)
    model = Llama(checkpoint.config, checkpoint.tensors, "cpu", torch.float32)
    prompts = [encode_chat(checkpoint.tokenizer, p) for p in PROMPTS[:3]]
    tokens, hidden, prompt_hidden = generate_with_hidden(model, prompts, max_tokens=6, eos_ids=[2], batch=2,
                                                         prompt_rows_from=4)
    forced = teacher_forced_hidden(model, [p + t for p, t in zip(prompts, tokens)])
    for p, t, h, ph, f in zip(prompts, tokens, hidden, prompt_hidden, forced):
        torch.testing.assert_close(h.float(), f[len(p) - 1:len(p) - 1 + len(t)], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(ph.float(), f[4:len(p) - 1], atol=2e-2, rtol=1e-2)
        assert model.compute_logits(f[len(p) - 1:len(p) - 1 + len(t)]).argmax(-1).tolist() == t


def test_distillation_loss_is_the_targets_distribution():
    """Stage i's soft target is softmax(head @ h[t + 1 + i]): the state that produced its hard target. With
    w = 1 the loss is the cross-entropy against it, with w = 0 the plain token loss, between them the mix."""
    torch.manual_seed(0)
    emb, vocab, n = 16, 24, 3
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=emb, inner_dim=emb, n_predict=n, vocab_size=vocab))
    hidden = torch.randn(10, emb)
    data = Examples(hidden, torch.tensor([0, 6, 7]), torch.randint(0, vocab, (3, n)),
                    torch.tensor([[1, 2, 3], [4, 5, IGNORE], [6, IGNORE, IGNORE]]))
    pick = torch.tensor([2, 0, 1])
    states = teacher_hidden(data, pick, n)
    assert torch.equal(states[1], hidden[1:4]) and torch.equal(states[2, :2], hidden[7:9])
    assert torch.equal(states[0, 0], hidden[8]) and torch.equal(states[0, 2], hidden[9])  # row 10 does not exist
    # (clamped; its target is ignored)
    head = torch.randn(vocab, emb)
    args = (model, hidden[data.rows[pick]], data.inputs[pick], data.targets[pick])
    hard = stage_losses(*args)[0]
    soft = stage_losses(*args, (states, head, 1.0))[0]
    mixed = stage_losses(*args, (states, head, 0.25))[0]
    logits = model(*args[1:3])
    for i in range(n):
        valid = data.targets[pick][:, i] != IGNORE
        p = torch.softmax(states[:, i] @ head.T, -1)
        expected = -(p * torch.log_softmax(logits[i], -1)).sum(-1)[valid].mean()
        torch.testing.assert_close(soft[i], expected)
        torch.testing.assert_close(mixed[i], 0.75 * hard[i] + 0.25 * expected)


@pytest.mark.parametrize("extra, message", [
    (["--hot-vocab", "1000"], "larger than the target's vocabulary"),
    (["--n-predict", "0"], "--n-predict must be at least 1"),
    (["--n-predict", "1"], "--tie-weights needs --n-predict >= 2"),
    (["--resume"], "no checkpoint"),
    (["--temperature", "0"], "--temperature must be a finite number > 0"),
    (["--distill", "1.5"], "--distill must be in [0, 1]"),
    (["--temperature", "inf"], "--temperature must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0"),
    (["--seed", str(2**64)], "--seed must be between -2**62 and 2**62"),
    (["--val-every", "1"], "--val-every 1 holds out every prompt"),
    (["--kind", "eagle3", "--val-every", "1"], "--val-every 1 holds out every prompt"),
    (["--out", ""], "--out is empty"),
    (["--cache", ""], "--cache is empty"),
])
def test_bad_arguments(target, prompts, recordings, tmp_path, capsys, extra, message):
    assert run(target, prompts, recordings, tmp_path / "out", *extra) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--out", "--cache"])
def test_output_directory_that_is_a_file_refused_before_loading(target, prompts, recordings, tmp_path, capsys,
                                                                  monkeypatch, option):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr("nanospec.train.__main__.load_prompt_set", lambda path: pytest.fail("loaded the prompts"))
    assert run(target, prompts, recordings, tmp_path / "out", option, str(tmp_path / "file" / "sub")) == 2
    assert f"{option} {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} exists and is not a directory" in \
        capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--max-tokens", "600"], "--max-tokens 600: the longest prompt"),
    (["--kind", "eagle3"], "which must be three distinct layers of the target, which has L = 2"),
])
def test_what_the_target_cannot_do_refused_before_its_weights(target, prompts, recordings, tmp_path, capsys,
                                                              monkeypatch, extra, message):
    monkeypatch.setattr("nanospec.model.loader.safe_open", lambda *a, **k: pytest.fail("read the weights"))
    assert run(target, prompts, recordings, tmp_path / "out", *extra) == 2
    assert message in capsys.readouterr().err


def test_output_directory_that_is_the_target_refused(target, prompts, recordings, capsys):
    before = (target / "model.safetensors").read_bytes()
    assert run(target, prompts, recordings, target) == 2
    assert f"--out {target} is the target model's directory" in capsys.readouterr().err
    assert (target / "model.safetensors").read_bytes() == before


def test_unknown_model_and_prompt_set(prompts, recordings, tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--prompts", str(prompts)]) == 2
    assert "model path does not exist" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "prompt set not found" in capsys.readouterr().err
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    assert main(["--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "latin1.jsonl")]) == 2
    assert f"{tmp_path / 'latin1.jsonl'}: not UTF-8 text" in capsys.readouterr().err


def test_resume_with_other_settings_is_refused(trained, target, prompts, recordings, tmp_path, capsys):
    assert run(target, prompts, recordings, tmp_path, "--stop-after", "2") == 0
    assert run(target, prompts, recordings, tmp_path, "--resume", "--lr", "0.01") == 2
    assert "other settings" in capsys.readouterr().err
    shutil.copytree(target, tmp_path / "another")  # another target (of the same shape)
    assert run(target, prompts, recordings, tmp_path, "--resume", "--model", str(tmp_path / "another")) == 2
    assert "other settings" in capsys.readouterr().err


def test_shipped_prompt_set():
    rows = load_prompt_set(PROMPT_SET)
    held_out = {json.loads(line)["prompt"] for line in
                (Path(__file__).resolve().parent.parent / "benchmarks" / "prompts.jsonl").read_text().splitlines()}
    assert len(rows) >= 300 and len({r["category"] for r in rows}) == 8
    assert not held_out & {r["prompt"] for r in rows}


def test_every_category_is_held_out_alike():
    # the shipped set cycles through 8 categories: every 10th prompt of the whole set would miss half of them
    rows = load_prompt_set(PROMPT_SET)
    per_category = Counter(rows[i]["category"] for i in held_out_prompts(rows, 10))
    sizes = Counter(r["category"] for r in rows)
    assert per_category == {c: (n + 4) // 10 for c, n in sizes.items()}
    assert held_out_prompts([{"prompt": str(i)} for i in range(25)], 10) == [5, 15]
    assert held_out_prompts(rows, 0) == []


def test_shipped_speculator_loads_against_the_embedded_model():
    if not (SHIPPED / "config.json").is_file():
        pytest.skip(f"no shipped speculator at {SHIPPED}")
    try:
        checkpoint = load_checkpoint(None, None)
    except FileNotFoundError as error:
        pytest.skip(f"the embedded model is not installed ({error})")
    c = checkpoint.config
    model = load_mlp_speculator(SHIPPED, emb_dim=c.hidden_size, vocab_size=c.vocab_size)
    assert model.config.n_predict >= 3
    assert (SHIPPED / "model.safetensors").stat().st_size < 16 * 2**20
    guesses = model.propose(torch.randn(1, c.hidden_size), torch.tensor([1]), 3)
    assert guesses.shape == (1, 3) and int(guesses.max()) < c.vocab_size
