"""Penalties, log-probabilities and n: speculation stays lossless with penalties on (each verified node is penalized
with the output up to itself), log-probabilities are the target's under speculation too, and n gives n seeded
completions."""

from dataclasses import replace

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.sequence import Sequence
from nanospec.sampling import logprobs
from nanospec.sampling.penalties import apply_penalties, ban_bad_words, bad_words_token_ids
from nanospec.speculative.proposal import Proposal
from tiny import assert_no_leak, make_tiny_llama

PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [11, 12]]
# negative frequency / presence penalties and a repetition penalty < 1 make the tiny random model repeat itself, so
# n-gram guesses are accepted and every accepted path changes the counts the next nodes see
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=0.8, frequency_penalty=-0.6,
                        presence_penalty=0.3, logprobs=2)
GREEDY_STRONG = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.2,
                               frequency_penalty=-1.5, presence_penalty=0.5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=3, repetition_penalty=0.8,
                        frequency_penalty=-0.6, presence_penalty=0.3, logprobs=2)
# a bias up and a ban (-100), with penalties on: the bias comes first, so the penalties see the biased logits
BIASED = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=4, repetition_penalty=1.3,
                        logit_bias={7: 10.0, 9: 2.5, 40: -100})
# vLLM's allowed_token_ids: the prompts' own tokens among them, so n-gram guesses still land
ALLOWED = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=8, repetition_penalty=1.2,
                         allowed_token_ids=[5, 9, 33, 40, 41, 42, 11, 12, 7])
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 4, "max_candidates": 3, "prompt_lookup_max": 2,
                   "adaptive": False},
    "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 3, "adaptive": False},
    # the target drafts for itself, without the penalties, so its guesses are often right and sometimes not (a
    # greedy draft guesses the argmax in either acceptance mode; coupled, its seeded guesses are one-hot too)
    "self_draft": {"method": "draft", "num_speculative_tokens": 3, "adaptive": False, "acceptance": "coupled"},
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("penalty_target")
    make_tiny_llama(path, seed=1, tie=True, layers=2, max_pos=256)
    return str(path)


@pytest.fixture(scope="module")
def plain(target):
    llm = LLM(target, num_blocks=256, block_size=4, dtype="float32")
    return {name: [o.outputs[0] for o in llm.generate(PROMPTS, params)] for name, params in
            (("greedy", GREEDY), ("strong", GREEDY_STRONG), ("seeded", SEEDED), ("biased", BIASED),
             ("allowed", ALLOWED))}


def _penalized_by_hand(logits, prompt, output, params):
    x = logits.clone()
    for v in set(prompt) | set(output):
        x[v] = x[v] / params.repetition_penalty if x[v] > 0 else x[v] * params.repetition_penalty
    for v in set(output):
        x[v] -= params.frequency_penalty * output.count(v) + params.presence_penalty
    return x


def test_each_tree_node_is_penalized_with_its_own_path():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=-0.4)
    prompt, output = [1, 2, 3], [4, 4, 5]
    seq = Sequence(0, prompt, params, 0, None, [])
    seq.token_ids += output
    # root -> 6 -> 4 -> 6, and root -> 7
    proposal = Proposal([6, 4, 6, 7], [-1, 0, 1, -1])
    node_paths = [[], [6], [6, 4], [6, 4, 6], [7]]
    logits = torch.randn(1 + 5, 12)
    rows = [1, 2, 3, 4, 5]  # row 0 belongs to another sequence, without penalties
    expected = logits.clone()
    for row, path in zip(rows, node_paths):
        expected[row] = _penalized_by_hand(logits[row], prompt, output + path, params)
    apply_penalties(logits, [Sequence(1, [9], SamplingParams(), 0, None, []), seq], [[0], rows],
                    [[[]], [[]] + proposal.paths()])
    torch.testing.assert_close(logits, expected)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_speculation_with_penalties_equals_plain(target, plain, method):
    """Greedy and seeded (every method here guesses one-hot): the same tokens as plain decoding, and the same
    log-probabilities, though they come from verify rows."""
    config = dict(METHODS[method])
    if config["method"] == "draft":
        config["model"] = target
    llm = LLM(target, num_blocks=256, block_size=4, dtype="float32", speculative_config=config)
    for name, params in (("greedy", GREEDY), ("strong", GREEDY_STRONG), ("seeded", SEEDED), ("biased", BIASED),
                         ("allowed", ALLOWED)):
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain[name]], (method, name)
        if params.logprobs is not None:  # the target's log-probs of the same tokens, from verify rows
            for out, ref in zip(outs, plain[name]):
                assert [lp.token_id for lp in out.logprobs] == out.token_ids
                for a, b in zip(out.logprobs, ref.logprobs):
                    assert abs(a.logprob - b.logprob) < 1e-4
                    assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"]
    assert_no_leak(llm)


def test_logit_bias(target, plain):
    llm = LLM(target, num_blocks=128, block_size=4, dtype="float32")
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPTS, SamplingParams(**greedy, logit_bias={7: 100}))
    assert [o.outputs[0].token_ids for o in out] == [[7] * 8] * len(PROMPTS)
    plain_greedy = llm.generate(PROMPTS[:1], SamplingParams(**greedy))[0].outputs[0].token_ids
    banned = llm.generate(PROMPTS[:1], SamplingParams(**greedy, logit_bias={plain_greedy[0]: -100}))
    assert banned[0].outputs[0].token_ids[0] != plain_greedy[0]
    # sampled: the bias shows in the draws (7 becomes common), and the ban holds
    biased = [t for o in plain["biased"] for t in o.token_ids]
    unbiased = [t for o in llm.generate(PROMPTS, replace(BIASED, logit_bias=None))
                for t in o.outputs[0].token_ids]
    assert biased.count(7) > unbiased.count(7) + 4 and 40 not in biased
    with pytest.raises(ValueError, match="logit_bias: token id 99999 is out of the vocabulary"):
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={99999: 1.0}))
    assert_no_leak(llm)


def test_allowed_token_ids(target, plain):
    allowed = [t for o in plain["allowed"] for t in o.token_ids]
    assert set(allowed) <= set(ALLOWED.allowed_token_ids) and len(set(allowed)) > 3
    llm = LLM(target, num_blocks=64, block_size=4, dtype="float32")
    free = [t for o in llm.generate(PROMPTS, replace(ALLOWED, allowed_token_ids=None)) for t in o.outputs[0].token_ids]
    assert not set(free) <= set(ALLOWED.allowed_token_ids)
    only = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                    allowed_token_ids=[100]))[0].outputs[0].token_ids
    assert only == [100] * 5
    with pytest.raises(ValueError, match="allowed_token_ids: token id 99999 is out of the vocabulary"):
        llm.generate(PROMPTS[:1], SamplingParams(allowed_token_ids=[99999]))
    with pytest.raises(ValueError, match="allowed_token_ids: \\[2\\] are all stop tokens, which min_tokens=3"):
        llm.generate(PROMPTS[:1], SamplingParams(allowed_token_ids=[2], min_tokens=3))  # (2: the tiny eos)
    assert_no_leak(llm)


def test_params_that_leave_no_token_to_draw_are_refused(target, monkeypatch):
    """Where bad_words ban every allowed token (or every token), alone or with the stop tokens min_tokens holds off,
    nothing could be drawn: a ValueError when the request is added, not a token drawn from all -inf logits."""
    llm = LLM(target, num_blocks=64, block_size=4, dtype="float32")
    tokenizer = llm.engine.tokenizer
    a, b = tokenizer.encode("a"), tokenizer.encode("b")  # one token each
    assert len(a) == len(b) == 1
    for params, match in [
        (dict(allowed_token_ids=a, bad_words=["a"]), r"allowed_token_ids: \[\d+\] are all banned by bad_words \['a'\]"),
        (dict(allowed_token_ids=a + b, bad_words=["a", "b"], temperature=0), "are all banned by bad_words"),
        (dict(allowed_token_ids=a + [2], bad_words=["a"], min_tokens=2),
         "are all banned by bad_words .* or stop tokens that min_tokens=2 holds off"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, **params))
    # every token of a vocabulary banned (the tiny one's words cannot name all 320 ids: here its 3 special tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [tokenizer.encode(w) for w in specials] == [[0], [1], [2]]
    monkeypatch.setattr(llm.engine, "vocab_size", 3)
    with pytest.raises(ValueError, match=r"bad_words ban every token of the vocabulary \(3\)"):
        llm.engine.validate_prompt([1, 2], SamplingParams(max_tokens=4, bad_words=specials))
    monkeypatch.undo()
    # one allowed token left (or a stop token, without min_tokens): generated as before
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                   allowed_token_ids=a + b, bad_words=["a"]))
    assert out[0].outputs[0].token_ids == b * 3
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, allowed_token_ids=a + [2], bad_words=["a"]))
    assert_no_leak(llm)


def test_each_tree_node_bans_the_bad_words_its_own_path_would_complete():
    """A bad word's last token is banned in a row whose output and path end with the rest of the word (a word that
    ends on the path itself counts), and nowhere else; a one-token word is banned in every row."""
    seq = Sequence(0, [1, 2], SamplingParams(), 0, None, [])
    seq.token_ids += [3, 4]  # output 3 4
    seq.bad_words_token_ids = [[4, 5, 6], [7, 8], [9], [2, 10]]  # (2 ends the prompt: the prompt does not count)
    node_paths = [[], [5], [5, 7], [7], [8]]  # root, then root -> 5 -> 7, root -> 7, root -> 8
    logits = torch.zeros(5, 12)
    ban_bad_words(logits, [seq], [[0, 1, 2, 3, 4]], [node_paths])
    banned = {(r, c) for r, c in (logits == float("-inf")).nonzero().tolist()}
    every_row = {(r, 9) for r in range(5)}
    assert banned == every_row | {(1, 6), (2, 8), (3, 8)}  # 4 5 -> 6 after [5]; 7 -> 8 after [5, 7] and [7]


def test_bad_words(target):
    """vLLM's ``bad_words``: plain greedy never completes a banned word (a two-token word found in its free output,
    and a one-token word), and every speculation method gives plain's tokens with the same words banned."""
    llm = LLM(target, num_blocks=128, block_size=4, dtype="float32")
    tokenizer, greedy = llm.engine.tokenizer, dict(temperature=0, max_tokens=16, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**greedy))]

    def round_trips(tokens):  # printable ASCII whose text is tokenized back to the same tokens
        text = tokenizer.decode(tokens)
        return text.isascii() and text.isprintable() and text.strip() == text and tokenizer.encode(text) == tokens
    pair = next(out[i:i + 2] for out in free for i in range(len(out) - 1) if round_trips(out[i:i + 2]))
    single = next(t for out in free for t in out if round_trips([t]) and t not in pair)
    words = [tokenizer.decode(pair), tokenizer.decode([single])]
    assert bad_words_token_ids(words, tokenizer, llm.engine.vocab_size)[0] == pair
    params = [SamplingParams(**greedy, bad_words=words),
              SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=5, bad_words=words)]
    banned = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)] for p in params]
    assert banned[0] != free
    for out in banned[0] + banned[1]:
        assert single not in out and all(out[i:i + 2] != pair for i in range(len(out) - 1))
    for method in ("ngram", "self_draft"):
        config = dict(METHODS[method], model=target) if method == "self_draft" else METHODS[method]
        spec = LLM(target, num_blocks=128, block_size=4, dtype="float32", speculative_config=config)
        assert [[o.outputs[0].token_ids for o in spec.generate(PROMPTS, p)] for p in params] == banned, method
        assert_no_leak(spec)
    for bad in ("a word", [""], ["  "], [3]):
        with pytest.raises(ValueError, match="bad_words must be None or a list of words"):
            SamplingParams(bad_words=bad)
    assert_no_leak(llm)


def test_skip_special_tokens(target):
    """vLLM's default leaves special tokens out of the text; ``skip_special_tokens=False`` keeps them (the tiny
    tokenizer's ``<|im_start|>`` is token 1), streamed and not; the tokens are the same either way."""
    llm = LLM(target, num_blocks=64, block_size=4, dtype="float32")
    params = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={1: 100})
    skipped = llm.generate(PROMPTS[:1], SamplingParams(**params))[0].outputs[0]
    kept = llm.generate(PROMPTS[:1], SamplingParams(**params, skip_special_tokens=False))[0].outputs[0]
    assert skipped.token_ids == kept.token_ids == [1, 1, 1]
    assert skipped.text == "" and kept.text == "<|im_start|>" * 3
    stream = llm.stream(PROMPTS[0], SamplingParams(**params, skip_special_tokens=False))
    streamed = "".join(o.delta_text for o in stream)
    assert streamed == kept.text
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens=0)


def test_penalties_and_logprobs_match_transformers(target):
    """Greedy with a repetition penalty is transformers' greedy with ``repetition_penalty`` (prompt and output
    count), and the reported log-probabilities are ``log_softmax`` of transformers' raw logits."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target).eval()
    llm = LLM(target, num_blocks=64, block_size=4, dtype="float32")
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.7, logprobs=3)
    out = llm.generate([prompt], params)[0].outputs[0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.7,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1: -1]
    assert out.token_ids == ref
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - logprobs[i, lp.token_id].item()) < 1e-4
        top = logprobs[i].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("method", [None, "ngram", "self_draft"])
def test_prompt_logprobs_match_transformers(target, method, monkeypatch):
    """prompt_logprobs: transformers' log_softmax at every prompt position, from the prefill itself, with any method
    and batched with requests that do not ask; a prompt the prefix cache holds is computed again for it."""
    from transformers import LlamaForCausalLM

    config = dict(METHODS[method], model=target) if method == "self_draft" else METHODS.get(method)
    llm = LLM(target, num_blocks=128, block_size=4, dtype="float32", speculative_config=config)
    prompt = PROMPTS[1][:19]
    with torch.no_grad():
        expected = torch.log_softmax(LlamaForCausalLM.from_pretrained(target).eval()(
            torch.tensor([prompt])).logits[0].float(), dim=-1)
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([prompt], SamplingParams(**greedy))[0]  # (its full blocks now in the prefix cache)
    asked = SamplingParams(**greedy, prompt_logprobs=3)
    outs = llm.generate([PROMPTS[0], prompt, PROMPTS[2]], [SamplingParams(**greedy), asked, SamplingParams(**greedy)])
    out = outs[1]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids and out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry.token_id == prompt[i + 1]
        assert abs(entry.logprob - expected[i, prompt[i + 1]].item()) < 1e-4
        top = expected[i].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    assert [o.outputs[0].token_ids for o in outs[::2]] == \
        [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(**greedy))]
    assert llm.generate([prompt], SamplingParams(**greedy))[0].num_cached_tokens > 0  # the cache still serves others
    monkeypatch.setattr(logprobs, "PROMPT_ROWS_AT_ONCE", 5)  # 18 rows in 4 pieces: the same numbers
    assert llm.generate([prompt], asked)[0].prompt_logprobs == out.prompt_logprobs
    assert_no_leak(llm)


def test_n_completions_are_seeded_choices(target):
    llm = LLM(target, num_blocks=128, block_size=4, dtype="float32")
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=3, ignore_eos=True)
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], params)
    assert len(outs) == 2 and [[o.index for o in out.outputs] for out in outs] == [[0, 1, 2], [0, 1, 2]]
    for out, prompt in zip(outs, [PROMPTS[0], PROMPTS[2]]):
        assert out.prompt_token_ids == prompt
        for i in range(3):
            alone = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, seed=7 + i,
                                                          ignore_eos=True))[0].outputs[0]
            assert out.outputs[i].token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1
    with pytest.raises(ValueError, match="n must be 1"):
        llm.stream(PROMPTS[0], params)
    assert_no_leak(llm)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("n", 10_000), ("logprobs", -1), ("logprobs", 21), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", 1.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", "1"), ("repetition_penalty", 0),
    ("repetition_penalty", float("inf")), ("presence_penalty", float("nan")), ("logit_bias", {"7": 1.0}),
    ("logit_bias", {7: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", [7]), ("logit_bias", {7: True}),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", 7), ("allowed_token_ids", [True])])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
