"""Prefix caching, on against off, in one process, alternating the two engines:

    python benchmarks/bench_prefix_cache.py                       # all three parts, embedded SmolLM2
    python benchmarks/bench_prefix_cache.py --parts chat decode   # a subset

chat     an 8-turn conversation through the chat template (the questions of prompts.jsonl, greedy, --max-tokens
         answers), each turn streamed by ``LLM.stream_chat`` on an engine with the cache and on one without, in
         turn: time to first token (call -> first output with tokens) per turn, and the prompt tokens the cache
         held, and whether both engines answered alike (the conversation goes on with the cache-off answer; on a
         CPU they do, bit for bit).
shared   the server (``python -m nanospec.serve``, --enable-prefix-caching / --no-enable-prefix-caching): --clients
         chat requests sent at once, each a ~--system-tokens system prompt that all share and a question of its
         own, streamed with the ``openai`` client, greedy, --shared-max-tokens: throughput (generated tokens over
         the wall time) and mean / p50 time to first token measured by the clients, the server's prefix-cache
         counters; --rounds rounds, alternating, a fresh server each (the cache starts empty).
decode   plain decode speed (tok/s between the first and the last token, batch 1, greedy, eos ignored) over the
         benchmark prompts, each prompt on one engine then the other, the median over prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serve import ServerProcess, metric, metric_values  # noqa: E402

from nanospec import LLM, SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--quantization", default="auto", help="the weights: auto (default), int4, int8 or none (float)")
    p.add_argument("--parts", nargs="+", default=["chat", "shared", "decode"], choices=["chat", "shared", "decode"])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96, help="chat: the longest answer (default 96)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--shared-max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="shared: rounds of each setting, alternating (default 2)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def questions() -> list[str]:
    lines = (ROOT / "benchmarks" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def load_note() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


# ---------------------------------------------------------------- chat: time to first token per turn
def first_token_seconds(llm, messages, params) -> tuple[float, str, int, int]:
    """(seconds to the first output with tokens, the answer, its prompt tokens, of those cached)."""
    start = time.perf_counter()
    ttft, text, last = None, "", None
    for out in llm.stream_chat(messages, params):
        if ttft is None and out.token_ids:
            ttft = time.perf_counter() - start
        text += out.delta_text
        last = out
    return ttft, text, len(last.prompt_token_ids), last.num_cached_tokens


def bench_chat(args) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {on: LLM(args.model, enable_prefix_caching=on, max_num_seqs=1, quantization=args.quantization)
               for on in (True, False)}
    history: list[dict] = []
    rows = []
    for turn, question in enumerate(questions()[: args.turns], 1):
        messages = history + [{"role": "user", "content": question}]
        result = {on: first_token_seconds(engines[on], messages, params) for on in (True, False)}
        ttft_on, _, prompt_tokens, cached = result[True]
        ttft_off, answer = result[False][:2]
        same = result[True][1] == answer
        rows.append({"turn": turn, "prompt_tokens": prompt_tokens, "cached_tokens": cached, "ttft_on": ttft_on,
                     "ttft_off": ttft_off, "same_answer": same})
        print(f"turn {turn}: prompt {prompt_tokens} tokens ({cached} cached), TTFT on {ttft_on * 1000:.0f} ms, "
              f"off {ttft_off * 1000:.0f} ms, answers {'alike' if same else 'DIFFER'}", flush=True)
        history = messages + [{"role": "assistant", "content": answer}]
    return rows


# ---------------------------------------------------------------- shared: a long system prompt on the server
def system_prompt(tokenizer, num_tokens: int) -> str:
    """About ``num_tokens`` tokens of instructions: the benchmark prompts' texts, repeated as needed, cut there."""
    text = "You are a careful assistant. Keep these reference notes in mind when you answer.\n\n"
    notes = "\n\n".join(questions())
    while len(tokenizer.encode(text)) < num_tokens:
        text += notes
    return tokenizer.decode(tokenizer.encode(text)[:num_tokens])


async def shared_round(url: str, conversations: list[list[dict]], max_tokens: int) -> tuple[list[float], int, float]:
    """Every conversation streamed at once: (each one's seconds to its first text, tokens generated, wall time)."""
    limits = httpx.Limits(max_connections=len(conversations) + 8, max_keepalive_connections=len(conversations) + 8)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=900,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=900)) as client:
        model = (await client.models.list()).data[0].id

        async def one(messages) -> tuple[float, int]:
            sent, first, tokens = time.perf_counter(), None, 0
            stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                          temperature=0, stream=True,
                                                          extra_body={"return_token_ids": True})
            async for chunk in stream:
                for choice in chunk.choices:
                    if first is None and choice.delta.content:
                        first = time.perf_counter() - sent
                    tokens += len(getattr(choice, "token_ids", None) or [])
            return first, tokens

        start = time.perf_counter()
        results = await asyncio.gather(*[one(c) for c in conversations])
        wall = time.perf_counter() - start
    return [r[0] for r in results], sum(r[1] for r in results), wall


def bench_shared(args) -> list[dict]:
    tokenizer = LLM(args.model, num_blocks=1).tokenizer
    system = system_prompt(tokenizer, args.system_tokens)
    asks = questions()
    conversations = [[{"role": "system", "content": system},
                      {"role": "user", "content": f"Question {i + 1}: {asks[i % len(asks)][:200]}"}]
                     for i in range(args.clients)]
    rows = []
    for round_index in range(args.rounds):
        for on in (True, False):
            flag = "--enable-prefix-caching" if on else "--no-enable-prefix-caching"
            server = ServerProcess(args.model, None, max_num_seqs=args.clients,
                                   extra_args=[flag, "--quantization", args.quantization or "none"])
            try:
                ttfts, tokens, wall = asyncio.run(shared_round(server.url, conversations, args.shared_max_tokens))
                values = metric_values(httpx.get(f"{server.url}/metrics").text)
            finally:
                server.stop()
            row = {"round": round_index + 1, "cache": on, "tok_s": tokens / wall, "wall_s": wall,
                   "ttft_mean": statistics.mean(ttfts), "ttft_p50": statistics.median(ttfts),
                   "queries": metric(values, "vllm:prefix_cache_queries_total"),
                   "hits": metric(values, "vllm:prefix_cache_hits_total")}
            rows.append(row)
            print(f"round {round_index + 1}, cache {'on ' if on else 'off'}: {row['tok_s']:.1f} tok/s, TTFT mean "
                  f"{row['ttft_mean']:.2f} s, p50 {row['ttft_p50']:.2f} s, prefix cache {row['hits']:.0f} / "
                  f"{row['queries']:.0f} tokens ({load_note()})", flush=True)
    return rows


# ---------------------------------------------------------------- decode: the bookkeeping's cost
def decode_tok_s(llm, prompt: str, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times = []
    for out in llm.stream(prompt, params):
        times.extend([time.perf_counter()] * (len(out.token_ids) - len(times)))
    return (len(times) - 1) / (times[-1] - times[0])


def bench_decode(args) -> dict:
    engines = {on: LLM(args.model, enable_prefix_caching=on, quantization=args.quantization) for on in (True, False)}
    speeds = {True: [], False: []}
    for prompt in questions():
        for on in (True, False):
            speeds[on].append(decode_tok_s(engines[on], prompt, args.decode_tokens))
    row = {"on": statistics.median(speeds[True]), "off": statistics.median(speeds[False])}
    print(f"decode: cache on {row['on']:.1f} tok/s, off {row['off']:.1f} tok/s (median of {len(speeds[True])} "
          f"prompts; {load_note()})", flush=True)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quantization == "none":
        args.quantization = None
    print(load_note(), flush=True)
    results = {}
    for part in args.parts:
        results[part] = {"chat": bench_chat, "shared": bench_shared, "decode": bench_decode}[part](args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
