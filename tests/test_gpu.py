"""GPU only (marked gpu: skipped, with the reason, where there is no CUDA device): the engine on CUDA (compiled
Triton kernels, cuBLAS) against the engine on the CPU (the torch reference), both in fp32 without TF32.

The two round differently, so the logits each gives for the same text are compared with LOGITS_TOLERANCE and the
greedy tokens up to a first difference that is a near tie in the CPU's logits (tests/tiny.py)."""

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.kernels.backend import use_triton
from tiny import LOGITS_TOLERANCE, assert_no_leak, assert_same_tokens_up_to_a_near_tie, forward_logits, make_tiny_llama

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9, [100, 101, 102, 103, 3], [11, 12]]


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_target")
    make_tiny_llama(path, seed=1, tie=True, layers=3, max_pos=256)
    return path


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "ngram"])
def test_cuda_engine_matches_the_cpu_engine(target_path, speculative_config):
    cuda = LLM(str(target_path), num_blocks=256, block_size=4, device="cuda", dtype="float32",
               speculative_config=speculative_config)
    cpu = LLM(str(target_path), num_blocks=256, block_size=4, device="cpu", dtype="float32")
    assert cuda.device.type == "cuda" and use_triton(torch.empty(1, device="cuda"))  # the compiled kernels run
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    compared = 0
    for prompt, ours, theirs in zip(PROMPTS, cuda.generate(PROMPTS, params), cpu.generate(PROMPTS, params)):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        text = prompt + theirs.token_ids[:-1]
        reference = forward_logits(cpu, text)
        torch.testing.assert_close(forward_logits(cuda, text).cpu(), reference, **LOGITS_TOLERANCE)
        compared += assert_same_tokens_up_to_a_near_tie(ours.token_ids, theirs.token_ids,
                                                        lambda i: reference[len(prompt) - 1 + i])
    assert compared >= len(PROMPTS) * params.max_tokens // 2  # near ties are rare: most tokens were compared
    assert_no_leak(cuda)
