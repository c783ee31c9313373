"""Prefix caching through the engine, on tiny random models: a prompt that starts with full blocks computed before
(by a finished request, or one still running) takes them and computes only the rest, and its output is the one it
gets with the cache off, for every method, alone and batched, greedy and seeded; a shared block is never written;
preemption, the static-buffer runner, reset and a new LLM behave; the counts are reported.

Every engine runs in fp32 on the test device; tokens are compared between engines on the same device and backend,
exactly. Seeded sampling is compared for every method, a draft chain verified by rejection sampling too: its seeded
tokens depend on its guesses (their distribution does not), and a prompt the cache holds but for its last token
guesses at the same steps as without the cache (from its first output token on). Its depth is fixed here
(``"adaptive": False``): the goodput policy's depth follows the forward costs each engine measures and each step's
load, which the cache changes, and so do a rejection-sampled chain's seeded tokens.
"""

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.cache.block_manager import slots_of
from nanospec.model.forward_batch import build_forward_batch
from nanospec.model.mlp_speculator import save_mlp_speculator
from tiny import assert_no_leak, assert_same_kv, make_tiny_llama, most_common_successors, successor_speculator

BLOCK = 4
BASE = list(range(40, 70))  # 30 tokens: 7 full blocks and 2 tokens
PROMPTS = [BASE + [5, 6], BASE + [7, 8, 9], BASE[:16], BASE[:17], [9, 9, 9, 9, 9, 9, 9, 9, 5], [9] * 8 + [5, 7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix_target")
    make_tiny_llama(path, seed=1, max_pos=256)
    return str(path)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix_draft")  # another shape: a mix-up of the two pools would show
    make_tiny_llama(path, seed=2, layers=1, num_heads=2, num_kv_heads=1, hidden=32, max_pos=256)
    return str(path)


@pytest.fixture(scope="module")
def speculator(tmp_path_factory, target, device):
    """An MLP speculator that guesses the token that most often followed each token in plain greedy decoding."""
    plain = make_llm(target, device, enable_prefix_caching=False)
    outs = plain.generate(PROMPTS, GREEDY)
    model = successor_speculator(most_common_successors([p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)]),
                                 plain.config.hidden_size, plain.config.vocab_size)
    return str(save_mlp_speculator(model, tmp_path_factory.mktemp("prefix_mlp"), dtype=torch.float32))


def make_llm(target, device, **kwargs):
    return LLM(target, **{"num_blocks": 128, "block_size": BLOCK, "device": device, "dtype": "float32", **kwargs})


METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 3, "max_candidates": 3, "adaptive": False},
    "lookahead": {"method": "lookahead", "window_size": 2, "ngram_size": 3, "guess_set_size": 2, "adaptive": False},
    "draft": {"method": "draft", "num_speculative_tokens": 3, "adaptive": False},
    "draft_coupled": {"method": "draft", "num_speculative_tokens": 3, "acceptance": "coupled", "adaptive": False},
    "draft_tree": {"method": "draft", "num_speculative_tokens": 3, "tree_top_k": 2, "tree_budget": 5,
                   "adaptive": False},
    "mlp": {"method": "mlp_speculator", "adaptive": False},
    "mlp_tree": {"method": "mlp_speculator", "tree_top_k": 2, "prompt_lookup": True},
}


def spec_config(name, draft, speculator):
    config = METHODS[name]
    if config is None:
        return None
    if config["method"] == "draft":
        return {**config, "model": draft}
    if config["method"] == "mlp_speculator":
        return {**config, "model": speculator}
    return config


@pytest.mark.parametrize("name", list(METHODS))
def test_outputs_with_the_cache_equal_outputs_without(name, target, draft, speculator, device):
    """Each prompt alone (each one after the others: later ones find the earlier ones' blocks), then all in one
    batch (all find cached blocks), then in the other order, then as a conversation's next turn (the prompt, its
    answer and more: the answer's blocks are found too); the cache-off engine gives the reference."""
    config = spec_config(name, draft, speculator)
    on = make_llm(target, device, speculative_config=config)
    off = make_llm(target, device, speculative_config=config, enable_prefix_caching=False)
    for params in [GREEDY, SEEDED]:
        expected = [off.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
        assert [on.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS] == expected
        assert [o.outputs[0].token_ids for o in on.generate(PROMPTS, params)] == expected
        assert [o.outputs[0].token_ids for o in on.generate(PROMPTS[::-1], params)] == expected[::-1]
        turns = [p + answer + [7, 8] for p, answer in zip(PROMPTS, expected)]
        assert [o.outputs[0].token_ids for o in on.generate(turns, params)] == \
            [o.outputs[0].token_ids for o in off.generate(turns, params)]
    stats = on.stats()
    assert stats["prefix_cache_hits"] > stats["prefix_cache_queries"] / 2, stats
    assert off.stats()["prefix_cache_hits"] == off.stats()["prefix_cache_queries"] == 0
    if config is not None and config["method"] == "draft":  # the draft's pool has its own prefix cache
        assert on.engine.speculator.proposer.block_manager.stats.hits > 0
    assert_no_leak(on)
    assert_no_leak(off)


@pytest.mark.parametrize("name, temperature", [("plain", 0), ("ngram_tree", 0), ("draft", 0), ("mlp", 0),
                                               ("draft", 0.8)], ids=["plain", "ngram_tree", "draft", "mlp",
                                                                     "draft_seeded"])
def test_a_request_that_hits_a_prefix_another_running_request_is_still_filling(name, temperature, target, draft,
                                                                               speculator, device):
    """A runs; after some steps B starts with A's prompt and A's first 6 output tokens (37 tokens: 9 full blocks,
    which A holds and goes on writing past, and one token to compute); both then run together, sharing blocks (on
    a CPU, B's copy of them: see BlockManager), and both get their cache-off tokens."""
    config = spec_config(name, draft, speculator)
    params = SamplingParams(temperature=temperature, max_tokens=20, seed=3, ignore_eos=True)
    off = make_llm(target, device, speculative_config=config, enable_prefix_caching=False)
    on = make_llm(target, device, speculative_config=config)
    a_prompt = BASE + [5]
    expected_a = off.generate([a_prompt], params)[0].outputs[0].token_ids
    stream = on.stream(a_prompt, params)
    got_a = []
    while len(got_a) < 6:
        got_a = next(stream).token_ids
    b_prompt = a_prompt + got_a[:6]
    expected_b = off.generate([b_prompt], params)[0].outputs[0].token_ids
    b = on.stream(b_prompt, params)
    got_b = next(b).token_ids  # B's first step (A steps with it): B now holds A's blocks
    bm = on.engine.block_manager
    assert on.stats()["prefix_cache_hits"] >= len(a_prompt) // BLOCK * BLOCK
    if bm.consecutive:  # a CPU pool: A holds the blocks after its prompt's, so B takes a run and a copy of them
        b_table = on.engine.sequences[max(on.engine.sequences)].block_table
        assert b_table == list(range(b_table[0], b_table[0] + len(b_table))), b_table
    else:
        assert sum(count == 2 for count in bm.ref_counts) >= len(a_prompt) // BLOCK, "A and B share A's prompt blocks"
    for out in b:
        got_b = out.token_ids
    for out in stream:
        got_a = out.token_ids
    assert (got_a, got_b) == (expected_a, expected_b)
    assert_no_leak(on)


@pytest.mark.parametrize("name", ["ngram_tree", "draft_tree", "lookahead"])
def test_shared_blocks_are_never_written(name, target, draft, speculator, device):
    """The K/V of every named block (target and draft) is bit for bit the same after a batch of requests that
    share them, guess past them (trees: their accepted paths' K/V moved) and roll back."""
    config = spec_config(name, draft, speculator)
    llm = make_llm(target, device, speculative_config=config, num_blocks=256)
    llm.generate([BASE + [5]], GREEDY)
    pools = [(llm.engine.block_manager, llm.engine.kv_cache)]
    proposer = llm.engine.speculator.proposer
    if hasattr(proposer, "block_manager"):
        pools.append((proposer.block_manager, proposer.kv_cache))
    before = []
    for bm, kv in pools:
        named = {block: name for block, name in enumerate(bm.block_hashes) if name is not None}
        assert len(named) >= len(BASE) // BLOCK
        before.append((named, kv.data[:, :, list(named)].clone()))
    outs = llm.generate([BASE + [5], BASE + [7, 7, 7], BASE[:13] + [40, 41, 42] * 4], GREEDY)
    assert all(o.num_cached_tokens >= 12 for o in outs)
    for (bm, kv), (named, data) in zip(pools, before):
        assert all(bm.block_hashes[b] == n for b, n in named.items()), "a named block was evicted"
        assert torch.equal(kv.data[:, :, list(named)], data), "a shared block was written"
    assert_no_leak(llm)


@pytest.mark.parametrize("name", ["plain", "ngram_tree", "draft", "draft_tree"])
def test_cached_blocks_hold_the_kv_of_their_tokens(name, target, draft, speculator, device):
    """After requests of every shape (trees compacted, guesses rolled back, a finish mid-step), the K/V of every
    block the cache names, in the target's pool and the draft's, is what a fresh prefill of the tokens computes
    (to fp32 rounding: ``tiny.assert_same_kv``)."""
    config = spec_config(name, draft, speculator)
    llm = make_llm(target, device, speculative_config=config, num_blocks=256)
    outs = llm.generate(PROMPTS, GREEDY)
    turns = [p + o.outputs[0].token_ids + [7, 8] for p, o in zip(PROMPTS, outs)]
    outs = llm.generate(turns, GREEDY)
    pools = [(llm.engine.block_manager, llm.engine.kv_cache, llm.model)]
    proposer = llm.engine.speculator.proposer
    if hasattr(proposer, "block_manager"):
        pools.append((proposer.block_manager, proposer.kv_cache, proposer.model))
    for bm, kv, model in pools:
        checked = 0
        for prompt, out in zip(turns, outs):
            tokens = prompt + out.outputs[0].token_ids
            named = bm.cached_prefix(tokens + [0])  # the blocks that hold tokens' full blocks
            if len(named) < 1:
                continue
            fresh: list[int] = []
            bm.reserve(fresh, len(tokens))
            model.forward(build_forward_batch([tokens], [0], [fresh], BLOCK, [[len(tokens) - 1]], device), kv)
            span = range(len(named) * BLOCK)
            assert_same_kv(kv, model.config.num_hidden_layers, slots_of(named, BLOCK, span),
                           slots_of(fresh, BLOCK, span))
            bm.free(fresh)
            checked += len(named)
        assert checked >= 10
    assert_no_leak(llm)


def test_preemption_and_recompute_with_the_cache(target, draft, device):
    """A pool too small for the batch: preempted requests are recomputed (taking cached blocks, their own
    included) and every output is the cache-off one."""
    config = spec_config("draft", draft, None)
    expected = [o.outputs[0].token_ids for o in make_llm(target, device, speculative_config=config,
                                                         enable_prefix_caching=False).generate(PROMPTS * 2, GREEDY)]
    small = make_llm(target, device, speculative_config=config, num_blocks=24)
    outs = small.generate(PROMPTS * 2, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_no_leak(small)


@pytest.mark.parametrize("name", ["plain", "ngram_tree"])
def test_the_static_buffer_runner_with_the_cache(name, target, draft, speculator, device):
    """``enforce_eager=False`` (CUDA graphs on a GPU, the same static buffers on a CPU): a cached prompt's first
    step is a decode-shaped batch over a long context, laid into the buffers like any other."""
    config = spec_config(name, draft, speculator)
    off = make_llm(target, device, speculative_config=config, enable_prefix_caching=False)
    on = make_llm(target, device, speculative_config=config, enforce_eager=False)
    expected = [off.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert [on.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS] == expected
    assert [o.outputs[0].token_ids for o in on.generate(PROMPTS, GREEDY)] == expected
    assert on.stats()["prefix_cache_hits"] > 0
    assert_no_leak(on)


def test_counts_the_last_prompt_token_is_computed_and_reset(target, device):
    llm = make_llm(target, device)
    assert llm.stats()["prefix_cache_queries"] == llm.stats()["prefix_cache_hits"] == 0
    first = llm.generate([BASE], GREEDY)[0]
    assert first.num_cached_tokens == 0
    # K/V exists for the prompt and all but the last output token: (30 + 12 - 1) // 4 = 10 full blocks, named
    assert llm.kv_cache_stats()["cached_blocks"] == 10
    again = llm.generate([BASE], GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 28  # 7 full blocks; the 30th token is computed for its logits
    assert llm.generate([BASE[:16]], GREEDY)[0].num_cached_tokens == 12  # 4 full blocks, the last one computed
    assert llm.generate([BASE + first.outputs[0].token_ids[:3]], GREEDY)[0].num_cached_tokens == 32
    assert llm.stats()["prefix_cache_queries"] == 30 + 30 + 16 + 33
    assert llm.stats()["prefix_cache_hits"] == 28 + 12 + 32
    stream = llm.stream(BASE, GREEDY)
    next(stream)
    assert not llm.reset_prefix_cache(), "a running request holds blocks"
    stream.close()
    assert llm.reset_prefix_cache()
    assert llm.kv_cache_stats()["cached_blocks"] == 0
    assert llm.generate([BASE], GREEDY)[0].num_cached_tokens == 0
    assert_no_leak(llm)


def test_a_new_llm_starts_with_an_empty_cache(target, tmp_path, device):
    """The cache lives in its engine: a new LLM, here over other weights of the same shape, finds nothing."""
    llm = make_llm(target, device)
    llm.generate([BASE], GREEDY)
    other_path = tmp_path / "other"
    make_tiny_llama(other_path, seed=5, max_pos=256)
    other = make_llm(str(other_path), device)
    plain = make_llm(str(other_path), device, enable_prefix_caching=False)
    expected = plain.generate([BASE], GREEDY)[0].outputs[0].token_ids
    out = other.generate([BASE], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == expected


def test_enable_prefix_caching_must_be_a_bool(target):
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False, got 'yes'"):
        LLM(target, enable_prefix_caching="yes")
