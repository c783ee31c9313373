"""Stop strings, stop_token_ids and min_tokens: what plain decoding returns, and the same text, token ids and
finish reason with every speculative method (several tokens arrive in one step, the request still ends at the
first token that finishes it).

fp32 on the test device, every method against plain on the same device and backend: exactly equal."""

from dataclasses import replace

import pytest

from nanospec import LLM, SamplingParams
from tiny import assert_no_leak, make_tiny_llama

PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9]
METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 4, "max_candidates": 3},
    "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 3, "adaptive": False},
    "self_draft": {"method": "draft", "num_speculative_tokens": 4, "adaptive": False},  # accepts (nearly) all
}
GREEDY = dict(temperature=0, max_tokens=40, ignore_eos=True)
SAMPLED = dict(temperature=0.7, max_tokens=40, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("stops_target")
    make_tiny_llama(path, seed=1, tie=True, layers=2, max_pos=256)
    return path


@pytest.fixture(scope="module")
def llms(target, device):
    out = {}
    for name, config in METHODS.items():
        if config is not None and config["method"] == "draft":
            config = {**config, "model": str(target), "acceptance": "coupled"}
        out[name] = LLM(str(target), num_blocks=256, block_size=4, speculative_config=config, device=device,
                        dtype="float32")
    return out


@pytest.fixture(scope="module")
def free_runs(llms):
    """Plain outputs without any stop, to choose stops from."""
    return {kind: [o.outputs[0] for o in llms["plain"].generate(PROMPTS, SamplingParams(**kind_params))]
            for kind, kind_params in (("greedy", GREEDY), ("sampled", SAMPLED))}


def _same_everywhere(llms, params_list):
    results = {name: [(o.text, o.token_ids, o.finish_reason, o.stop_reason)
                      for out in llm.generate(PROMPTS, params_list) for o in out.outputs]
               for name, llm in llms.items()}
    for name, result in results.items():
        assert result == results["plain"], name
        assert_no_leak(llms[name])
    return results["plain"]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_stop_strings(llms, free_runs, kind):
    base = GREEDY if kind == "greedy" else SAMPLED
    params_list = []
    for out in free_runs[kind]:
        stop = out.text[10:13]  # a string the free run produces in the middle of its text
        params_list.append(SamplingParams(**base, stop=[stop, "never appears \x00"]))
    stopped = _same_everywhere(llms, params_list)
    for (text, token_ids, reason, stop_reason), out, params in zip(stopped, free_runs[kind], params_list):
        assert reason == "stop" and text == out.text[: out.text.index(params.stop_list[0])]
        assert stop_reason == params.stop_list[0] and out.stop_reason is None  # vLLM's: the string that ended it
        assert len(token_ids) < len(out.token_ids)  # the tokens end with the one that completed the stop string
        assert token_ids == out.token_ids[: len(token_ids)]
    # vLLM's include_stop_str_in_output: the same tokens, the text up to the end of the stop string
    with_stop = [replace(params, include_stop_str_in_output=True) for params in params_list]
    for (text, token_ids, reason, stop_reason), (_, stopped_ids, _, _), out, params in zip(
            _same_everywhere(llms, with_stop), stopped, free_runs[kind], params_list):
        stop = params.stop_list[0]
        assert text == out.text[: out.text.index(stop) + len(stop)] and text.endswith(stop)
        assert (token_ids, reason, stop_reason) == (stopped_ids, "stop", stop)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_stop_token_ids_and_min_tokens(llms, free_runs, kind):
    base = GREEDY if kind == "greedy" else SAMPLED
    stops = [out.token_ids[6] for out in free_runs[kind]]
    # stop at the first occurrence of the token (kept in the output, like eos)
    results = _same_everywhere(llms, [SamplingParams(**base, stop_token_ids=[t]) for t in stops])
    for (_, token_ids, reason, stop_reason), out, t in zip(results, free_runs[kind], stops):
        first = out.token_ids.index(t)
        assert reason == "stop" and token_ids == out.token_ids[: first + 1] and stop_reason == t
    # vLLM's rule: the stop token's text is left out of the text, unless include_stop_str_in_output (stop tokens
    # whose text is a whole character, so that it shows)
    decode = llms["plain"].tokenizer.decode
    whole = [next(t for t in out.token_ids[1:] if decode([t]) and "\ufffd" not in decode([t]))
             for out in free_runs[kind]]
    for include in (False, True):
        results = _same_everywhere(llms, [SamplingParams(**base, stop_token_ids=[t], include_stop_str_in_output=include)
                                          for t in whole])
        for (text, token_ids, reason, _), t in zip(results, whole):
            assert reason == "stop" and token_ids[-1] == t
            assert text == decode(token_ids if include else token_ids[:-1]).rstrip("\ufffd")
    # min_tokens: the stop token cannot be drawn before min_tokens tokens (its probability is zeroed), nor end it
    results = _same_everywhere(llms, [SamplingParams(**base, stop_token_ids=[t], min_tokens=20) for t in stops])
    for (_, token_ids, _, _), t in zip(results, stops):
        assert len(token_ids) >= 20 and t not in token_ids[:19]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_stop_strings_wait_for_min_tokens(llms, free_runs, kind):
    """A stop string counts once it ends past the text of the first min_tokens tokens (vLLM's rule): one that lies
    within that text ends nothing, one that straddles its end does."""
    base = GREEDY if kind == "greedy" else SAMPLED
    decode = llms["plain"].tokenizer.decode
    cases = []  # (prompt, free run, min_tokens, stop string, where the text should end)
    for prompt, out in zip(PROMPTS, free_runs[kind]):
        # min_tokens m where the first m tokens' text, at least 3 long, ends in a whole character (none held back)
        m = next(m for m in range(1, 30) if len(held := decode(out.token_ids[:m])) >= 3
                 and not held.endswith("\ufffd") and out.text.startswith(held))
        n = len(held)
        for stop in (out.text[n - 3:n], out.text[n - 2:n + 1]):  # within that text; straddling its end
            cases.append((prompt, out, m, stop, out.text.find(stop, n - len(stop) + 1)))
    params_list = [SamplingParams(**base, stop=[stop], min_tokens=m) for _, _, m, stop, _ in cases]
    results = {name: [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                      for o in llm.generate([prompt for prompt, *_ in cases], params_list)]
               for name, llm in llms.items()}
    assert all(result == results["plain"] for result in results.values())
    for (text, token_ids, reason, stop_reason), (_, out, m, stop, end) in zip(results["plain"], cases):
        assert len(token_ids) > m
        assert (text, reason, stop_reason) == ((out.text[:end], "stop", stop) if end >= 0 else
                                               (out.text, "length", None))
    assert any(end >= 0 for *_, end in cases[1::2])  # a straddling stop string ended a request
    for llm in llms.values():
        assert_no_leak(llm)


def test_min_tokens_holds_back_eos(target, device):
    """Without ignore_eos, eos cannot come before min_tokens (a model that says eos at once still writes)."""
    llm = LLM(str(target), num_blocks=256, block_size=4, device=device, dtype="float32")
    eos = llm.tokenizer.eos_token_ids
    free = llm.generate(PROMPTS, SamplingParams(**{**GREEDY, "ignore_eos": False}))
    forced = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[o.outputs[0].token_ids[0]], min_tokens=5)
              for o in free]
    for out in (o.outputs[0] for o in llm.generate(PROMPTS, forced)):
        assert len(out.token_ids) >= 5 and not set(out.token_ids[:4]) & set(eos)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
