"""The OpenAI-compatible server as users use it: the real server (uvicorn, in a thread, on a free loopback port)
queried with the real ``openai`` client, sync and async, streaming and not; its outputs equal the offline ``LLM``'s
token for token, with and without speculation; errors, limits, auth, disconnects, metrics; and the command line."""

import asyncio
import contextlib
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# the server's own dependencies and its client come with the extras (a GPU machine may lack them): skipped, saying so
_EXTRA = "needs the server and its client: pip install -e '.[test]'"
httpx = pytest.importorskip("httpx", reason=_EXTRA)
openai = pytest.importorskip("openai", reason=_EXTRA)
uvicorn = pytest.importorskip("uvicorn", reason=_EXTRA)
pytest.importorskip("fastapi", reason=_EXTRA)

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.model.mlp_speculator import save_mlp_speculator  # noqa: E402
from nanospec.serve import __main__ as serve_main  # noqa: E402
from nanospec.serve.app import build_app  # noqa: E402
from nanospec.serve.engine_loop import ServedEngine  # noqa: E402
from checkout import checkout_env  # noqa: E402
from tiny import CHATML, add_bos_to_tokenizer, assert_no_leak, make_tiny_llama, most_common_successors, successor_speculator  # noqa: E402

PROMPTS = ["abcabcabcab", "the cat sat on the mat, the cat", "0101010", "hello"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "abcabcabc?"}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
REPEAT = {"frequency_penalty": -1.0, "presence_penalty": 0.2}  # the tiny model repeats itself: n-gram guesses land


@contextlib.contextmanager
def serving(llm, **kwargs):
    """``build_app(llm)`` served by uvicorn in a thread on a free loopback port; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(build_app(llm, model_name="tiny", **kwargs), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_target")
    make_tiny_llama(path, seed=1, tie=True, layers=2, max_pos=256)
    return str(path)


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model_path, num_blocks=256, block_size=4)


@pytest.fixture(scope="module", params=["plain", "ngram"])
def server(request, model_path):
    """(base URL, the server's LLM) for a plain and an n-gram speculative server."""
    llm = LLM(model_path, num_blocks=256, block_size=4, speculative_config=NGRAM if request.param == "ngram" else None)
    with serving(llm) as url:
        yield url, llm


def _client(url, cls=openai.OpenAI, **kwargs):
    return cls(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, **kwargs)


def _wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _idle(llm):
    """Every KV block free and no request queued (read from the test's thread: the loop is idle by then)."""
    stats = llm.kv_cache_stats()
    return stats["free_blocks"] == stats["total_blocks"] and not llm.engine.has_unfinished()


# ---------------------------------------------------------------------------------------------------- outputs
def test_sync_completions_and_chat_equal_offline(server, offline):
    url, llm = server
    client = _client(url)
    for extra in ({}, REPEAT):
        params = SamplingParams(temperature=0, max_tokens=20, **extra)
        expected = [o.outputs[0] for o in offline.generate(PROMPTS, params)]
        got = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=20, temperature=0,
                                        extra_body={"return_token_ids": True, **extra})
        assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
        assert [c.token_ids for c in got.choices] == [o.token_ids for o in expected]
        assert [c.text for c in got.choices] == [o.text for o in expected]
        assert [c.finish_reason for c in got.choices] == [o.finish_reason for o in expected]
        assert got.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
        assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert chat.choices[0].message.content == expected.text and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == len(expected.token_ids)
    begun = MESSAGES + [{"role": "assistant", "content": "abc"}]  # vLLM's continue_final_message
    chat = client.chat.completions.create(model="tiny", messages=begun, max_tokens=8, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    expected = offline.chat(begun, SamplingParams(temperature=0, max_tokens=8), add_generation_prompt=False,
                            continue_final_message=True)[0].outputs[0]
    assert chat.choices[0].message.content == expected.text
    both = httpx.post(f"{url}/v1/chat/completions", json={"messages": begun, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    _wait_until(lambda: _idle(llm))
    assert_no_leak(llm)


def test_async_streams_equal_offline(server, offline):
    """Concurrent streaming completions and chats (one batch on the server) add up to the offline outputs."""
    url, llm = server
    params = SamplingParams(temperature=0, max_tokens=24, **REPEAT)
    expected = [o.outputs[0] for o in offline.generate(PROMPTS, params)]
    expected_chat = offline.chat(MESSAGES, params)[0].outputs[0]

    async def complete(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True, **REPEAT})
        text, ids, reasons, usage = "", [], [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.text
                ids += choice.token_ids
                reasons.append(choice.finish_reason)
        return text, ids, reasons, usage

    async def chat(client):
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                                      stream=True, extra_body=REPEAT)
        roles, text = [], ""
        async for chunk in stream:
            roles += [c.delta.role for c in chunk.choices if c.delta.role]
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return roles, text

    async def main():
        async with _client(url, openai.AsyncOpenAI) as client:
            return await asyncio.gather(*[complete(client, p) for p in PROMPTS], chat(client))

    *completions, (roles, chat_text) = asyncio.run(main())
    for (text, ids, reasons, usage), out in zip(completions, expected):
        assert (text, ids) == (out.text, out.token_ids)
        assert reasons[-1] == out.finish_reason and all(r is None for r in reasons[:-1])
        assert usage.completion_tokens == len(out.token_ids)
    assert roles == ["assistant"] and chat_text == expected_chat.text
    _wait_until(lambda: _idle(llm))
    if llm.engine.speculator.proposer is not None:
        assert llm.stats()["num_accepted_tokens"] > 0  # the server did speculate, and guesses landed


def test_min_p_equals_offline(server, offline):
    url, _ = server
    params = dict(temperature=1.5, max_tokens=8, seed=3, ignore_eos=True)
    expected = offline.generate([PROMPTS[1]], SamplingParams(min_p=0.3, **params))[0].outputs[0].token_ids
    assert expected != offline.generate([PROMPTS[1]], SamplingParams(**params))[0].outputs[0].token_ids
    got = _client(url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=1.5, seed=3,
                                          extra_body={"min_p": 0.3, "ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].token_ids == expected


def test_logit_bias(server):
    got = _client(server[0]).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                                logit_bias={"7": 100}, extra_body={"return_token_ids": True})
    assert got.choices[0].token_ids == [7] * 4
    got = _client(server[0]).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                                extra_body={"allowed_token_ids": [9], "return_token_ids": True})
    assert got.choices[0].token_ids == [9] * 3
    special = dict(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0, logit_bias={"1": 100})
    assert _client(server[0]).completions.create(**special).choices[0].text == ""
    assert _client(server[0]).completions.create(**special, extra_body={"skip_special_tokens": False}
                                                 ).choices[0].text == "<|im_start|>" * 2


def test_echo_with_prompt_logprobs(server, offline):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 1, greedy; the prompt's
    log-probabilities are the offline prompt_logprobs (the first null), then the generated token's."""
    expected = offline.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                             prompt_logprobs=1))[0]
    prompt_ids = expected.prompt_token_ids
    client = _client(server[0])
    got = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=1, temperature=0, logprobs=1,
                                    echo=True).choices[0]
    assert got.text == PROMPTS[1] + expected.outputs[0].text
    lp = got.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    wanted = [e.logprob for e in expected.prompt_logprobs[1:]] + [expected.outputs[0].logprobs[0].logprob]
    assert lp.token_logprobs[1:] == pytest.approx(wanted, abs=1e-4)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed: the prompt comes first, with the first chunk; without logprobs echo is the text alone
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                            echo=True, stream=True))
    plain = offline.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert chunks[0].choices[0].text.startswith(PROMPTS[1])
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[1] + plain
    assert client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True
                                     ).choices[0].logprobs is None


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, offline):
    """OpenAI's (and vLLM's) echo with max_tokens 0: the prompt is the text and, with logprobs, its log-probabilities
    are the offline prompt_logprobs; nothing generated shows, finish_reason "length"; streamed and not. Without echo,
    max_tokens 0 is a 400 naming it."""
    url, llm = server
    expected = offline.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    wanted = [e.logprob for e in expected.prompt_logprobs[1:]]
    body = {"prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 2, "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (PROMPTS[1], [], "length")
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(expected.prompt_token_ids)
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == PROMPTS[1] and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(wanted, abs=1e-4)
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPTS[1] and choices[-1]["finish_reason"] == "length"
    assert [t for c in choices for t in c["logprobs"]["tokens"]] == lp["tokens"]
    assert [t for c in choices for t in c["token_ids"]] == [] and chunks[-1]["usage"]["completion_tokens"] == 0
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "echo" in r.json()["error"]["message"]
    _wait_until(lambda: _idle(llm))


def test_streamed_logprobs_equal_unstreamed(server):
    """Tokens, log-probabilities and text offsets, also where a token's text is held back (half a character)."""
    url, llm = server
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and (logprobs := json.loads(line[6:])["choices"][0]["logprobs"]):
                for key in streamed:
                    streamed[key] += logprobs[key]
    assert "\ufffd" in whole["tokens"]  # a token that holds part of a character
    assert streamed["tokens"] == whole["tokens"] and streamed["text_offset"] == whole["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-5)
    _wait_until(lambda: _idle(llm))


def test_include_stop_str_in_output_streamed_and_not(server, offline):
    url, _ = server
    free = offline.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stop = free[0].outputs[0].text[8:11]  # a string the free run writes mid-text
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    expected = offline.generate([PROMPTS[2]], params)[0].outputs[0].text
    assert expected.endswith(stop) and expected == free[0].outputs[0].text[: free[0].outputs[0].text.index(stop) + 3]
    client = _client(url)
    fields = dict(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert client.completions.create(**fields).choices[0].text == expected
    assert "".join(c.choices[0].text for c in client.completions.create(**fields, stream=True) if c.choices) == expected


def test_n_seed_logprobs_equal_offline(server, offline):
    url, _ = server
    client = _client(url)
    free = offline.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=10, seed=5))[0].outputs[0]
    stop = next(c for c in free.text[1:] if c.isascii() and c.isprintable())  # a character choice 0 writes
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=5, n=3, logprobs=2, stop=[stop])
    (request,) = offline.generate([PROMPTS[0]], params)
    expected = request.outputs  # the prompt's n completions, as the server's choices
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=5, n=3,
                                    logprobs=2, stop=[stop], extra_body={"return_token_ids": True})
    assert [c.token_ids for c in got.choices] == [o.token_ids for o in expected]
    assert [c.text for c in got.choices] == [o.text for o in expected]
    # vLLM's stop_reason beside finish_reason: the stop string where it ended a choice, else None
    assert [(c.finish_reason, c.stop_reason) for c in got.choices] == [(o.finish_reason, o.stop_reason)
                                                                         for o in expected]
    assert ("stop", stop) in [(o.finish_reason, o.stop_reason) for o in expected]
    for choice, out in zip(got.choices, expected):
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-4)
        assert [len(top) <= 2 for top in choice.logprobs.top_logprobs]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "top_p": True}, 400, "top_p"),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": [99999]}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"7": 101}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),  # (int() refuses over 4300 digits)
    ({"prompt": "hi", "tools": []}, 400, "tools"),
    ({"prompt": "hi", "min_tokens": 30, "max_tokens": 10}, 400, "min_tokens"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 300}, 400, "max_tokens"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status and error["message"]
    assert param in error["message"] or status == 404


def test_bad_chat_json_and_size_limits(model_path):
    llm = LLM(model_path, num_blocks=64, block_size=4)
    with serving(llm, max_request_bytes=2000) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 3000}]})
        assert r.status_code == 413 and "2000" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "role" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "top_logprobs": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        with pytest.raises(openai.BadRequestError, match="context"):
            _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 300}])


def test_api_key(model_path, monkeypatch):
    llm = LLM(model_path, num_blocks=64, block_size=4)
    with serving(llm, api_key="s3cret") as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            _client(url).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        assert httpx.get(f"{url}/health").status_code == 200  # open, as vLLM's


def test_full_queue_503_and_disconnect_frees_kv(model_path):
    """One request fits (max_num_seqs 1, no queue): a second gets 503 while the first streams; closing the first
    stream mid-way aborts it and frees every KV block at once; then the server takes requests again."""
    llm = LLM(model_path, num_blocks=128, block_size=4, max_num_seqs=1)
    with serving(llm, max_queue_len=0) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 200, "stream": True,
                                                                 "ignore_eos": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            with pytest.raises(openai.InternalServerError):
                _client(url).completions.create(model="tiny", prompt="hi", max_tokens=2)
        _wait_until(lambda: _idle(llm))
        assert_no_leak(llm)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in metrics
        assert 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.0' in metrics
        assert _client(url).completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_more_completions_than_the_server_holds_name_the_field_that_asked_for_them(model_path):
    """max_num_seqs 1 + max_queue_len 1: a server that never holds more than two completions at once refuses three
    with a 400 naming n where n asked for them, the prompt where a list of prompts did."""
    llm = LLM(model_path, num_blocks=64, block_size=4, max_num_seqs=1)
    with serving(llm, max_queue_len=1) as url:
        for body, param in (({"prompt": "hi", "n": 3}, "n"), ({"prompt": ["a", "b", "c"]}, "prompt"),
                            ({"prompt": [[7], [8], [9]]}, "prompt"), ({"messages": MESSAGES, "n": 3}, "n")):
            path = "chat/completions" if "messages" in body else "completions"
            r = httpx.post(f"{url}/v1/{path}", json={**body, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert r.json()["error"]["message"].startswith(f"{param}: 3 completions"), r.text
        assert httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}).status_code == 200


def test_tokenize_detokenize_health_metrics(server, offline):
    url, llm = server
    body = {"prompt": PROMPTS, "max_tokens": 20, "temperature": 0, **REPEAT}  # (n-gram guesses land: some accepted)
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hello"}).json()
    assert r["tokens"] == offline.tokenizer.encode("hello") and r["count"] == 5 and r["max_model_len"] == 256
    r = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert r["tokens"] == offline.tokenizer.encode(offline._render_chat(MESSAGES))  # what LLM.chat feeds the model
    assert httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 100000]})
    assert bad.status_code == 400 and "100000" in bad.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert name in metrics, name
    if llm.engine.speculator.proposer is not None:
        values = {m[0]: float(m[1]) for m in re.findall(r'^(vllm:spec_decode_\w+)\{model_name="tiny"\} (\S+)$', metrics,
                                                         re.M)}
        assert values["vllm:spec_decode_num_accepted_tokens_total"] == llm.stats()["num_accepted_tokens"] > 0
        assert values["vllm:spec_decode_num_draft_tokens_total"] == llm.stats()["num_draft_tokens"]
        assert values["vllm:spec_decode_num_drafts_total"] > 0
        per_pos = re.findall(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{model_name="tiny",'
                             r'position="(\d+)"\} (\S+)$', metrics, re.M)
        assert sum(float(v) for _, v in per_pos) == llm.stats()["num_accepted_tokens"]


def test_the_engine_has_every_member_the_server_uses(offline):
    """The server reaches the engine only through ServedEngine: the engine an LLM builds has all of it."""
    assert isinstance(offline.engine, ServedEngine)
    assert not isinstance(offline, ServedEngine)  # (the check can fail: the LLM lacks e.g. step)


def test_prefix_cache_counters_follow_the_engine(server):
    """A second request with the same long prompt finds its start cached: /metrics counts it as the engine does."""
    url, llm = server
    prompt = "The same system prompt, long enough for several blocks of four tokens. " + "x" * 20
    for _ in range(2):
        assert httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    values = {m[0]: float(m[1]) for m in re.findall(r'^(vllm:prefix_cache_\w+)\{model_name="tiny"\} (\S+)$', metrics,
                                                     re.M)}
    stats = llm.stats()
    assert values["vllm:prefix_cache_queries_total"] == stats["prefix_cache_queries"] >= 2 * len(prompt)
    assert values["vllm:prefix_cache_hits_total"] == stats["prefix_cache_hits"] >= len(prompt) - 4


def test_mlp_speculator_server_equals_offline(model_path, offline, tmp_path, capsys):
    """An MLP speculator behind the server (one built from the target's own outputs, so its guesses land); and on
    the command line, ``{"method": "mlp_speculator"}`` for a model with no shipped speculator exits 2 saying what
    to pass."""
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = [o.outputs[0] for o in offline.generate(PROMPTS, params)]
    ids = [offline.tokenizer.encode(p) + o.token_ids for p, o in zip(PROMPTS, expected)]
    speculator = save_mlp_speculator(successor_speculator(most_common_successors(ids), offline.config.hidden_size,
                                                          offline.config.vocab_size), tmp_path / "speculator")
    llm = LLM(model_path, num_blocks=256, block_size=4,
              speculative_config={"method": "mlp_speculator", "model": str(speculator), "adaptive": False})
    with serving(llm) as url:
        got = _client(url).completions.create(model="tiny", prompt=PROMPTS, max_tokens=20, temperature=0,
                                              extra_body={"return_token_ids": True})
        assert [c.token_ids for c in got.choices] == [o.token_ids for o in expected]
        _wait_until(lambda: _idle(llm))
    assert llm.stats()["num_accepted_tokens"] > 0
    assert serve_main.main(["--model", model_path, "--speculative-config", '{"method": "mlp_speculator"}']) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "needs 'model'" in err


# ---------------------------------------------------------------------------------------------------- the command line
def _serve(model_path: str, *args: str, env: dict) -> subprocess.Popen:
    """``python -m nanospec.serve`` on a free port with a small KV pool, its stderr piped (text)."""
    return subprocess.Popen([sys.executable, "-m", "nanospec.serve", "--model", model_path, "--port", "0",
                             "--num-blocks", "64", "--block-size", "4", *args],
                            stderr=subprocess.PIPE, text=True, env=env)


def _url_of(proc: subprocess.Popen) -> str | None:
    """The address the server says it is running on (read from its stderr), or None if it ended first."""
    for line in proc.stderr:
        if match := re.search(r"running on (http://[\d.]+:\d+)", line):
            return match.group(1)
    return None


def test_command_line(model_path):
    """``python -m nanospec.serve`` binds 127.0.0.1, takes the key from NANOSPEC_API_KEY, serves, and on SIGTERM
    shuts down cleanly and ends by that signal (uvicorn's convention); a bad model exits 2 with one 'error' line."""
    env = checkout_env(NANOSPEC_API_KEY="k3y")
    proc = _serve(model_path, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', env=env)
    try:
        url = _url_of(proc)
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0)
        model = client.models.list().data[0].id
        assert model == model_path
        out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert "Application shutdown complete" in proc.stderr.read()
    finally:
        proc.kill()
        proc.stderr.close()
    bad = subprocess.run([sys.executable, "-m", "nanospec.serve", "--model", "/no/such/model"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error:")


def test_command_line_tensor_parallel(model_path, offline):
    """``--tensor-parallel-size 2``: the server answers what the one-process engine answers, and on SIGTERM its
    worker ends with it."""
    env = checkout_env()
    proc = _serve(model_path, "--tensor-parallel-size", "2", env=env)
    try:
        url = _url_of(proc)
        assert url is not None
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert workers, "no worker process"
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0,
                                                       "ignore_eos": True}, timeout=60).json()
        want = offline.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert out["choices"][0]["text"] == want.outputs[0].text
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, workers)), "a worker outlived the server"
    finally:
        proc.kill()
        proc.stderr.close()


def _running(pid: str) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one whose parent ended waits for init to reap it)."""
    try:
        return " Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    except FileNotFoundError:
        return False


def test_disconnect_while_waiting_aborts(server):
    """A client that leaves before a non-streaming answer is ready: its request is aborted, its KV freed."""
    url, llm = server
    try:
        httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 250, "ignore_eos": True}, timeout=0.2)
        pytest.skip("the answer came before the client left")
    except httpx.TimeoutException:
        pass
    _wait_until(lambda: 'finished_reason="abort"' in httpx.get(f"{url}/metrics").text)
    _wait_until(lambda: _idle(llm))
    assert_no_leak(llm)


def test_a_client_gone_before_its_body_ends_is_no_server_error(server):
    """A client that closes the connection halfway through sending its body: no 'Exception in ASGI application'
    (a traceback in the server's log), and the server goes on serving."""
    url, _ = server
    errors = []
    handler = logging.Handler()
    handler.emit = errors.append
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(handler)
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hi\"")
            time.sleep(0.3)  # (the server is reading the body)
        time.sleep(0.5)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        uvicorn_log.removeHandler(handler)
    assert not [r for r in errors if r.levelno >= logging.ERROR], [r.getMessage() for r in errors]


# ---------------------------------------------------------------------------------------------------- first contact
def test_every_answer_that_is_not_a_success_is_an_error_object(server):
    url, _ = server
    for response, status in ((httpx.get(f"{url}/v1/nothing-here"), 404), (httpx.get(f"{url}/v1/completions"), 405),
                             (httpx.delete(f"{url}/v1/models"), 405)):
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == status and error["message"] and error["type"]


def test_every_listed_metric_exists_from_the_start_at_zero(model_path):
    llm = LLM(model_path, num_blocks=64, block_size=4, speculative_config=NGRAM)
    with serving(llm) as url:
        metrics = httpx.get(f"{url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert re.search(rf'^{name}\{{model_name="tiny"\}} 0\.0$', metrics, re.M), name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
                 "e2e_request_latency_seconds"):
        assert re.search(rf'^vllm:{name}_count\{{model_name="tiny"\}} 0\.0$', metrics, re.M), name
    for reason in ("stop", "length", "abort", "error"):
        assert f'vllm:request_success_total{{finished_reason="{reason}",model_name="tiny"}} 0.0' in metrics
    for position in range(NGRAM["num_speculative_tokens"]):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{position}"}} 0.0'
                in metrics)


def test_a_prompt_too_long_for_the_context_names_the_prompt(server):
    url, _ = server
    long_text = "ab" * 400  # ~800 tokens, the context is 256
    r = httpx.post(f"{url}/v1/completions", json={"prompt": long_text})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "256" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab" * 100, "max_tokens": 200})  # room, but not for 200
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_each_prompt_of_a_list_gets_its_own_default_max_tokens(server):
    """max_tokens left out: each prompt gets 16, or what the context leaves after that prompt where less (as vLLM
    has it), not what the context leaves after the longest prompt of the list."""
    url, _ = server
    long_prompt = "ab" * 125 + "a"  # 251 tokens: the context (256) leaves 5
    body = {"prompt": ["hi", long_prompt], "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [len(c["token_ids"]) for c in r.json()["choices"]] == [16, 5]


def test_a_kv_pool_smaller_than_the_context_names_the_field_at_fault(model_path):
    """A pool of 64 tokens under a context of 256: a short prompt with more max_tokens than the pool holds is a 400
    naming the max_tokens field it gave (as for the context), a prompt the pool cannot hold one naming the prompt."""
    llm = LLM(model_path, num_blocks=16, block_size=4)
    with serving(llm) as url:
        for path, body, param in (("completions", {"prompt": "hi", "max_tokens": 100}, "max_tokens"),
                                  ("completions", {"prompt": ["hi", "yo"], "max_tokens": 100}, "max_tokens"),
                                  ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": 100},
                                   "max_completion_tokens"),
                                  ("completions", {"prompt": "ab" * 40, "max_tokens": 2}, "prompt"),
                                  ("chat/completions", {"messages": [{"role": "user", "content": "ab" * 40}],
                                                        "max_tokens": 2}, "messages")):
            r = httpx.post(f"{url}/v1/{path}", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert "KV pool" in r.json()["error"]["message"] and param in r.json()["error"]["message"], r.text
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 40}).status_code == 200


@pytest.mark.parametrize("speculative_config", [None, NGRAM])
def test_a_chat_without_max_tokens_runs_to_what_the_kv_pool_holds(model_path, speculative_config):
    """A pool of 64 tokens under a context of 256: a chat that leaves max_tokens out gets what the pool leaves after
    the prompt (and a step's guesses), as it gets what the context leaves where the pool holds the context."""
    llm = LLM(model_path, num_blocks=16, block_size=4, speculative_config=speculative_config)
    guesses = NGRAM["num_speculative_tokens"] if speculative_config else 0
    with serving(llm) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["total_tokens"] == 64 - guesses and r.json()["choices"][0]["finish_reason"] == "length"
        _wait_until(lambda: _idle(llm))


def test_a_chat_over_the_context_names_the_max_tokens_field_it_gave(server):
    """OpenAI's newer max_completion_tokens: a value the context cannot hold is a 400 naming that field."""
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert "max_completion_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_a_prompts_token_ids_read_back_with_their_special_tokens(server, offline):
    """/detokenize gives back what /tokenize read, a chat's markup included, and a completion echoes a token-id
    prompt as that text, matching its log-probabilities' tokens (vLLM decodes both with the special tokens)."""
    url, _ = server
    rendered = offline._render_chat(MESSAGES)
    ids = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"] == rendered
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0}
    choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    assert choice["text"].startswith(rendered) and "".join(choice["logprobs"]["tokens"][:len(ids)]) == rendered
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        first = next(json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))
    assert first["choices"][0]["text"].startswith(rendered)


def test_every_event_is_one_line_to_a_client_that_splits_like_str_splitlines(server):
    """Text may hold U+2028, U+2029 or U+0085, which httpx's iter_lines (and str.splitlines) take for line ends:
    each event's JSON still reads whole."""
    url, _ = server
    prompt = "a\u2028b\u2029c\x85d"
    body = {"prompt": prompt, "max_tokens": 2, "echo": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"].startswith(prompt)


@pytest.fixture(scope="module")
def bos_llm(tmp_path_factory):
    """An LLM whose tokenizer adds BOS to a text (Llama-style) and whose chat template refuses a developer message
    with raise_exception, as Mistral's and Gemma's refuse some conversations."""
    path = tmp_path_factory.mktemp("serve_bos")
    make_tiny_llama(path, seed=1, max_pos=128)
    add_bos_to_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages[0]['role'] == 'developer' %}{{ raise_exception('no developer "
                               "messages here') }}{% endif %}" + CHATML)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return LLM(str(path), num_blocks=128, block_size=4)


def test_raw_text_gets_the_tokenizers_bos_and_a_rendered_chat_does_not(bos_llm):
    """vLLM's encoding: a text prompt with the tokenizer's special tokens, a chat rendered by its template (which
    writes BOS itself) without; offline and served alike, and /tokenize's add_special_tokens as vLLM's."""
    tokenizer, greedy = bos_llm.get_tokenizer(), SamplingParams(temperature=0, max_tokens=2)
    hi = tokenizer.encode("hi")
    rendered = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    assert tokenizer.add_bos_token and rendered[0] == 1 and rendered[1] != 1
    assert bos_llm.generate("hi", greedy)[0].prompt_token_ids == [1, *hi]
    assert next(iter(bos_llm.stream("hi", greedy))).prompt_token_ids == [1, *hi]
    assert bos_llm.generate([hi], greedy)[0].prompt_token_ids == hi  # token ids are fed as given
    with pytest.raises(ValueError, match="^the prompt is empty"):  # one prompt: no "prompt 0: " before it
        bos_llm.stream("", greedy)
    assert bos_llm.chat(MESSAGES, greedy)[0].prompt_token_ids == rendered
    assert next(iter(bos_llm.stream_chat(MESSAGES, greedy))).prompt_token_ids == rendered
    with serving(bos_llm) as url:
        def tokens(**body):
            return httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
        assert tokens(prompt="hi") == [1, *hi] and tokens(prompt="hi", add_special_tokens=False) == hi
        assert tokens(messages=MESSAGES) == rendered
        assert tokens(messages=MESSAGES, add_special_tokens=True) == [1, *rendered]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()
        assert r["usage"]["prompt_tokens"] == 1 + len(hi)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
        assert r["usage"]["prompt_tokens"] == len(rendered)
        # vLLM's add_special_tokens on both endpoints turns that around
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "add_special_tokens": False})
        assert r.json()["usage"]["prompt_tokens"] == len(hi)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                           "add_special_tokens": True})
        assert r.json()["usage"]["prompt_tokens"] == 1 + len(rendered)


def test_a_chat_template_that_refuses_the_conversation_is_a_400(bos_llm):
    messages = [{"role": "developer", "content": "x"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="the chat template refused the conversation: no developer messages here"):
        bos_llm.chat(messages, SamplingParams(max_tokens=2))
    with serving(bos_llm) as url:
        for route in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(f"{url}{route}", json={"messages": messages})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "no developer messages here" in r.json()["error"]["message"]


def test_a_lone_surrogate_is_named(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi \\ud800 there"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "\\ud800" in message and "surrogate" in message and "hex escape" not in message
    r = httpx.post(f"{url}/v1/completions", content='{"prompt": "\\ud83d\\ude00", "max_tokens": 2}'.encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text  # a whole pair is a character


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "hi"}], [{"role": "user"}],
                                      [{"role": "user", "content": None}], "hi", [{"role": "user", "content": "hi",
                                                                                  "tool_calls": []}]])
def test_chat_refuses_what_llm_chat_refuses_with_the_same_message(server, offline, messages):
    url, _ = server
    with pytest.raises(ValueError) as offline_error:
        offline.chat(messages, SamplingParams(max_tokens=2))
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["message"] == str(offline_error.value)
    r = httpx.post(f"{url}/tokenize", json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["message"] == str(offline_error.value)


def test_a_message_field_given_as_null_is_left_out(server, offline):
    """As at the top level, ``null`` inside a message is a field left out: an assistant's turn as the openai client's
    ``ChatCompletionMessage.model_dump()`` gives it (every optional field null) is a message; a field of the wrong
    type, or a tool call, is still a 400 naming it."""
    url, _ = server
    turn = openai.types.chat.ChatCompletionMessage(role="assistant", content="abc").model_dump()
    assert turn["tool_calls"] is None and turn["refusal"] is None  # (what the client sends)
    messages = [*MESSAGES, {**turn, "name": None}, {"role": "user", "content": "again?"}]
    plain = [*MESSAGES, {"role": "assistant", "content": "abc"}, {"role": "user", "content": "again?"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    expected = offline.chat(plain, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert r.json()["choices"][0]["message"]["content"] == expected
    tokens = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == offline.tokenizer.encode(offline._render_chat(plain))
    for bad, named in (({**turn, "content": 5}, "messages[2].content"), ({**turn, "tool_calls": []}, "tool_calls")):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [*MESSAGES, bad], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert named in r.json()["error"]["message"]


def test_stream_options_need_stream(server):
    """As vLLM: stream_options without ``stream: true`` is a 400 naming it, on both endpoints; null is left out."""
    url, _ = server
    for path, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": MESSAGES})):
        body = {**body, "max_tokens": 2}
        for stream in ({}, {"stream": False}):
            r = httpx.post(f"{url}/v1/{path}", json={**body, **stream, "stream_options": {"include_usage": True}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
            assert "stream_options" in r.json()["error"]["message"] and "stream" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/{path}", json={**body, "stream": False, "stream_options": None})
        assert r.status_code == 200, r.text


def test_stream_chunks_share_their_keys_and_continuous_usage_stats(server):
    """Every chat chunk's choice, the role chunk included, carries vLLM's stop_reason; vLLM's
    stream_options.continuous_usage_stats gives every chunk its choice's usage so far, then the last chunk the
    total (without it, other chunks' usage is null)."""
    url, _ = server
    for path, body in (("completions", {"prompt": "hi", "n": 2}), ("chat/completions", {"messages": MESSAGES})):
        for continuous in (False, True):
            options = {"include_usage": True, "continuous_usage_stats": continuous}
            with httpx.stream("POST", f"{url}/v1/{path}", json={**body, "max_tokens": 5, "stream": True,
                                                                  "stream_options": options}) as response:
                assert response.status_code == 200, response.read()
                chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
            *choice_chunks, total = chunks
            assert total["choices"] == [] and total["usage"]["completion_tokens"] > 0
            assert all("stop_reason" in choice for chunk in choice_chunks for choice in chunk["choices"])
            if not continuous:
                assert all(chunk["usage"] is None for chunk in choice_chunks)
                continue
            seen = {}  # per choice: its usage in order
            for chunk in choice_chunks:
                (choice,) = chunk["choices"]
                seen.setdefault(choice["index"], []).append(chunk["usage"])
            for usages in seen.values():
                tokens = [u["completion_tokens"] for u in usages]
                assert tokens == sorted(tokens)
                assert all(u["prompt_tokens"] == total["usage"]["prompt_tokens"]  # (one prompt)
                           and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
            assert sum(usages[-1]["completion_tokens"] for usages in seen.values()) == \
                total["usage"]["completion_tokens"] and len(seen) == body.get("n", 1)
            if path == "chat/completions":
                assert seen[0][0]["completion_tokens"] == 0  # the role chunk


def test_default_sampling_applies_to_what_a_request_leaves_out(model_path, offline):
    """With the model's default temperature 0 (greedy), a request without temperature is greedy; one that gives
    its own temperature and seed samples as offline with those; max_tokens comes from the defaults too."""
    llm = LLM(model_path, num_blocks=64, block_size=4)
    greedy = offline.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    sampled = offline.generate(PROMPTS[:1], SamplingParams(temperature=1.0, seed=7, max_tokens=6))[0].outputs[0]
    with serving(llm, default_sampling={"temperature": 0.0, "max_tokens": 6}) as url:
        client = _client(url)
        got = client.completions.create(model="tiny", prompt=PROMPTS[0], extra_body={"return_token_ids": True})
        assert got.choices[0].token_ids == greedy.token_ids
        got = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=1.0, seed=7,
                                        extra_body={"return_token_ids": True})
        assert got.choices[0].token_ids == sampled.token_ids
        # null, as OpenAI's clients send for "not set", is a field left out (the defaults apply), on both endpoints
        nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                               "max_tokens", "seed", "stop", "logprobs", "user"])
        got = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "echo": None, "return_token_ids": True,
                                                        **nulls})
        assert got.status_code == 200 and got.json()["choices"][0]["token_ids"] == greedy.token_ids, got.text
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": None, **nulls})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 6, chat.text
        missing = httpx.post(f"{url}/v1/completions", json={"prompt": None})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt", missing.text


def test_command_line_checks_every_argument_before_loading(model_path, tmp_path, monkeypatch, capsys):
    """Bad arguments and an address in use: one 'error:' line and exit 2, before any model is read (in this
    process, with loading made to fail the test; one case as the real command)."""
    monkeypatch.setattr(serve_main, "_serve", lambda args, sock: pytest.fail(f"{args} got past the checks"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cases = ((["--port", "99999"], "--port 99999"), (["--port", "-1"], "--port -1"),
                 (["--host", "no-such-host.invalid"], "--host no-such-host.invalid"),
                 (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                 (["--max-queue-len", "-1"], "--max-queue-len"),
                 (["--generation-config", str(tmp_path)], "no generation_config.json"),
                 (["--speculative-config", '{"method": "nope"}'], "method"),
                 (["--dtype", "float8"], "float8"), (["--log-level", "loud"], "--log-level"),
                 (["--model", str(tmp_path / "missing")], "model path does not exist"))
        for args, message in cases:
            assert serve_main.main(["--model", model_path, *args]) == 2, args
            stderr = capsys.readouterr().err
            assert stderr.startswith("error: ") and stderr.count("\n") == 1, (args, stderr)
            assert message in stderr, (args, stderr)
    run = subprocess.run([sys.executable, "-m", "nanospec.serve", "--model", model_path, "--port", "99999"],
                         env=checkout_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: --port 99999") and run.stderr.count("\n") == 1, \
        run.stderr


@pytest.mark.parametrize("key", ["", " ", "k3y ", "k\u00e9y", "k3y\n"])
def test_an_api_key_no_client_can_send_is_refused_at_start(model_path, monkeypatch, capsys, key):
    """An HTTP header cannot carry an empty key, one ending in a space (the server reads the header without it) or
    one that is not printable ASCII: served, every client would get 401. From the flag or the environment, it is
    one 'error:' line (without the key) and exit 2, before any model is read."""
    monkeypatch.setattr(serve_main, "_serve", lambda args, sock: pytest.fail("a key no client can send got through"))
    for argv, env in ((["--api-key", key], None), ([], key)):
        if env is None:
            monkeypatch.delenv("NANOSPEC_API_KEY", raising=False)
        else:
            monkeypatch.setenv("NANOSPEC_API_KEY", env)
        assert serve_main.main(["--model", model_path, "--port", "0", *argv]) == 2, (argv, env)
        stderr = capsys.readouterr().err
        assert stderr.startswith("error: the API key") and stderr.count("\n") == 1, stderr
        assert not key.strip() or key.strip() not in stderr


def test_engine_flags_reach_the_engine_arguments(model_path):
    args = serve_main.parse_args(["--model", model_path, "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
                                  "--max-num-batched-tokens", "64"])
    assert (args.engine.enable_chunked_prefill, args.engine.enable_prefix_caching) == (False, False)
    assert args.engine.max_num_batched_tokens == 64
    assert serve_main.parse_args(["--model", model_path]).engine.enable_chunked_prefill is True


def test_sigterm_ends_open_streams_with_a_final_chunk_and_done(model_path):
    env = checkout_env()
    proc = _serve(model_path, env=env)
    try:
        url = _url_of(proc)
        assert url is not None
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        final = json.loads(rest[-2].removeprefix("data: "))
        assert final["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=30) == -signal.SIGTERM
        log = proc.stderr.read()
        assert "timeout graceful shutdown exceeded" not in log
    finally:
        proc.kill()
        proc.stderr.close()


def test_response_ids_are_unique_within_one_clock_tick(monkeypatch):
    from nanospec.serve.responses import Formatter
    monkeypatch.setattr(time, "time_ns", lambda: 1_000_000)  # two requests in one tick of a coarse clock
    ids = {Formatter(None, "m", chat).id for chat in (True, True, False, False)}
    assert len(ids) == 4 and all(i.startswith(("chatcmpl-", "cmpl-")) for i in ids)
