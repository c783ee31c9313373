"""Engine behaviour on a tiny random model: batching, preemption, stops, errors, no leaked blocks.

Every engine runs in fp32 on the test device (FP32 below); tokens are compared between runs on the same device,
backend and dtype, exactly."""

import json
import re
import shutil

import pytest

from nanospec import LLM, SamplingParams
from nanospec.model import gguf_file, loader
from tiny import assert_no_leak, make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
FP32 = dict(dtype="float32")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_engine")
    make_tiny_llama(path, tie=True, max_pos=128)
    return path


@pytest.fixture(scope="module")
def llm(tiny_path, device):
    return LLM(str(tiny_path), num_blocks=96, block_size=4, device=device, **FP32)


PROMPTS = [[5, 9, 33], list(range(40, 61)), [7] * 9, [100, 101, 102, 103, 104, 105, 3]]


def test_batch_gives_each_prompt_what_it_gets_alone(llm):
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert together == alone
    assert_no_leak(llm)


def test_preemption_under_a_small_pool_gives_the_same_tokens(tiny_path, llm, device):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, GREEDY)]
    # 48 slots: not enough for all at once
    small = LLM(str(tiny_path), num_blocks=12, block_size=4, device=device, **FP32)
    outs = small.generate(PROMPTS * 2, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.stats()["num_preemptions"] > 0
    assert_no_leak(small)


def test_per_prompt_params_and_finish_reasons(llm):
    outs = llm.generate([[5, 6], [5, 6]], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                           SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)])
    outs = [o.outputs[0] for o in outs]
    assert [len(o.token_ids) for o in outs] == [3, 7]
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[1].token_ids[:3] == outs[0].token_ids
    assert outs[0].num_steps == 3  # prefill + 2 decodes


def test_stop_string_truncates_text(llm):
    full = llm.generate([[5, 9, 33]], GREEDY)[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    out = llm.generate([[5, 9, 33]], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert_no_leak(llm)


def test_context_limit_ends_with_length(tiny_path, device):
    small = LLM(str(tiny_path), num_blocks=64, block_size=4, max_model_len=24, device=device, **FP32)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    out = small.generate([list(range(10, 30))], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert_no_leak(small)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=7, ignore_eos=True)
    a = llm.generate([[5, 9, 33]], params)[0].outputs[0].token_ids
    b = llm.generate([[5, 9, 33], [1, 2, 3, 4]],
                     [params, SamplingParams(temperature=1.0, max_tokens=16)])[0].outputs[0].token_ids
    c = llm.generate([[5, 9, 33]], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=8,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    assert a == b
    assert a != c


def test_stream_yields_deltas_that_add_up(llm):
    chunks = list(llm.stream([5, 9, 33], GREEDY))
    assert chunks[-1].finished
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text
    assert chunks[-1].token_ids == llm.generate([[5, 9, 33]], GREEDY)[0].outputs[0].token_ids
    # abandoning a stream aborts its request and frees its blocks
    stream = llm.stream([5, 9, 33], GREEDY)
    next(stream)
    stream.close()
    assert_no_leak(llm)


def test_a_stream_gets_the_outputs_a_generate_call_stepped_for_it(llm):
    expected = llm.generate([[5, 9, 33]], GREEDY)[0].outputs[0]
    stream = llm.stream([5, 9, 33], GREEDY)
    chunks = [next(stream)]
    llm.generate([[7] * 9], GREEDY)  # steps the stream's request too; its outputs must not be lost
    chunks += list(stream)
    assert chunks[-1].finished and chunks[-1].token_ids == expected.token_ids
    assert "".join(c.delta_text for c in chunks) == expected.text
    assert_no_leak(llm)


def test_streamed_text_never_includes_the_start_of_a_stop_string(llm):
    full = llm.generate([[5, 9, 33]], GREEDY)[0].outputs[0].text
    assert len(full) > 8
    for stop in (full[3:6], full[5:9] + "\x00"):  # a stop that occurs, and one whose start occurs but not all
        chunks = list(llm.stream([5, 9, 33], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                            stop=[stop])))
        streamed = ""
        for c in chunks[:-1]:
            streamed += c.delta_text
            assert stop not in streamed and not any(streamed.endswith(stop[:n]) for n in range(1, len(stop)))
        assert streamed + chunks[-1].delta_text == chunks[-1].text
    assert_no_leak(llm)


def test_stream_checks_its_prompt_when_called(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.stream("")
    with pytest.raises(ValueError, match="one prompt"):
        llm.stream(["a", "b"])
    assert_no_leak(llm)


def test_chat_renders_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out) == 1 and len(out[0].outputs) == 1 and len(out[0].outputs[0].token_ids) == 5
    expected = llm.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert out[0].prompt_token_ids == expected


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ([], "empty"),
    ([5, 320], "320"),
    ([5, -1], "-1"),
    ([5, 2.0], "must be ints"),
    (list(range(3, 131)), "128"),
])
def test_bad_prompts_raise_before_any_work(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6], prompt], GREEDY)
    assert_no_leak(llm)
    assert llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids  # still usable


def test_pool_too_small_for_one_request(tiny_path, device):
    small = LLM(str(tiny_path), num_blocks=3, block_size=4, device=device, **FP32)
    with pytest.raises(ValueError, match="KV pool is too small"):
        small.generate([[5, 6, 7]], SamplingParams(max_tokens=20))
    assert small.generate([[5, 6, 7]], SamplingParams(max_tokens=5))[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(temperature=1e39), "temperature"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=True), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=float("inf")), "temperature"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_max_tokens_none_runs_to_the_context_end(tiny_path, device):
    """vLLM's: max_tokens None generates until the context ends."""
    llm = LLM(str(tiny_path), max_model_len=24, device=device, **FP32)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (24 - 3, "length")
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100
    with pytest.raises(ValueError, match=r"min_tokens=22 exceeds the 21 tokens the context \(24\) leaves"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, min_tokens=22))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, min_tokens=21))[0].outputs[0]
    assert len(out.token_ids) == 21
    assert_no_leak(llm)


def test_top_k_zero_keeps_every_token():
    """vLLM's: top_k 0, like -1, turns top-k off."""
    assert SamplingParams(top_k=0).top_k == -1 and SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(device="tpu"), ValueError, "tpu"),
    (dict(kv_cache_memory=0), ValueError, "kv_cache_memory"),
    (dict(speculative_config={"method": "draft", "model": "/no/such/draft"}), FileNotFoundError, "draft"),
    (dict(speculative_config={"method": "ngram"}, num_blocks=2, block_size=2), ValueError, "num_blocks"),
])
def test_bad_engine_arguments(tiny_path, kwargs, error, match, device):
    with pytest.raises(error, match=match):
        LLM(str(tiny_path), **{"device": device, **kwargs})


def never_read(*args, **kwargs):
    raise AssertionError("weights were read before the checks that should have refused the model or arguments")


@pytest.mark.parametrize("model", ["tiny", "embedded"])
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_model_len=100_000), r"max_model_len must be in \(1, \d+\], got 100000"),
    (dict(kv_cache_memory=10), r"kv_cache_memory=10 bytes holds no block \(\d+ bytes each\)"),
    (dict(tensor_parallel_size=5), "tensor_parallel_size=5 does not divide the model's"),
])
def test_engine_arguments_the_model_rules_out_refused_before_its_weights_are_read(tiny_path, monkeypatch, device,
                                                                                  model, kwargs, match):
    monkeypatch.setattr(loader, "safe_open", never_read)
    monkeypatch.setattr(gguf_file, "gguf_weight", never_read)
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_path) if model == "tiny" else None, device=device, **kwargs)


def test_draft_with_unsupported_rope_scaling_refused_before_its_weights_are_read(tiny_path, tmp_path, monkeypatch,
                                                                                device):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_path, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
    safe_open = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda file, **kw: never_read() if str(draft) in file else
                        safe_open(file, **kw))
    with pytest.raises(ValueError, match=re.escape(f"{draft / 'config.json'}: rope_scaling.rope_type must be a RoPE")):
        LLM(str(tiny_path), device=device, speculative_config={"method": "draft", "model": str(draft)})


def test_empty_model_path_refused():
    with pytest.raises(ValueError, match="model is an empty path"):
        LLM("")


def test_params_of_the_wrong_type(llm):
    with pytest.raises(ValueError, match="got dict"):
        llm.generate([[5, 6]], {"max_tokens": 3})


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        LLM(str(tmp_path / "no_such_model"))


def test_a_file_of_a_model_directory_is_refused_naming_the_directory(tiny_path):
    for name in ("config.json", "model.safetensors"):
        with pytest.raises(ValueError, match=re.escape(f"cannot load {tiny_path / name}: expected a .gguf file or a "
                                                       "Hugging Face model directory") + ".*" +
                           re.escape(f"pass its directory {tiny_path}")):
            LLM(str(tiny_path / name))


def test_random_weight_model_of_a_given_shape_generates(device):
    llm = LLM.with_random_weights(dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2), num_blocks=16, block_size=16, device=device, **FP32)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and llm.config.vocab_size == 49152
