"""Chunked prefill through the engine, on tiny random models: a prompt longer than the step's token budget is
computed a chunk a step beside the decoding sequences, and every output is the one it gets run whole, for every
method, alone and batched, greedy and seeded, with the prefix cache and preemption; no block is lost.

On a CPU every row attends alone over the keys it sees and the matmuls are row-wise, so a chunk's K/V is the same
whichever step computes it: outputs are compared exactly.
"""

import pytest

from nanospec import LLM, SamplingParams
from test_prefix_cache import BASE, METHODS, draft, speculator, spec_config, target  # noqa: F401 (fixtures)
from tiny import assert_no_leak

PROMPTS = [BASE + [5, 6], list(range(100, 141)), BASE[:16], [9, 9, 9, 9, 9, 9, 9, 9, 5], [7]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, seed=7, ignore_eos=True)


def make_llm(target, device, **kwargs):
    return LLM(target, **{"num_blocks": 128, "block_size": 4, "device": device, "dtype": "float32",
                          "max_num_batched_tokens": 7, **kwargs})


@pytest.mark.parametrize("name", list(METHODS))
def test_chunked_outputs_equal_whole_prefill(name, target, draft, speculator, device):
    """A budget of 7 tokens a step: prompts of 9-41 tokens run in chunks (not on block boundaries), alone and all
    together; the same engine with chunking off gives the reference."""
    config = spec_config(name, draft, speculator)
    chunked = make_llm(target, device, speculative_config=config)
    whole = make_llm(target, device, speculative_config=config, enable_chunked_prefill=False)
    for params in [GREEDY, SEEDED]:
        expected = [whole.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
        chunked.reset_prefix_cache()
        assert [chunked.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS] == expected
        assert [o.outputs[0].token_ids for o in chunked.generate(PROMPTS, params)] == expected
    assert chunked.stats()["num_steps"] > whole.stats()["num_steps"]
    assert_no_leak(chunked)
    assert_no_leak(whole)


def test_a_long_prompt_runs_in_chunks_beside_a_decoding_request(target, device):
    """A decodes; B (41 tokens) arrives: every step still gives A a token, B's K/V grows by what the budget leaves
    (7 - 1), and B's first token comes in the step that computes its last prompt token."""
    llm = make_llm(target, device)
    engine = llm.engine
    a = engine.add_request([5, 6, 7], GREEDY)
    engine.step()
    b = engine.add_request(PROMPTS[1], GREEDY)
    seq_a, seq_b = engine.sequences[a], engine.sequences[b]
    computed = []
    while not seq_b.output_token_ids:
        before = seq_a.num_output_tokens
        outputs = engine.step()
        assert seq_a.num_output_tokens == before + 1, "the decoding request gets its token every step"
        computed.append(seq_b.num_cached_tokens)
        assert [o.request_id for o in outputs] == [a] + ([b] if seq_b.output_token_ids else [])
    assert computed == [6, 12, 18, 24, 30, 36, 41]
    while engine.has_unfinished():
        engine.step()
    alone = make_llm(target, device, enable_chunked_prefill=False)
    assert seq_b.output_token_ids == alone.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
    assert_no_leak(llm)


def test_without_chunking_a_long_prompt_waits_then_runs_whole(target, device):
    llm = make_llm(target, device, enable_chunked_prefill=False)
    engine = llm.engine
    a = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    b = engine.add_request(PROMPTS[1], GREEDY)
    while engine.sequences[a].finish_reason is None:
        engine.step()
        assert engine.sequences[b].num_cached_tokens == 0, "B waits for the budget A's decoding leaves"
    engine.step()
    assert engine.sequences[b].num_output_tokens == 1, "then runs whole, alone"
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(llm)


def test_prompt_logprobs_run_whole(target, device):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    chunked = make_llm(target, device).generate(PROMPTS[:2], params)
    whole = make_llm(target, device, enable_chunked_prefill=False).generate(PROMPTS[:2], params)
    for c, w in zip(chunked, whole):
        assert c.outputs[0].token_ids == w.outputs[0].token_ids
        assert [e and e.logprob for e in c.prompt_logprobs] == [e and e.logprob for e in w.prompt_logprobs]


def test_chunks_under_a_small_pool_are_preempted_and_recomputed(target, device):
    whole = make_llm(target, device, enable_chunked_prefill=False, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in whole.generate(PROMPTS * 2, GREEDY)]
    small = make_llm(target, device, num_blocks=20)
    assert [o.outputs[0].token_ids for o in small.generate(PROMPTS * 2, GREEDY)] == expected
    assert small.stats()["num_preemptions"] > 0
    assert_no_leak(small)


def test_enable_chunked_prefill_must_be_a_bool(target):
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True or False, got 'yes'"):
        LLM(target, enable_chunked_prefill="yes")
