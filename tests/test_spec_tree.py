"""Token trees and lookahead decoding end to end on tiny random models: lossless, compacted KV, no leaks.

fp32 on the test device with its default backend, speculative against plain on the same device and backend: the
tokens must be equal, exactly (see tests/test_spec.py). The trees are verified whole and lookahead's window runs at
every step (``"adaptive": False``): with the goodput policy a random model's guesses would rarely be verified at all
(tests/test_spec.py runs trees and lookahead with it)."""

import pytest

from nanospec import LLM, SamplingParams
from nanospec.cache.block_manager import slots_of
from nanospec.model.forward_batch import build_forward_batch
from nanospec.speculative.proposal import Proposal, build_step_batch
from tiny import assert_no_leak, assert_same_kv, make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = [[5, 9, 33, 5, 9, 34, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9, [100, 101, 102, 103, 3], [11, 12]]
CONFIGS = {
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 4, "max_candidates": 3, "prompt_lookup_max": 2},
    "draft_tree": {"method": "draft", "num_speculative_tokens": 3, "tree_top_k": 2, "tree_budget": 7},
    "lookahead": {"method": "lookahead", "window_size": 4, "ngram_size": 3, "guess_set_size": 3},
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = tmp_path_factory.mktemp("tree_target")
    make_tiny_llama(target, seed=1, tie=True, layers=3, max_pos=256)
    draft = tmp_path_factory.mktemp("tree_draft")
    make_tiny_llama(draft, seed=2, tie=False, layers=1, num_heads=2, num_kv_heads=1, hidden=32, max_pos=256)
    return target, draft


@pytest.fixture(scope="module")
def plain(paths, device):
    return LLM(str(paths[0]), num_blocks=256, block_size=4, device=device, dtype="float32")


def make(paths, name, device, adaptive=False, **kwargs):
    config = dict(CONFIGS[name], adaptive=adaptive)
    if config["method"] == "draft":
        config["model"] = str(paths[1])
    return LLM(str(paths[0]), num_blocks=kwargs.pop("num_blocks", 256), block_size=4, speculative_config=config,
               device=device, dtype="float32", **kwargs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_is_lossless(paths, plain, name, device):
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = make(paths, name, device)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_draft_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_seeded_sampling_is_reproducible(paths, name, device):
    llm = make(paths, name, device)
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=24, seed=3, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
    b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
    assert a == b and all(len(t) == 24 for t in a)
    assert_no_leak(llm)


def test_lookahead_with_preemption_and_plain_requests(paths, plain, device):
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculate=False)] * 3
    prompts = (PROMPTS * 2)[:6]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = make(paths, "lookahead", device, num_blocks=40)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert_no_leak(llm)


def test_lookahead_window_runs_beside_verified_guesses_only(paths, plain, device):
    """Under the goodput policy lookahead's first node brings its window (priced as 1 + window tokens); where the
    policy verifies none of the trie, no window is fed, and the trie's first guesses are still checked. Here the policy
    verifies every guess at even steps and none at odd ones."""
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = make(paths, "lookahead", device, adaptive=True)
    speculator = llm.engine.speculator
    rankings, steps = [], []

    def choose(chances, num_tokens, num_seqs):
        rankings.append(chances)
        return [len(nodes) if len(rankings) % 2 == 0 else 0 for nodes in chances]
    speculator.policy.choose_nodes = choose
    propose = speculator.propose
    speculator.propose = lambda seqs: steps.append(propose(seqs)) or steps[-1]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    for nodes in (n for ranking in rankings for n in ranking if n):  # (chance, depth[, tokens]) in trie order
        assert [len(node) for node in nodes] == [3] + [2] * (len(nodes) - 1) and nodes[0][2] > 1
        assert [c for c, *_ in nodes] == sorted((c for c, *_ in nodes), reverse=True)
    proposals = [p for step in steps for p in step]
    fed = [p for p in proposals if len(p.fed()[0]) > len(p.token_ids)]
    assert fed and all(p.token_ids for p in fed)  # a window only beside guesses
    assert any(p.unverified_guesses for p in proposals)  # a trie left out: its first guesses checked
    assert_no_leak(llm)


def test_accepted_tree_path_kv_equals_plain_decoding(paths, device):
    """Force a tree whose accepted path is not contiguous in storage, then compare KV with a fresh prefill: equal to
    fp32 rounding (KV_TOLERANCE in tests/tiny.py). The path's K/V was computed in a tree-masked verify pass over 5
    rows, the fresh one in a causal prefill over 7: other matmul shapes (another summation order in BLAS / cuBLAS)
    and other attention tiles, so not bit for bit, more so on CUDA. The compaction itself copies K/V exactly; a
    wrong slot or RoPE position would be off by order 1, and assert_same_kv checks the bound can tell."""
    llm = LLM(str(paths[0]), num_blocks=64, block_size=4, device=device, dtype="float32")
    engine = llm.engine
    greedy_3 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    _, a, b = llm.generate([[5, 9, 33, 7]], greedy_3)[0].outputs[0].token_ids
    rid = engine.add_request([5, 9, 33, 7], GREEDY)
    seq = engine.sequences[rid]
    engine.step()  # prefill
    # the tree: root -> x (wrong), root -> a -> y (wrong), a -> b; the accepted path is a, b (nodes 1 and 3)
    proposal = Proposal([(a + 1) % 300, a, (b + 1) % 300, b], parents=[-1, -1, 1, 1])
    root = seq.num_tokens - 1
    engine.block_manager.reserve(seq.block_table, seq.num_tokens + 4)
    logits, _ = engine.runner.execute(build_step_batch([seq], [proposal], 4))
    (verdict,) = engine.speculator.verify([seq], [proposal], logits)  # walks the tree, compacts the accepted path
    assert verdict.path == [1, 3] and verdict.emitted[:2] == [a, b]
    n = root + 3  # root, a, b now contiguous
    # a fresh prefill of the same tokens in other blocks
    table: list[int] = []
    engine.block_manager.reserve(table, n)
    tokens = seq.token_ids + [a, b]
    llm.model.forward(build_forward_batch([tokens], [0], [table], 4, [[n - 1]], llm.device), engine.kv_cache)
    ours = slots_of(seq.block_table, 4, range(n))
    fresh = slots_of(table, 4, range(n))
    assert_same_kv(engine.kv_cache, llm.model.config.num_hidden_layers, ours, fresh)
    engine.block_manager.free(table)
    engine.abort(rid)
    assert_no_leak(llm)


@pytest.mark.parametrize("config, match", [
    ({"method": "lookahead", "ngram_size": 2}, "ngram_size"),
    ({"method": "lookahead", "window_size": 0}, "window_size"),
    ({"method": "ngram", "max_candidates": 0}, "max_candidates"),
    ({"method": "draft", "model": "x", "tree_top_k": 0}, "tree_top_k"),
])
def test_bad_tree_configs(paths, config, match, device):
    with pytest.raises(ValueError, match=match):
        LLM(str(paths[0]), num_blocks=64, block_size=4, speculative_config=config, device=device, dtype="float32")
