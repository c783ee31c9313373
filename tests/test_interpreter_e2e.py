"""The whole engine through the Triton kernels equals the engine through the torch reference, fp32, on the test
device: on the CPU the kernels run in Triton's interpreter, on CUDA compiled.

The two backends round differently (on CUDA: compiled kernels against torch ops; in the interpreter too, by less),
so besides the tokens the test compares the logits each backend gives for the same text, with a tolerance, and the
tokens only up to a first difference that is a near tie in the reference's logits (tests/tiny.py). Sampled tokens
follow the same rule with the engine's own sampler (the exponential race at the request's seed and the token's
position): a flip is rounding only if nudging the two tokens' logits by NEAR_TIE lets the sampler pick either.

Tiny model, few tokens: the interpreter costs ~10 ms per program instance.
"""

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.kernels.backend import backend
from nanospec.kernels.sampling import sample_ref
from tiny import (LOGITS_TOLERANCE, assert_same_tokens_up_to_a_near_tie, forward_logits, greedy_pick,
                  make_tiny_llama)

PROMPTS = [[5, 9, 33, 5, 9, 33, 5], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = tmp_path_factory.mktemp("interp_target")
    make_tiny_llama(target, seed=3, layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=48)
    draft = tmp_path_factory.mktemp("interp_draft")
    make_tiny_llama(draft, seed=4, layers=1, hidden=32, num_heads=2, num_kv_heads=1, head_dim=16, ffn=48)
    return target, draft


def make_llm(path, device, **kwargs):
    """Eager on CUDA too: a CUDA graph replays the kernels it captured whichever backend is chosen after."""
    return LLM(str(path), num_blocks=32, block_size=4, device=device, dtype="float32", enforce_eager=True, **kwargs)


def run(llm, params, backend_name):
    with backend(backend_name):
        outs = llm.generate(PROMPTS, params)
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]
    return [o.outputs[0].token_ids for o in outs]


def engine_pick(params, prompt_len):
    """How the engine picks output token i from its logits row (the torch reference of its sampler): the argmax when
    greedy, else the exponential race with the request's seed at the token's position, prompt_len + i."""
    if params.temperature == 0:
        return greedy_pick

    def draw(row, i):
        return int(sample_ref(row[None], torch.tensor([params.temperature]),
                              torch.tensor([params.top_k], dtype=torch.int32), torch.tensor([params.top_p]),
                              torch.tensor([params.seed]), torch.tensor([prompt_len + i]))[0])
    return draw


def assert_backends_agree(llm, got, expected, params):
    """``got`` (Triton) against ``expected`` (torch): the logits for each prompt and the reference's tokens agree
    (LOGITS_TOLERANCE); the tokens, up to a near tie."""
    for prompt, ours, theirs in zip(PROMPTS, got, expected):
        text = prompt + theirs[:-1]
        with backend("torch"):
            reference = forward_logits(llm, text)
        with backend("triton"):
            kernels = forward_logits(llm, text)
        torch.testing.assert_close(kernels, reference, **LOGITS_TOLERANCE)
        assert_same_tokens_up_to_a_near_tie(ours, theirs, lambda i: reference[len(prompt) - 1 + i],
                                            engine_pick(params, len(prompt)))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=6, seed=5,
                                                   ignore_eos=True)], ids=["greedy", "sampled"])
def test_plain_engine_triton_equals_reference(paths, device, params):
    target, _ = paths
    llm = make_llm(target, device)
    assert_backends_agree(llm, run(llm, params, "triton"), run(llm, params, "torch"), params)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_engine_triton_is_lossless(paths, device, method):
    """Speculation through the kernels against plain decoding through the reference: equal up to a near tie (the
    backends differ); speculation itself changes no token (tests/test_spec.py: same backend, exact)."""
    target, draft = paths
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft":
        config["model"] = str(draft)
    plain = make_llm(target, device)
    expected = run(plain, greedy, "torch")
    got = run(make_llm(target, device, speculative_config=config), greedy, "triton")
    assert_backends_agree(plain, got, expected, greedy)
