"""python -m nanospec.train --kind eagle3 on a tiny random Llama: the loss goes down, a run is reproducible for a
seed, the output loads as ``{"method": "eagle3", "model": DIR}`` with greedy output equal to plain decoding's, and
the training-time unroll computes exactly the guesses the proposer drafts at run time."""

import json

import pytest
import torch
from safetensors.torch import load_file

from nanospec import LLM, SamplingParams
from nanospec.model.eagle3 import load_eagle3_head
from nanospec.model.loader import load_checkpoint
from nanospec.train.__main__ import main
from nanospec.train.data import IGNORE
from nanospec.train.eagle3 import Batch, Unroller
from tiny import make_tiny_llama

PROMPTS = ["Say hi.", "Add 2 and 3.", "Name a colour.", "Translate: cat", "Count to three.", "List two fruits."]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    return path, make_tiny_llama(path, seed=3, tie=True, layers=3, max_pos=512)


def run(target, prompts, recordings, out) -> int:
    return main(["--kind", "eagle3", "--model", str(target[0]), "--out", str(out), "--prompts", str(prompts),
                 "--cache", str(recordings), "--max-tokens", "24", "--record-batch", "4", "--hot-vocab", "96",
                 "--n-predict", "3", "--inner-dim", "48", "--epochs-greedy", "12", "--batch-size", "96", "--lr",
                 "1e-2", "--warmup", "2", "--val-every", "3", "--save-every", "1000"])


@pytest.fixture(scope="module")
def trained(target, prompts, recordings, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    assert run(target, prompts, recordings, out) == 0
    return out


def test_loss_goes_down_and_the_summary_reports_each_depth(trained):
    log = [json.loads(line) for line in (trained / "training_log.jsonl").read_text().splitlines()]
    train = [r for r in log if r["kind"] == "train"]
    assert len(train) >= 2 and all(last < first for first, last in zip(train[0]["loss"], train[-1]["loss"]))
    summary = json.loads((trained / "training_summary.json").read_text())
    assert summary["kind"] == "eagle3" and "train_s" in summary["timings"]
    assert len(summary["held_out"]["acc"]) == 3 and summary["held_out"]["tau"] >= 1
    assert set(summary["held_out_by_category"]) == {"test"}
    tensors = load_file(trained / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["lm_head.weight"].shape == (96, 64)
    assert all(v.dtype == torch.float16 for k, v in tensors.items() if k not in ("d2t", "t2d"))


def test_same_seed_same_weights(trained, target, prompts, recordings, tmp_path):
    assert run(target, prompts, recordings, tmp_path) == 0
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(trained / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_loads_as_eagle3_and_greedy_equals_plain(trained, target, device):
    ids = [[5, 9, 33, 5, 9, 33, 5], list(range(40, 60)), [11, 12]]
    plain = LLM(str(target[0]), num_blocks=128, block_size=4, device=device, dtype="float32")
    expected = [o.outputs[0].token_ids for o in plain.generate(ids, GREEDY)]
    for spec in ({"method": "eagle3", "model": str(trained), "num_speculative_tokens": 3},
                 {"method": "eagle3", "model": str(trained), "num_speculative_tokens": 3, "tree_top_k": 4}):
        llm = LLM(str(target[0]), num_blocks=128, block_size=4, device=device, dtype="float32",
                  speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY)] == expected


def test_the_unroll_drafts_what_the_proposer_drafts(trained, target, device):
    """After a prompt's prefill the engine's chain equals the unroll's argmax at the prompt's last row, its tokens
    teacher-forced with the engine's own guesses."""
    path, model = target
    head, aux_layers = load_eagle3_head(trained, load_checkpoint(str(path), torch.float32).config, "cpu", torch.float32)
    unroller = Unroller(head, model.model.embed_tokens.weight.detach().float(), 3, 64)
    llm = LLM(str(path), num_blocks=128, block_size=4, device=device, dtype="float32",
              speculative_config={"method": "eagle3", "model": str(trained), "num_speculative_tokens": 3,
                                  "adaptive": False})
    for prompt in ([5, 9, 33, 5, 9, 33, 5], list(range(40, 60))):
        seq_id = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        llm.engine.step()
        guesses = llm.engine.sequences[seq_id].spec_state.ranked.token_ids
        with torch.no_grad():
            states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
            aux = torch.cat([states[i][0] for i in aux_layers], dim=-1)[None]
            tokens = torch.tensor([prompt[1:] + [first] + guesses + [IGNORE]])
            outs = unroller(Batch(aux, tokens, torch.zeros_like(tokens), torch.ones(1, len(prompt), dtype=torch.bool)))
            drafted = [int(head.to_target(head.logits(out[0, -1]).argmax())) for out in outs]
        assert drafted == guesses
        while llm.engine.has_unfinished():
            llm.engine.step()


def test_recorded_aux_states_are_the_layers_the_head_reads(trained, target, recordings):
    """Every recorded row (from position 0) holds the residual stream entering the head's layers, as transformers'
    ``hidden_states[i]``, and the final hidden state at the same position."""
    from safetensors import safe_open

    path, model = target
    with safe_open(str(recordings / "greedy-aux.safetensors"), framework="pt") as f:
        rec = {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads((trained / "config.json").read_text())
    layers = sorted(config["eagle_aux_hidden_state_layer_ids"])
    assert layers == [0, 1, 2]  # (2, L // 2, L - 3) for L = 3
    checked = 0
    for s in range(len(rec["offsets"]) - 1):
        begin, end = int(rec["offsets"][s]), int(rec["offsets"][s + 1])
        with torch.no_grad():
            prompt_index = int(rec["prompt_index"][s])
            prompt = encode_prompt(path, prompt_index)
            full = prompt + rec["tokens"][begin + len(prompt) - 1:end].tolist()
            states = model(torch.tensor([full]), output_hidden_states=True).hidden_states
        n = end - begin
        aux = torch.cat([states[i][0, :n] for i in layers], dim=-1)
        torch.testing.assert_close(rec["aux"][begin:end].float(), aux, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(rec["hidden"][begin:end].float(), states[-1][0, :n], atol=2e-2, rtol=2e-2)
        checked += 1
    assert checked == len(PROMPTS)


def encode_prompt(path, index: int) -> list[int]:
    from nanospec.train.data import encode_chat
    return encode_chat(load_checkpoint(str(path), torch.float32).tokenizer, PROMPTS[index])


def test_the_head_directory_says_how_it_is_served(trained, tmp_path):
    """``speculative_config.json`` beside the head gives k, tree_top_k and tree_budget where the caller sets none,
    and prompt_lookup where the caller leaves it out; other keys are refused."""
    import shutil

    from nanospec.speculative.config import parse_speculative_config

    head = shutil.copytree(trained, tmp_path / "head")
    assert parse_speculative_config({"method": "eagle3", "model": str(head)}).num_speculative_tokens == 4
    (head / "speculative_config.json").write_text('{"num_speculative_tokens": 5, "tree_top_k": 4, "tree_budget": 12}')
    served = parse_speculative_config({"method": "eagle3", "model": str(head)})
    assert (served.num_speculative_tokens, served.tree_top_k, served.tree_budget) == (5, 4, 12)
    mine = parse_speculative_config({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    assert (mine.num_speculative_tokens, mine.tree_top_k, mine.tree_budget) == (3, 1, None)
    (head / "speculative_config.json").write_text('{"prompt_lookup": true}')
    assert parse_speculative_config({"method": "eagle3", "model": str(head)}).prompt_lookup is True
    (head / "speculative_config.json").write_text('{"max_candidates": 2}')
    with pytest.raises(ValueError, match="unknown keys"):
        parse_speculative_config({"method": "eagle3", "model": str(head)})
