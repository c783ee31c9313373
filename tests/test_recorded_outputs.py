"""Greedy outputs of every speculative method on real benchmark prompts equal those recorded before the
engine was restructured (and so equal each other): a guard that a refactoring changed no token.

The record (``tests/data/recorded_greedy.json``) holds fp32 CPU outputs of the embedded SmolLM2 with float weights
(``quantization=None``); the
whole record, all 16 prompts and sampled outputs too, is checked by ``benchmarks/check_outputs.py``.
"""

import json
from pathlib import Path

import pytest

from nanospec import LLM, SamplingParams
from nanospec.convert import convert
from nanospec.model.embedded import embedded_model_path
from tiny import assert_no_leak

pytestmark = pytest.mark.slow

RECORD = json.loads((Path(__file__).parent / "data" / "recorded_greedy.json").read_text())
PROMPTS = [json.loads(line)["prompt"]
           for line in (Path(__file__).parents[1] / "benchmarks" / "prompts.jsonl").read_text().splitlines()]
METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 5, "max_candidates": 3, "tree_budget": 8},
    "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 2, "adaptive": False},
    "draft": {"method": "draft", "num_speculative_tokens": 3, "adaptive": False},
    "draft_tree": {"method": "draft", "num_speculative_tokens": 3, "tree_top_k": 2, "tree_budget": 5},
}


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2_4_layers")
    convert(embedded_model_path(), path, num_layers=4)
    return path


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_outputs_are_as_recorded(method, draft_path):
    config = METHODS[method]
    if config is not None and config["method"] == "draft":
        config = {**config, "model": str(draft_path)}
    # explicitly float weights in fp32 on the CPU: what was recorded
    llm = LLM(dtype="float32", device="cpu", quantization=None, speculative_config=config)
    indices = sorted(RECORD["outputs"], key=int)
    chats = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[int(i)]}]))
             for i in indices]
    params = SamplingParams(temperature=0, max_tokens=RECORD["max_tokens"])
    for i, ids in zip(indices, chats):  # one at a time, as recorded
        assert llm.generate([ids], params)[0].outputs[0].token_ids == RECORD["outputs"][i], f"prompt {i}"
    assert_no_leak(llm)
