"""The from-scratch Llama on paged KV against transformers' LlamaForCausalLM, on tiny random models.

Ours runs in fp32 on the test device (the Triton kernels on CUDA, the torch reference on the CPU); transformers,
the oracle, in fp32 on the CPU. The two round differently (other kernels, other summation orders, another device),
so logits are compared with a tolerance and greedy tokens up to a near tie (tests/tiny.py)."""

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.model.forward_batch import build_forward_batch
from tiny import LOGITS_TOLERANCE, assert_same_tokens_up_to_a_near_tie, make_tiny_llama

CONFIGS = {
    "gqa_tied": dict(tie=True, num_heads=4, num_kv_heads=2),
    "gqa_untied": dict(tie=False, num_heads=6, num_kv_heads=2, head_dim=8, hidden=48),
    "mha_untied": dict(tie=False, num_heads=4, num_kv_heads=4, layers=3),
    "llama3_rope": dict(tie=True, rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_llama(path, **CONFIGS[request.param])
    return path, hf


def full_logits(llm: LLM, ids: list[int], block_size: int) -> torch.Tensor:
    """Logits at every position, by a prefill of the first half then one-token decodes (paged KV), on ``llm``'s
    device; returned on the CPU."""
    engine = llm.engine
    table: list[int] = []
    engine.block_manager.reserve(table, len(ids))
    split = len(ids) // 2
    chunks = [(0, ids[:split])] + [(i, [ids[i]]) for i in range(split, len(ids))]
    out = []
    for start, tokens in chunks:
        batch = build_forward_batch([tokens], [start], [table], block_size, [list(range(len(tokens)))], llm.device)
        out.append(llm.model.compute_logits(llm.model.forward(batch, engine.kv_cache)).cpu())
    engine.block_manager.free(table)
    return torch.cat(out)


def test_logits_match_transformers(tiny, device):
    path, hf = tiny
    llm = LLM(str(path), num_blocks=64, block_size=4, device=device, dtype="float32")
    ids = torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = full_logits(llm, ids, 4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, **LOGITS_TOLERANCE)
    assert llm.kv_cache_stats()["free_blocks"] == 64


def test_greedy_generation_matches_transformers(tiny, device):
    """Greedy tokens equal transformers', up to the first near tie in transformers' logits (if any: then either
    token is right and the texts may go apart; see tests/tiny.py)."""
    path, hf = tiny
    llm = LLM(str(path), num_blocks=64, block_size=4, device=device, dtype="float32")
    prompts = [[5, 9, 33, 100, 7], [42] * 11, list(range(50, 70))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, (o.outputs[0] for o in outs)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, len(prompt):].tolist()
        assert_same_tokens_up_to_a_near_tie(out.token_ids, ref_tokens, lambda i: ref.logits[i][0])
        assert out.num_steps == 24 and out.finish_reason == "length"
    assert llm.kv_cache_stats()["free_blocks"] == 64
