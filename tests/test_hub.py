"""A Hugging Face Hub id as the model (vLLM's ``LLM("org/name")``): its snapshot from the Hub's cache, here a cache
laid out as ``huggingface_hub`` lays it out, offline; an id the Hub cannot give is a clear error before any work."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanospec.model.hub import resolve_model_path
from checkout import checkout_env
from tiny import make_tiny_llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _run(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = checkout_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_a_hub_id_loads_its_cached_snapshot(tmp_path):
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    make_tiny_llama(snapshot, seed=1, tie=True, layers=2, max_pos=128)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    code = ("from nanospec import LLM, SamplingParams\n"
            "import json, sys\n"
            "p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
            "by_id = LLM('tiny-org/tiny-llama', num_blocks=32, block_size=4)\n"
            f"by_path = LLM({str(snapshot)!r}, num_blocks=32, block_size=4)\n"
            "draft = LLM('tiny-org/tiny-llama', num_blocks=32, block_size=4, speculative_config={'method': 'draft', "
            "'model': 'tiny-org/tiny-llama', 'num_speculative_tokens': 2, 'acceptance': 'coupled'})\n"
            "llms = (by_id, by_path, draft)\n"
            "print(json.dumps([llm.generate([[5, 9, 33]], p)[0].outputs[0].token_ids for llm in llms]))\n")
    run = _run(code, tmp_path / "hub")
    assert run.returncode == 0, run.stderr
    by_id, by_path, with_draft = json.loads(run.stdout.strip().splitlines()[-1])
    assert by_id == by_path == with_draft and len(by_id) == 6  # (the draft, a Hub id too, is the target itself)
    assert str(snapshot) in run.stderr  # the log says where the model came from


def test_a_hub_id_the_hub_cannot_give_is_named(tmp_path):
    run = _run("from nanospec import LLM\nLLM('no-such-org/no-such-model')", tmp_path / "empty-hub")
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError: model 'no-such-org/no-such-model' is not a local path")
    assert "hf download no-such-org/no-such-model --local-dir DIR" in last
    run = _run("from nanospec import LLM\nLLM(speculative_config={'method': 'eagle3', 'model': 'no-such-org/head'})",
               tmp_path / "empty-hub")
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError: speculative_config['model'] (the EAGLE-3 head): model "
                           "'no-such-org/head' is not a local path"), last


def test_local_paths_stay_local(tmp_path):
    assert resolve_model_path(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="model path does not exist: /no/such/model"):
        resolve_model_path("/no/such/model")
    with pytest.raises(FileNotFoundError, match="model path does not exist: ./no-such.gguf"):
        resolve_model_path("./no-such.gguf")


def test_the_server_refuses_a_missing_model_before_starting(tmp_path, capsys):
    from nanospec.serve.__main__ import main

    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert f"error: model path does not exist: {tmp_path / 'missing'}" in capsys.readouterr().err
