"""Speculative decoding end to end on tiny random models: lossless, fewer steps, no leaked blocks.

Every engine runs in fp32 on the test device with the default backend (the Triton kernels on CUDA, the torch
reference on the CPU), so speculative and plain greedy decoding are compared token for token, exactly: same
device, same backend, same dtype. (In bf16 a verify pass and a decode step may round a near tie apart; see
DESIGN.md.)"""

import pytest

from nanospec import LLM, SamplingParams
from nanospec.cache.block_manager import slots_of
from nanospec.model import loader
from nanospec.model.forward_batch import build_forward_batch
from nanospec.speculative.policy import AcceptanceEstimate
from tiny import assert_no_leak, assert_same_kv, fixed_costs, make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# repetitive prompts give the n-gram proposer something to find
PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9, [100, 101, 102, 103, 104, 105, 3], [11, 12]]


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_tiny_llama(path, seed=1, tie=True, layers=3, max_pos=256)
    return path


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    make_tiny_llama(path, seed=2, tie=False, layers=1, num_heads=2, num_kv_heads=1, hidden=32, max_pos=256)
    return path


@pytest.fixture(scope="module")
def plain(target_path, device):
    return LLM(str(target_path), num_blocks=256, block_size=4, device=device, dtype="float32")


def spec_llm(target_path, device, config, **kwargs):
    """Speculation without the adaptive policy, so every guess the proposer has is verified; fp32 on ``device``."""
    kwargs = {"num_blocks": 256, "block_size": 4, "device": device, "dtype": "float32", **kwargs}
    return LLM(str(target_path), speculative_config={"adaptive": False, **config}, **kwargs)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_is_lossless(target_path, device, plain, k):
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = spec_llm(target_path, device, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0
    assert sum(o.num_steps for o in outs) < sum(len(o.token_ids) for o in outs)
    assert_no_leak(llm)


@pytest.mark.parametrize("config", [{"method": "ngram", "prompt_lookup_max": 3},
                                    {"method": "lookahead", "window_size": 2, "ngram_size": 3, "guess_set_size": 2}],
                         ids=["ngram", "lookahead"])
def test_a_host_proposer_finds_its_guesses_once_a_step(target_path, device, plain, config, monkeypatch):
    """Under the policy the speculator asks for the ranking, then for the proposals: the search for guesses (the
    n-gram index's, lookahead's step) runs once a step for each sequence, not once for each question."""
    from nanospec.speculative.lookahead import LookaheadDecoder
    from nanospec.speculative.ngram import NgramProposer

    searches = []
    cls, name = (NgramProposer, "chain") if config["method"] == "ngram" else (LookaheadDecoder, "build_step")
    search = getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *args: searches.append(1) or search(self, *args))
    llm = LLM(str(target_path), num_blocks=256, block_size=4, device=device, dtype="float32",
              speculative_config=config)
    fixed_costs(llm, 0.0)
    expected = plain.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    out = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0]
    assert out.token_ids == expected
    assert len(searches) == out.num_steps - 1  # every step after the prefill
    assert_no_leak(llm)


@pytest.mark.parametrize("k", [1, 4])
def test_draft_greedy_is_lossless(target_path, device, draft_path, plain, k):
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = spec_llm(target_path, device, {"method": "draft", "model": str(draft_path), "num_speculative_tokens": k})
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in outs] == expected
    assert llm.stats()["num_draft_tokens"] > 0
    assert_no_leak(llm)


def test_a_pool_of_one_context_is_enough_when_a_step_could_feed_more(target_path, device, plain):
    """A step feeds no more than the context holds: lookahead's steps may feed 30 tokens, but under a context of
    16 a pool of 16 slots serves a request to the context's end."""
    llm = spec_llm(target_path, device, {"method": "lookahead"}, num_blocks=4, max_model_len=16)
    prompt = PROMPTS[3]
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 16
    expected = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=16 - len(prompt), ignore_eos=True))
    assert out.token_ids == expected[0].outputs[0].token_ids
    assert_no_leak(llm)


@pytest.mark.parametrize("k", [2, 4])
def test_target_as_its_own_draft_accepts_everything(target_path, device, plain, k):
    params = SamplingParams(temperature=0, max_tokens=1 + 5 * (k + 1), ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    llm = spec_llm(target_path, device, {"method": "draft", "model": str(target_path), "num_speculative_tokens": k})
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in outs] == expected
    for o in outs:
        assert o.num_accepted_tokens == o.num_draft_tokens == 5 * k
        assert o.num_steps == 6  # prefill + 5 steps of exactly k+1 tokens
    assert_no_leak(llm)


def test_no_guess_past_max_tokens_and_only_emitted_drafts_count(target_path, device):
    """max_tokens = 1 + (k + 1) + 2: the last step may verify one guess only (its bonus is the last token)."""
    k = 4
    params = SamplingParams(temperature=0, max_tokens=1 + (k + 1) + 2, ignore_eos=True)
    llm = spec_llm(target_path, device, {"method": "draft", "model": str(target_path), "num_speculative_tokens": k})
    for o in (out.outputs[0] for out in llm.generate(PROMPTS, params)):
        assert len(o.token_ids) == 8 and o.num_steps == 3
        assert o.num_draft_tokens == o.num_accepted_tokens == k + 1
    assert_no_leak(llm)


def test_draft_kv_after_many_steps_equals_a_fresh_prefill(target_path, device, draft_path):
    """The draft's K/V, built step by step (a prefill, one-token guesses, backfills of [d_k, bonus], rollbacks),
    equals a fresh prefill's of the same tokens, to fp32 rounding (KV_TOLERANCE in tests/tiny.py: the two run the
    matmuls over different numbers of rows, so they round differently, more so on CUDA; a wrong slot or position
    would be off by order 1, and assert_same_kv checks the bound can tell)."""
    k = 3
    llm = spec_llm(target_path, device, {"method": "draft", "model": str(draft_path), "num_speculative_tokens": k})
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    seq = engine.sequences[rid]
    for _ in range(12):
        engine.step()
    state = seq.spec_state
    n = state.num_cached
    assert n >= seq.num_tokens - 2  # at most [d_k, bonus] missing
    slots = slots_of(state.block_table, proposer.block_size, range(n))
    # a fresh draft prefill over the same tokens, in a separate region of the draft pool
    table: list[int] = []
    proposer.block_manager.reserve(table, n)
    batch = build_forward_batch([seq.token_ids[:n]], [0], [table], proposer.block_size, [[n - 1]],
                                proposer.model.device)
    proposer.model.forward(batch, proposer.kv_cache)
    fresh = slots_of(table, proposer.block_size, range(n))
    assert_same_kv(proposer.kv_cache, proposer.model.config.num_hidden_layers, slots, fresh)
    proposer.block_manager.free(table)
    engine.abort(rid)
    assert_no_leak(llm)


def test_mixed_batch_spec_and_opt_out(target_path, device, plain):
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculate=False)] * 2
    prompts = PROMPTS[:4]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = spec_llm(target_path, device, {"method": "ngram", "num_speculative_tokens": 4})
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in outs] == expected
    assert outs[1].num_draft_tokens == 0 and outs[3].num_draft_tokens == 0
    assert outs[0].num_draft_tokens > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_with_speculation_is_reproducible(target_path, device, draft_path, method):
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        config["model"] = str(draft_path)
    llm = spec_llm(target_path, device, config)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11, ignore_eos=True)
    a = [o.outputs[0] for o in llm.generate(PROMPTS[:2], params)]
    b = [o.outputs[0] for o in llm.generate(PROMPTS[:2], params)]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 30 for o in a)
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "ngram_tree", "draft", "draft_tree", "lookahead"])
def test_adaptive_speculation_is_lossless(target_path, device, draft_path, plain, method):
    """The goodput policy governs chains, trees and lookahead alike (a tree ranked as its nodes in order, node j with
    alpha^j; lookahead's first node bringing its window)."""
    config = {"method": method.removesuffix("_tree"), "num_speculative_tokens": 4}
    if method == "lookahead":
        config = {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 3}
    if method == "ngram_tree":
        config["max_candidates"] = 3
    if method == "draft_tree":
        config.update(tree_top_k=2, tree_budget=7)
    if method.startswith("draft"):
        config["model"] = str(draft_path)
    llm = LLM(str(target_path), num_blocks=256, block_size=4, speculative_config=config, device=device,
              dtype="float32")
    policy = llm.engine.speculator.policy
    nodes = {"ngram_tree": 12, "draft_tree": 7, "lookahead": 11}.get(method, 4)  # the most one proposal feeds
    assert policy is not None and len(policy.target_cost) == nodes + 1
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert_no_leak(llm)


def draft_spec_llm(target_path, device, draft_cost: float):
    """The target as its own draft of 3 under the goodput policy over fixed costs (every target forward 1, a draft
    depth ``draft_cost``), so what it drafts depends on the acceptance estimate alone; and a list that records, per
    decode step, how many depths it was asked to draft."""
    k = 3
    llm = LLM(str(target_path), num_blocks=256, block_size=4, device=device, dtype="float32",
              speculative_config={"method": "draft", "model": str(target_path), "num_speculative_tokens": k})
    fixed_costs(llm, draft_cost)
    proposer, drafted = llm.engine.speculator.proposer, []
    propose = proposer.propose

    def recording(seqs, depths):
        drafted.append(sum(depths))
        return propose(seqs, depths)

    proposer.propose = recording
    return llm, drafted


def test_a_draft_the_policy_stopped_is_weighed_again(target_path, device, plain):
    """A draft judged not to pay is not run, so nothing new is learnt of it: after ``retry_after`` steps without
    drafting its estimate returns to the prior and the policy tries it again; then its guesses (the target's own)
    are accepted and it goes on drafting."""
    llm, drafted = draft_spec_llm(target_path, device, draft_cost=0.1)  # alpha > 0.1 pays
    proposer = llm.engine.speculator.proposer
    start = proposer.start

    def start_distrusted(seq):
        start(seq)
        seq.spec_state.acceptance = AcceptanceEstimate(successes=0.0, trials=50.0)  # alpha ~ 0.02: does not pay
        seq.spec_state.retry_after = 4

    proposer.start = start_distrusted
    expected = plain.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
    out = llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0]
    assert out.token_ids == expected
    # four steps without drafting, the prefill the first of them; then drafting (but where one token is left)
    assert drafted[:3] == [0] * 3 and all(d > 0 for d in drafted[3:-1])
    assert out.num_draft_tokens == out.num_accepted_tokens > 0
    assert_no_leak(llm)


def test_a_draft_that_never_pays_is_tried_at_doubling_intervals(target_path, device, plain):
    """Every guess rejected (the target's own, each moved to the next token id): the first try at the prior (alpha
    0.6 pays for one guess at draft cost 0.5), and after each failure twice as many steps without drafting."""
    llm, drafted = draft_spec_llm(target_path, device, draft_cost=0.5)
    proposer = llm.engine.speculator.proposer
    propose, vocab = proposer.propose, llm.model.config.vocab_size

    def wrong(seqs, depths):
        proposals = propose(seqs, depths)
        for p in proposals:
            p.token_ids, p.draft_probs = [(t + 1) % vocab for t in p.token_ids], None  # one-hot, never the argmax
        return proposals

    proposer.propose = wrong
    expected = plain.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
    out = llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0]
    assert out.token_ids == expected and out.num_accepted_tokens == 0
    tries = [step for step, depth in enumerate(drafted) if depth > 0]
    assert tries == [0, 3, 8, 17, 34]  # after waits of 2, 4, 8 and 16 steps
    assert_no_leak(llm)


def test_preemption_with_speculation_is_lossless(target_path, device, draft_path, plain):
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS * 2, GREEDY)]
    for config in ({"method": "ngram", "num_speculative_tokens": 3},
                   {"method": "draft", "model": str(draft_path), "num_speculative_tokens": 3}):
        llm = spec_llm(target_path, device, config, num_blocks=24)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS * 2, GREEDY)]
        assert [o.token_ids for o in outs] == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_no_leak(llm)


@pytest.mark.parametrize("config, match", [
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "bogus": 1}, "bogus"),
    ({"method": "draft"}, "model"),
    ({"method": "ngram", "adaptive": "yes"}, "adaptive"),
])
def test_bad_speculative_config(target_path, device, config, match):
    with pytest.raises(ValueError, match=match):
        spec_llm(target_path, device, config)


@pytest.mark.parametrize("draft, kwargs, match", [
    ({"vocab": 300}, {}, "has a vocabulary of 300 tokens but the target has 320"),
    ({"max_pos": 64}, {"max_model_len": 100}, r"max_model_len=100 is longer than the draft model's context \(64"),
    ({"num_heads": 3, "num_kv_heads": 1, "hidden": 48}, {"tensor_parallel_size": 2},
     "draft_tensor_parallel_size=2 does not divide the model's 3 attention heads"),
])
def test_draft_that_cannot_draft_is_refused_before_any_weight_is_read(target_path, device, tmp_path, monkeypatch,
                                                                       draft, kwargs, match):
    """From the draft's config.json alone, before the target's weights (or the draft's) are read."""
    make_tiny_llama(tmp_path, **draft)

    def forbidden(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr(loader, "safe_open", forbidden)
    with pytest.raises(ValueError, match=match):
        spec_llm(target_path, device, {"method": "draft", "model": str(tmp_path)}, **kwargs)


def write_gguf_draft_with_its_own_vocabulary(path, vocab: int = 320) -> None:
    """A GGUF file whose metadata is a small llama's of ``vocab`` tokens, with a byte-level vocabulary ordered otherwise
    than tiny.py's (its bytes in reverse), and no tensor: whatever reads its weights fails."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    from tiny import SPECIALS

    tokens = SPECIALS + sorted(ByteLevel.alphabet(), reverse=True) + ["ab"]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"llama.block_count": 1, "llama.context_length": 256, "llama.embedding_length": 32,
                       "llama.feed_forward_length": 64, "llama.attention.head_count": 2,
                       "llama.attention.head_count_kv": 1, "llama.vocab_size": vocab}.items():
        writer.add_uint32(key, value)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_draft_with_another_tokenizer_is_refused_before_any_weight_is_read(target_path, device, tmp_path,
                                                                          monkeypatch, kind):
    """A draft of the target's vocabulary size whose tokenizer maps text to other ids: refused from its tokenizer,
    before the target's weights or the draft's are read (an HF draft's weights file is truncated besides, a GGUF
    draft holds no tensor)."""
    from tokenizers import Tokenizer, models

    if kind == "hf":
        make_tiny_llama(tmp_path, layers=1, max_pos=256)
        backend = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        vocab = backend.get_vocab()
        order = sorted(vocab, key=vocab.get)
        bytes_ = order[3:]  # the specials first, then the 256 bytes: the bytes in reverse
        backend.model = models.BPE(vocab={**{t: vocab[t] for t in order[:3]},
                                          **{t: 3 + i for i, t in enumerate(reversed(bytes_))}}, merges=[])
        backend.save(str(tmp_path / "tokenizer.json"))
        weights = tmp_path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        draft = tmp_path
    else:
        draft = tmp_path / "draft.gguf"
        write_gguf_draft_with_its_own_vocabulary(draft)

    def forbidden(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loader, "safe_open", forbidden)
    monkeypatch.setattr("nanospec.model.gguf_file.gguf_weight", forbidden)
    with pytest.raises(ValueError, match=r"the draft model .* tokenizes text differently from the target"):
        spec_llm(target_path, device, {"method": "draft", "model": str(draft)})
