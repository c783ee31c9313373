"""Speculation over a weight-only quantized target equals plain decoding of that same quantized target: greedy and
seeded, for every method (a quantized draft and an int8 EAGLE-3 head included), alone and batched, with no KV block
leaked. The CPU kernels give each token's logits independently of the batch (``test_quantization``), so equality is
exact."""

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.device import cpu_has_fast_bfloat16
from nanospec.model.linear import Int8Linear
from nanospec.model.mlp_speculator import save_mlp_speculator
from test_eagle3 import build_successor_head
from tiny import assert_no_leak, make_tiny_llama, most_common_successors, successor_speculator

PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9, [100, 101, 102, 103, 3], [11, 12]]
PARAMS = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11, ignore_eos=True)]
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 3, "max_candidates": 3, "prompt_lookup_max": 2,
                   "adaptive": False},
    "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 3, "adaptive": False},
    "int4_draft_coupled": {"method": "draft", "num_speculative_tokens": 3, "acceptance": "coupled",
                           "quantization": "int4", "adaptive": False},
    "int8_draft_tree": {"method": "draft", "num_speculative_tokens": 2, "tree_top_k": 2, "quantization": "int8",
                        "adaptive": False},
    "mlp_speculator": {"method": "mlp_speculator", "tree_top_k": 2, "prompt_lookup": True, "adaptive": False},
    "eagle3_int8": {"method": "eagle3", "num_speculative_tokens": 3, "prompt_lookup": True, "adaptive": False},
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = tmp_path_factory.mktemp("quantized_target")
    model = make_tiny_llama(target, seed=1, tie=True, layers=3, max_pos=256)
    draft = tmp_path_factory.mktemp("quantized_draft")
    make_tiny_llama(draft, seed=2, tie=False, layers=1, num_heads=2, num_kv_heads=1, hidden=32, max_pos=256)
    return target, draft, model


def quantized(path, **kwargs) -> LLM:
    return LLM(str(path), quantization="int4", num_blocks=256, block_size=4, device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def plain_outputs(paths):
    llm = quantized(paths[0])
    assert llm.model.quantization == "int4-g32 (13)"
    return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] for params in PARAMS]


@pytest.fixture(scope="module")
def speculator(paths, plain_outputs, tmp_path_factory):
    sequences = [prompt + out for outputs in plain_outputs for prompt, out in zip(PROMPTS, outputs)]
    llm = quantized(paths[0])
    model = successor_speculator(most_common_successors(sequences), llm.config.hidden_size, llm.config.vocab_size)
    return save_mlp_speculator(model, tmp_path_factory.mktemp("speculator"), dtype=torch.float32)


@pytest.fixture(scope="module")
def eagle3_head(paths, plain_outputs, tmp_path_factory):
    sequences = [prompt + out for outputs in plain_outputs for prompt, out in zip(PROMPTS, outputs)]
    return build_successor_head(tmp_path_factory.mktemp("eagle3_head"), paths[2], sequences)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_speculation_over_a_quantized_target_equals_its_plain_decoding(paths, plain_outputs, speculator, eagle3_head,
                                                                        method):
    config = dict(METHODS[method])
    models = {"draft": paths[1], "mlp_speculator": speculator, "eagle3": eagle3_head}
    if config["method"] in models:
        config["model"] = str(models[config["method"]])
    llm = quantized(paths[0], speculative_config=config)
    for j, params in enumerate(PARAMS):
        alone = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in PROMPTS]
        assert alone == plain_outputs[j], (method, j)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == plain_outputs[j], (method, j)
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0, stats
    if config["method"] == "mlp_speculator":  # bfloat16 as the target's CPU matmuls, where the CPU has it natively
        expected = torch.bfloat16 if cpu_has_fast_bfloat16() else torch.float32
        assert llm.engine.speculator.proposer.model.proj[0].weight.dtype == expected
    if config["method"] == "eagle3":  # over a CPU's weight-only kernels, the head's matrices are int8 too
        assert isinstance(llm.engine.speculator.proposer.head.fc.linear, Int8Linear)
    if config["method"] == "draft":
        kind = "int4-g32" if config["quantization"] == "int4" else "int8"
        assert llm.engine.speculator.proposer.model.quantization == f"{kind} (5)"
    assert_no_leak(llm)


def test_static_buffers_over_a_quantized_target(paths, plain_outputs):
    """Decode and verify steps through the runner's static buffers (``enforce_eager=False``: CUDA graphs' path, run
    eagerly on a CPU) give the same tokens."""
    llm = quantized(paths[0], enforce_eager=False, speculative_config=METHODS["ngram"])
    for j, params in enumerate(PARAMS):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == plain_outputs[j]
    assert llm.stats()["num_accepted_tokens"] > 0
    assert_no_leak(llm)
