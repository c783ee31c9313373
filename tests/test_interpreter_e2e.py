"""The whole engine through the Triton kernels (the interpreter on CPU) equals the reference backend.

Tiny model, few tokens: the interpreter costs ~10 ms per program instance.
"""

import pytest

from nanospec import LLM, SamplingParams
from nanospec.kernels.backend import backend
from tiny import make_tiny_llama

PROMPTS = [[5, 9, 33, 5, 9, 33, 5], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = tmp_path_factory.mktemp("interp_target")
    make_tiny_llama(target, seed=3, layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=48)
    draft = tmp_path_factory.mktemp("interp_draft")
    make_tiny_llama(draft, seed=4, layers=1, hidden=32, num_heads=2, num_kv_heads=1, head_dim=16, ffn=48)
    return target, draft


def run(path, params, backend_name, **kwargs):
    llm = LLM(str(path), num_blocks=32, block_size=4, **kwargs)
    with backend(backend_name):
        outs = llm.generate(PROMPTS, params)
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=6, seed=5,
                                                   ignore_eos=True)], ids=["greedy", "sampled"])
def test_plain_engine_triton_equals_reference(paths, params):
    target, _ = paths
    assert run(target, params, "triton") == run(target, params, "torch")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_engine_triton_is_lossless(paths, method):
    target, draft = paths
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft":
        config["model"] = str(draft)
    expected = run(target, greedy, "torch")
    assert run(target, greedy, "triton", speculative_config=config) == expected
