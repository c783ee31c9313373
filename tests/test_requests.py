"""A request's life as a user drives it: abort, streams closed or dropped, a request that fails inside a step
without taking the others down, odd but valid inputs, bad inputs refused before any work; and, whatever the mix,
every KV block back in the pool.

Every engine runs in fp32 on the test device; tokens are compared between engines on the same device and backend,
exactly."""

import gc
import json
import shutil
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanospec import LLM, SamplingParams
from nanospec.engine_args import EngineArgs
from tiny import assert_no_leak, make_tiny_llama

PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9, [100, 101, 102, 103, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BAD = 13  # a prompt starting with this token makes the proposer raise (see _inject_failure)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = tmp_path_factory.mktemp("requests_target")
    make_tiny_llama(target, seed=1, tie=True, layers=2, max_pos=256)
    short_draft = tmp_path_factory.mktemp("requests_short_draft")
    make_tiny_llama(short_draft, seed=2, layers=1, num_heads=2, num_kv_heads=1, hidden=32, max_pos=40)
    return target, short_draft


@pytest.fixture(scope="module")
def plain(paths, device):
    return make_llm(paths[0], device, num_blocks=128)


def make_llm(path, device, **kwargs):
    """An engine in fp32 on ``device`` (blocks of 4 tokens)."""
    return LLM(str(path), **{"block_size": 4, "device": device, "dtype": "float32", **kwargs})


@pytest.fixture
def llm(paths, device):
    """n-gram speculation, with a proposer that raises for requests whose prompt starts with BAD."""
    llm = make_llm(paths[0], device, num_blocks=128,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    _inject_failure(llm)
    return llm


def _inject_failure(llm):
    proposer = llm.engine.speculator.proposer
    propose = proposer.propose

    def failing(seqs, ks):
        if any(s.prompt_token_ids[0] == BAD for s in seqs):
            raise RuntimeError("injected failure")
        return propose(seqs, ks)

    proposer.propose = failing


def test_abort_a_streamed_request(llm):
    stream = llm.stream(PROMPTS[0], GREEDY)
    first = next(stream)
    assert not first.finished
    llm.abort(stream.request_id)
    last = next(stream)
    assert last.finished and last.finish_reason == "abort" and last.token_ids[: len(first.token_ids)] == \
        first.token_ids
    with pytest.raises(StopIteration):
        next(stream)
    llm.abort(stream.request_id)  # finished: ignored
    assert_no_leak(llm)


def test_close_and_drop_streams(llm):
    started = llm.stream(PROMPTS[1], GREEDY)
    next(started)
    started.close()
    with pytest.raises(StopIteration):
        next(started)
    unstarted = llm.stream(PROMPTS[2], GREEDY)
    assert llm.engine.scheduler.waiting  # queued when stream() was called
    del unstarted
    gc.collect()
    assert_no_leak(llm)
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].finish_reason == "length"  # the engine still serves


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_stream_dropped_during_a_step_ends_when_the_step_ends(paths, plain, device, method):
    """A dropped stream's finaliser aborts its request wherever the garbage collector runs it, also inside a step
    that is computing that request: the abort waits for the step's end, and the step's other requests go on."""
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    llm = make_llm(paths[0], device, num_blocks=128,
                   speculative_config={**config, "model": str(paths[0])} if method == "draft" else config)
    stream = llm.stream(PROMPTS[0], GREEDY)
    next(stream)
    proposer = llm.engine.speculator.proposer
    propose = proposer.propose

    def dropping_the_stream(seqs, ks):
        nonlocal stream
        if stream is not None:
            assert any(seq.seq_id == stream.request_id for seq in seqs)  # the stream's request is in this step
            stream = None  # its finaliser runs here and aborts the request
        return propose(seqs, ks)

    proposer.propose = dropping_the_stream
    outs = llm.generate(PROMPTS[1:], GREEDY)
    assert stream is None
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(PROMPTS[1:],
                                                                                                     GREEDY)]
    assert_no_leak(llm)


def test_a_stream_dropped_during_a_step_is_aborted_not_left_running(paths, device):
    """The finaliser also forgets the request (``LLM._release``) while its abort waits for the step's end: the
    deferred abort must still find it and end it, not leave it generating to max_tokens unseen."""
    llm = make_llm(paths[0], device, num_blocks=128)
    stream = llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    next(stream)
    execute = llm.engine.runner.execute

    def dropping_the_stream(*args, **kwargs):
        nonlocal stream
        stream = None  # its finaliser runs here, inside the step
        return execute(*args, **kwargs)

    llm.engine.runner.execute = dropping_the_stream
    llm.generate(PROMPTS[1:2], GREEDY)
    assert stream is None
    assert_no_leak(llm)


def test_stream_refuses_several_completions_before_queueing_any(plain):
    with pytest.raises(ValueError, match="n must be 1"):
        plain.stream(PROMPTS[0], [SamplingParams(n=2)])
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        plain.stream(PROMPTS[0], [GREEDY, GREEDY])
    assert_no_leak(plain)
    assert list(plain.stream(PROMPTS[0], [GREEDY]))[-1].token_ids == \
        plain.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids


def test_a_failing_request_fails_alone(llm, plain):
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    stream = llm.stream(PROMPTS[3], GREEDY)  # an open stream beside the failing batch
    next(stream)
    outs = llm.generate([PROMPTS[0], [BAD, 5, 9, 5, 9], PROMPTS[1], PROMPTS[2]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs[:1] + outs[2:]] == [expected[0], expected[1], expected[2]]
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and "injected failure" in failed.error
    rest = list(stream)
    assert rest[-1].finish_reason == "length" and rest[-1].token_ids == expected[3]
    assert_no_leak(llm)


def test_out_of_vocabulary_guesses_fail_their_request_clearly(llm, plain):
    proposer = llm.engine.speculator.proposer
    proposer.chain = lambda index, k=None: [llm.config.vocab_size + 3]
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert all(o.finish_reason == "error" and "outside the vocabulary" in o.error for out in outs for o in out.outputs)
    assert_no_leak(llm)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["generate", "open", "next", "close", "drop", "abort", "fail"]),
                              st.integers(0, 3)), min_size=1, max_size=10))
def test_no_block_is_lost_whatever_the_mix(llm, ops):
    streams = []
    for op, n in ops:
        params = SamplingParams(temperature=0, max_tokens=2 + 3 * n, ignore_eos=True)
        if op == "generate":
            outs = llm.generate(PROMPTS[: n + 1], params)
            assert all(o.finished for o in outs)
        elif op == "open":
            streams.append(llm.stream(PROMPTS[n], params))
        elif op == "next" and streams:
            next(streams[n % len(streams)], None)
        elif op == "close" and streams:
            streams.pop(n % len(streams)).close()
        elif op == "drop" and streams:
            streams.pop(n % len(streams))
            gc.collect()
        elif op == "abort" and streams:
            llm.abort(streams[n % len(streams)].request_id)
        elif op == "fail":
            out = llm.generate([[BAD, 1 + n, 2, 3]], params)[0].outputs[0]
            assert out.finish_reason in ("error", "length")  # a 2-token answer may end before it guesses
    for stream in streams:
        last = None
        for last in stream:
            pass
        assert last is None or last.finished
    streams.clear()
    gc.collect()
    assert_no_leak(llm)


# ---------------------------------------------------------------- vLLM's quickstart, as a vLLM user writes it


def test_vllm_quickstart(plain):
    llm = plain
    tokenizer = llm.get_tokenizer()
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=3)
    outputs = llm.generate(prompts, sampling_params)
    assert len(outputs) == len(prompts)
    for text, output in zip(prompts, outputs):
        prompt = output.prompt
        generated_text = output.outputs[0].text
        assert prompt == text and output.prompt_token_ids == tokenizer.encode(text)
        assert isinstance(generated_text, str) and output.finished and len(output.outputs) == 1
        assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None

    # n completions of a prompt sit under its one RequestOutput, in index order (choice i seeded seed + i)
    two = llm.generate(prompts, SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=3))
    assert len(two) == len(prompts)
    for output in two:
        assert [c.index for c in output.outputs] == [0, 1]
        alone = [llm.generate(output.prompt, SamplingParams(temperature=0.8, max_tokens=8, seed=seed))[0].outputs[0]
                 for seed in (3, 4)]
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in alone]

    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    chat = llm.chat(conversation, sampling_params=sampling_params)
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    assert len(chat) == 1 and chat[0].prompt == rendered and chat[0].prompt_token_ids == tokenizer.encode(rendered)
    assert rendered.endswith("<|im_start|>assistant\n") and isinstance(chat[0].outputs[0].text, str)
    # vLLM's chat arguments: add_generation_prompt=False leaves the assistant's turn unopened; use_tqdm is taken
    bare = llm.chat(conversation, sampling_params, use_tqdm=False, add_generation_prompt=False)[0]
    assert bare.prompt == tokenizer.apply_chat_template(conversation, add_generation_prompt=False) != rendered
    # continue_final_message: the assistant's answer begun for it, left open
    begun = conversation + [{"role": "assistant", "content": "Well"}]
    going_on = llm.chat(begun, sampling_params, add_generation_prompt=False, continue_final_message=True)[0]
    assert going_on.prompt == rendered + "Well"
    with pytest.raises(ValueError, match="set add_generation_prompt=False"):
        llm.chat(begun, sampling_params, continue_final_message=True)

    ids = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0]
    assert ids.prompt is None and ids.prompt_token_ids == PROMPTS[0]
    logprobs = ids.outputs[0].logprobs
    assert len(logprobs) == len(ids.outputs[0].token_ids) > 0
    assert ids.outputs[0].cumulative_logprob == pytest.approx(sum(t.logprob for t in logprobs))
    assert ids.outputs[0].cumulative_logprob <= 0

    # vLLM's prompt dicts: {"prompt": text} is the text, {"prompt_token_ids": ids} the ids
    greedy = SamplingParams(temperature=0, max_tokens=6)
    by_dict = llm.generate([{"prompt": prompts[0]}, {"prompt_token_ids": PROMPTS[0]}], greedy)
    by_value = llm.generate([prompts[0], PROMPTS[0]], greedy)
    assert [o.prompt for o in by_dict] == [prompts[0], None]
    assert [o.outputs[0].token_ids for o in by_dict] == [o.outputs[0].token_ids for o in by_value]
    for bad in ({"text": "hi"}, {"prompt": "hi", "prompt_token_ids": [1]}):
        with pytest.raises(ValueError, match="prompt 0: a prompt dict takes one key"):
            llm.generate(bad, greedy)


def test_the_models_generation_config_is_the_default_sampling(paths, plain, device, tmp_path):
    """As vLLM's LLM: where no SamplingParams is given, generate takes the model's generation_config.json (here
    greedy, 5 new tokens); a model without one, SamplingParams()'s defaults; a bad file is refused before loading."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(paths[0], model)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 5}))
    llm = make_llm(model, device, num_blocks=128)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    out = llm.generate(PROMPTS[:1])[0].outputs[0]
    greedy = SamplingParams(temperature=0, max_tokens=5)
    assert out.token_ids == plain.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids
    assert plain.get_default_sampling_params() == SamplingParams()
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        make_llm(model, device, num_blocks=128)


def test_unknown_engine_arguments_are_named(paths):
    """vLLM's arguments nanospec does not take get a ValueError naming them, before any weights load."""
    with pytest.raises(ValueError, match=r"no argument 'gpu_memory_utilization', 'trust_remote_code'; .*num_blocks"):
        LLM(str(paths[0]), gpu_memory_utilization=0.9, trust_remote_code=True)


# ---------------------------------------------------------------- odd but valid inputs


@pytest.mark.parametrize("pool", [{"num_blocks": 128}, {"max_num_seqs": 1}], ids=["large_pool", "one_context_pool"])
@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "lookahead", "window_size": 2, "ngram_size": 3, "guess_set_size": 2, "adaptive": False},
    {"method": "draft", "num_speculative_tokens": 3, "adaptive": False},
    {"method": "draft", "num_speculative_tokens": 3},  # the policy: its start-up times the draft within 24 positions
    {"method": "draft", "num_speculative_tokens": 3, "tree_top_k": 2, "tree_budget": 5},
    {"method": "draft", "num_speculative_tokens": 3, "tree_top_k": 2, "tree_budget": 5, "adaptive": False},
], ids=["ngram", "lookahead", "draft", "draft_adaptive", "draft_tree", "draft_tree_every_step"])
def test_one_token_prompts_and_the_end_of_the_context(paths, plain, config, pool, device):
    """Speculation runs into the context's end as plain decoding does, also where the pool (its default for one
    sequence) holds one whole context and no more: no guess is fed, nor a slot held, past it."""
    if config["method"] == "draft":
        config = {**config, "model": str(paths[0])}
    llm = make_llm(paths[0], device, max_model_len=24, speculative_config=config, **pool)
    assert pool != {"max_num_seqs": 1} or llm.engine.block_manager.num_blocks == 24 // 4
    short = make_llm(paths[0], device, num_blocks=128, max_model_len=24)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # runs into the context's end
    prompts = [[42], [7, 8], PROMPTS[0]]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in outs] == [o.outputs[0].token_ids for o in short.generate(prompts, params)]
    assert all(o.finish_reason == "length" and len(p) + len(o.token_ids) == 24 for p, o in zip(prompts, outs))
    assert_no_leak(llm)


def test_a_draft_with_a_shorter_context_caps_or_is_refused(paths, device):
    config = {"method": "draft", "model": str(paths[1]), "num_speculative_tokens": 2}
    capped = make_llm(paths[0], device, num_blocks=64, speculative_config=config)
    assert capped.engine.max_model_len == 40
    out = capped.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0]
    assert len(PROMPTS[0]) + len(out.token_ids) == 40 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="draft model's context"):
        make_llm(paths[0], device, num_blocks=64, max_model_len=100, speculative_config=config)


def test_a_tree_draft_with_a_shorter_context_fits_the_pool_its_context_needs(paths, plain, device):
    """Capped to the draft's 40 tokens, a tree draft reserves draft K/V for no more than those 40: a pool of 10
    blocks (what validate_prompt asks for) serves a request to the context's end."""
    config = {"method": "draft", "model": str(paths[1]), "num_speculative_tokens": 3, "tree_top_k": 2,
              "tree_budget": 8, "adaptive": False}
    llm = make_llm(paths[0], device, num_blocks=10, speculative_config=config)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = list(range(10, 40))
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == plain.generate([prompt], params)[0].outputs[0].token_ids
    assert_no_leak(llm)


def test_adaptive_speculation_with_a_small_pool(paths, plain, device):
    llm = make_llm(paths[0], device, num_blocks=6, speculative_config={"method": "ngram"})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.generate([PROMPTS[0][:6]], params)[0].outputs[0].token_ids == \
        plain.generate([PROMPTS[0][:6]], params)[0].outputs[0].token_ids


def test_huge_top_k_and_seeds_of_any_size(plain):
    base = dict(temperature=0.9, max_tokens=10, ignore_eos=True)

    def token_ids(**kwargs):
        return [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], SamplingParams(**base, **kwargs))]

    whole = token_ids(seed=5)
    assert token_ids(seed=5, top_k=2**40) == whole
    assert token_ids(seed=5 + 2**64) == whole  # seeds are taken modulo 2**64
    for seed in (2**63, -(2**80), 2**200):
        assert len(plain.generate(PROMPTS[:1], SamplingParams(**base, seed=seed))[0].outputs[0].token_ids) == 10


def test_min_p_one_keeps_only_the_likeliest_token(plain):
    params = dict(max_tokens=12, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], SamplingParams(temperature=0, **params))]
    hot = SamplingParams(temperature=2.0, seed=9, **params)
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], hot)] != greedy
    min_p_one = SamplingParams(temperature=2.0, seed=9, min_p=1.0, **params)
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], min_p_one)] == greedy


def test_detokenize_false_gives_the_token_ids_and_no_text(plain):
    """vLLM's detokenize=False: the same tokens and stops (stop_token_ids, max_tokens), an empty text and deltas."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    texts = [o.outputs[0] for o in plain.generate(PROMPTS, params)]
    stop_token = texts[0].token_ids[5]
    for stop in ([], [stop_token]):
        raw = replace(params, detokenize=False, stop_token_ids=stop)
        got = [o.outputs[0] for o in plain.generate(PROMPTS, raw)]
        expected = [o.outputs[0] for o in plain.generate(PROMPTS, replace(params, stop_token_ids=stop))]
        assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
        assert [o.text for o in got] == [""] * len(PROMPTS) and all(o.text for o in expected)
    assert all(out.delta_text == "" for out in plain.stream(PROMPTS[0], replace(params, detokenize=False)))
    with pytest.raises(ValueError, match="detokenize"):  # a stop string is looked for in the text
        SamplingParams(stop="x", detokenize=False)


def test_stop_reason_is_none_for_the_tokenizers_eos_only(paths, plain, device, tmp_path):
    """vLLM's stop_reason: None for the tokenizer's eos; an eos id only generation_config.json names is reported
    as the stop token it is there (vLLM adds it to stop_token_ids)."""
    greedy = SamplingParams(temperature=0, max_tokens=12)
    free = plain.generate(PROMPTS[:1], greedy)[0].outputs[0]
    extra_eos = free.token_ids[4]
    assert free.finish_reason == "length" and plain.get_tokenizer().eos_token_ids == [2] and extra_eos != 2
    shutil.copytree(paths[0], tmp_path / "model")
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, extra_eos]}))
    llm = make_llm(tmp_path / "model", device, num_blocks=64)
    out = llm.generate(PROMPTS[:1], greedy)[0].outputs[0]
    assert (out.token_ids[-1], out.finish_reason, out.stop_reason) == (extra_eos, "stop", extra_eos)
    eos = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, allowed_token_ids=[2]))[0].outputs[0]
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == ([2], "stop", None)
    asked = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, allowed_token_ids=[2], ignore_eos=True,
                                                     stop_token_ids=[2]))[0].outputs[0]
    assert (asked.token_ids, asked.finish_reason, asked.stop_reason) == ([2], "stop", 2)  # a stop token asked for


# ---------------------------------------------------------------- bad inputs, refused before any work


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=True), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=False), "top_p"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens="8"), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(seed=True), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=3), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(speculate="yes"), "speculate"),
    (dict(detokenize=0), "detokenize"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=True), "block_size"),
    (dict(block_size="16"), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=2**40), "GiB"),
    (dict(max_num_seqs=1.0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=True), "max_model_len"),
    (dict(seed="0"), "seed"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": True}), "num_speculative_tokens"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 10**6}), "num_speculative_tokens"),
    (dict(speculative_config={"method": "ngram", "adaptive": 1}), "adaptive"),
    (dict(speculative_config={"method": "lookahead", "window_size": "5"}), "window_size"),
    (dict(speculative_config={"method": "draft", "model": 5}), "model"),
    (dict(speculative_config={"method": "draft", "model": ".", "acceptance": "maybe"}), "acceptance"),
    (dict(speculative_config={"method": "draft", "model": ".", "dtype": 16}), "dtype"),
    (dict(speculative_config=["ngram"]), "speculative_config"),
])
def test_bad_llm_arguments(paths, kwargs, match, device):
    with pytest.raises(ValueError, match=match):
        make_llm(paths[0], device, **{"num_blocks": 64, **kwargs})


def test_bad_stop_token_ids_for_this_vocabulary(plain):
    with pytest.raises(ValueError, match="stop_token_ids"):
        plain.generate([PROMPTS[0]], SamplingParams(stop_token_ids=[plain.config.vocab_size]))


def test_the_step_budget_defaults_to_the_device():
    """``max_num_batched_tokens=None``: 512 on a CPU (a chunk of that many prompt tokens is seconds of work there),
    4096 on a GPU; a value given is kept."""
    assert EngineArgs(device="cpu").max_num_batched_tokens == 512
    assert EngineArgs(device="cpu", max_num_batched_tokens=64).max_num_batched_tokens == 64
    if torch.cuda.is_available():
        assert EngineArgs(device="cuda").max_num_batched_tokens == 4096
