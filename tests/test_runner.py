"""The model runner's static-buffer path (CUDA graphs on a GPU; the same padding run eagerly on a CPU) gives the
eager path's logits and tokens: buckets, padding rows and sequences, tree masks, every method.

Every engine runs in fp32 on the test device; the static path is compared with the eager path on the same device
and backend: logits to fp32 rounding (the padded batch has more rows, so other matmul shapes), tokens exactly.
``ModelRunner.execute`` takes host batches (it moves them to the device in one copy), so the batches handed to it
here are built on the CPU, as the engine builds them."""

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.model.forward_batch import build_forward_batch
from nanospec.model.runner import buckets
from tiny import assert_no_leak, make_tiny_llama

PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9, [100, 101, 102, 103, 3], [11, 12]]
CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 3, "max_candidates": 3},
    "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 2, "adaptive": False},
    "self_draft": {"method": "draft", "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("runner_target")
    make_tiny_llama(path, seed=1, tie=True, layers=2, max_pos=256)
    return path


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def test_padded_logits_equal_eager_logits(target, device):
    """One decode batch of 3 sequences with 1, 3 and 2 new tokens (bucket: 4 sequences x 4 rows, one of them all
    padding), causal and with a tree mask: the real rows' logits are the eager ones."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    # enforce_eager explicit on both: the default on CUDA is the static path (graphs)
    eager = LLM(str(target), num_blocks=64, block_size=4, device=device, dtype="float32", max_num_seqs=4,
                enforce_eager=True, speculative_config=spec)
    padded = LLM(str(target), num_blocks=64, block_size=4, device=device, dtype="float32", max_num_seqs=4,
                 enforce_eager=False, speculative_config=spec)
    for llm in (eager, padded):  # the same context in both caches: prefill 3 prompts in blocks 0-2, 3-5, 6-8
        tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
        prefill = build_forward_batch([p[:8] for p in PROMPTS[:3]], [0, 0, 0], tables, 4, [[7]] * 3, "cpu")
        llm.engine.runner.execute(prefill)
    new = [[5], [9, 33, 7], [44, 45]]
    masks = [None, torch.tensor([[1], [3], [5]]), None]  # node 2 of the second sequence sees the root, not node 1
    for tree_masks in (None, masks):
        batch = build_forward_batch(new, [8, 8, 8], tables, 4, [range(len(t)) for t in new], "cpu",
                                    positions=[None, [8, 9, 9], None] if tree_masks else None, tree_masks=tree_masks)
        want, want_hidden = eager.engine.runner.execute(batch, hidden_states=True)
        got, got_hidden = padded.engine.runner.execute(batch, hidden_states=True)
        assert got.shape == want.shape == (6, eager.config.vocab_size)
        assert got_hidden.shape == want_hidden.shape == (6, eager.config.hidden_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32; on CUDA TF32 is off in the tests
        torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-5, atol=1e-5)
        assert padded.engine.runner.execute(batch)[1] is None  # hidden states only when asked for
    assert set(padded.engine.runner.graphs) == {(4, 4, False), (4, 4, True)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_static_path_generates_what_eager_generates(target, device, name):
    config = CONFIGS[name]
    if config is not None and config["method"] == "draft":
        config = {**config, "model": str(target)}
    outs = {}
    for eager in (True, False):
        llm = LLM(str(target), num_blocks=256, block_size=4, device=device, dtype="float32", max_num_seqs=8,
                  enforce_eager=eager, speculative_config=config)
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        sampled = SamplingParams(temperature=0.8, max_tokens=16, seed=3, ignore_eos=True)
        outs[eager] = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], params)]
                       for params in (greedy, sampled) for n in (1, 3, 5)]  # buckets of 1, 4 and 8 sequences
        if not eager:
            assert any(key[0] > 1 for key in llm.engine.runner.graphs)  # the static path did run
        assert_no_leak(llm)
    assert outs[False] == outs[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graphs_are_captured_and_replayed(target):
    llm = LLM(str(target), num_blocks=256, block_size=4, device="cuda", dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    eager = LLM(str(target), num_blocks=256, block_size=4, device="cuda", dtype="float32", enforce_eager=True,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == \
        [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]
    assert llm.engine.runner.graphs and all(g.graph is not None for g in llm.engine.runner.graphs.values())
