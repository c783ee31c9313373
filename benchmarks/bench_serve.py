"""Load test of the OpenAI-compatible server: many concurrent streaming clients, some of them leaving mid-stream.

    python benchmarks/bench_serve.py                                   # embedded SmolLM2, plain vs n-gram
    python benchmarks/bench_serve.py --clients 16 --max-tokens 16 --rounds 1     # a quick look

Per round and method it starts ``python -m nanospec.serve`` on a free loopback port (127.0.0.1 only), sends
--clients chat requests at once (the 16 prompts of prompts.jsonl, cycled), each a stream read with the
``openai`` client, greedy, --max-tokens at most. Every --disconnect-every-th client closes its stream after a
quarter of the tokens. Then it checks:

    complete     every stream that was read to its end equals the offline ``LLM.chat`` output of its prompt
                 (the same model in this process, one request at a time), token for token, and its finish reason
    prefix       every stream that left early had received a prefix of that output
    up           /health answers 200 after the load
    KV free      /metrics soon shows no request running or waiting and vllm:kv_cache_usage_perc 0: every KV
                 block is back in the pool (the aborted requests included)

and reports, measured by the clients: throughput (generated tokens, as the server counts them, over the wall
time from the first request to the last response), time to first token (request sent -> first chunk with text)
and inter-token latency (the gap between two chunks with text; under speculation one chunk can bring several
tokens, as vLLM's figure does) at p50 / p99, plus the server's acceptance rate and tau from its metrics. For
scale, each round also times the same --clients conversations in one offline ``LLM.chat`` call (no HTTP, nobody
leaving): "offline tok/s" (--no-offline skips it).
Rounds alternate the methods, so that a slow minute of a shared machine slows both alike. Bounded: --clients
requests per round and --timeout seconds per round at most.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanospec import LLM, SamplingParams  # noqa: E402

METHODS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 5}}


@dataclass
class ClientResult:
    prompt: int
    leaves_early: bool
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that brought text
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--disconnect-every", type=int, default=5, help="every n-th client leaves early (default 5)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--rounds", type=int, default=2, help="rounds of every method, alternating (default 2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per round at most")
    p.add_argument("--no-offline", action="store_true", help="skip the offline LLM.chat timing of each round")
    p.add_argument("--json", default=None, help="write every round's figures here")
    return p.parse_args(argv)


def load_prompts() -> list[list[dict]]:
    lines = (ROOT / "benchmarks" / "prompts.jsonl").read_text().splitlines()
    return [[{"role": "user", "content": json.loads(line)["prompt"]}] for line in lines if line.strip()]


def offline_outputs(llm, conversations, max_tokens):
    """Each conversation alone through ``LLM.chat``, greedy: what every finished stream must equal."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [llm.chat(c, params)[0].outputs[0] for c in conversations]


def offline_throughput(llm, conversations, clients, max_tokens) -> float:
    """Generated tokens per second of one ``LLM.chat`` call over the ``clients`` conversations (cycled)."""
    batch = [conversations[i % len(conversations)] for i in range(clients)]
    start = time.perf_counter()
    outs = llm.chat(batch, SamplingParams(temperature=0, max_tokens=max_tokens))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


class ServerProcess:
    """``python -m nanospec.serve`` on a free loopback port, up once /health answers; its stderr is drained by a
    thread (and kept, for the error message if it fails to start)."""

    def __init__(self, model, spec_config, max_num_seqs, extra_args=()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "nanospec.serve", "--port", str(port), "--log-level", "warning",
               "--max-num-seqs", str(max_num_seqs)]
        if model is not None:
            cmd += ["--model", model]
        if spec_config is not None:
            cmd += ["--speculative-config", json.dumps(spec_config)]
        cmd += list(extra_args)  # more of the server's arguments
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("NANOSPEC_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not start:\n" + "".join(self.lines[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def metric_values(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page: 'name{labels}' -> value."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in values.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


async def run_client(client, model, messages, result: ClientResult, max_tokens: int) -> None:
    leave_after = max(1, max_tokens // 4)
    result.sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      extra_body={"return_token_ids": True})
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                content = choice.delta.content or ""
                if content:
                    result.chunk_times.append(now)
                result.text += content
                result.token_ids += getattr(choice, "token_ids", None) or []
                if choice.finish_reason is not None:
                    result.finish_reason = choice.finish_reason
            if result.leaves_early and len(result.token_ids) >= leave_after:
                await stream.close()  # the connection closes: the server aborts the request
                return
    except Exception as e:  # reported, counted as a failure
        result.error = f"{type(e).__name__}: {e}"


async def load_round(url, conversations, args) -> tuple[list[ClientResult], float]:
    results = [ClientResult(i % len(conversations), (i + 1) % args.disconnect_every == 0) for i in range(args.clients)]
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=args.timeout,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=args.timeout)) as client:
        model = (await client.models.list()).data[0].id
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*[run_client(client, model, conversations[r.prompt], r, args.max_tokens)
                                                for r in results]), timeout=args.timeout)
        wall = time.perf_counter() - start
    return results, wall


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def check_and_measure(method, results, wall, expected, url, before) -> dict:
    problems = []
    complete = [r for r in results if not r.leaves_early]
    for i, r in enumerate(results):
        want = expected[r.prompt]
        if r.error is not None:
            problems.append(f"client {i}: {r.error}")
        elif not r.leaves_early or r.finish_reason is not None:
            if r.token_ids != want.token_ids or r.text != want.text or r.finish_reason != want.finish_reason:
                problems.append(f"client {i} (prompt {r.prompt}): the stream differs from the offline output "
                                f"({len(r.token_ids)} vs {len(want.token_ids)} tokens, {r.finish_reason} vs "
                                f"{want.finish_reason})")
        elif r.token_ids != want.token_ids[: len(r.token_ids)] or not want.text.startswith(r.text):
            problems.append(f"client {i} (prompt {r.prompt}): what it got before leaving is not a prefix")
    up = httpx.get(f"{url}/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while True:  # the aborts reach the engine between two steps
        values = metric_values(httpx.get(f"{url}/metrics", timeout=30).text)
        idle = (metric(values, "vllm:num_requests_running") == 0 and metric(values, "vllm:num_requests_waiting") == 0
                and metric(values, "vllm:kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not up:
        problems.append("/health did not answer 200 after the load")
    if not idle:
        problems.append("KV blocks still in use (or requests still queued) 30 s after the load")

    def delta(name, **labels):
        return metric(values, name, **labels) - metric(before, name, **labels)

    ttft = [r.chunk_times[0] - r.sent for r in results if r.chunk_times]
    itl = [b - a for r in complete for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    drafts, drafted, accepted = (delta(f"vllm:spec_decode_num_{n}_total") for n in ("drafts", "draft_tokens",
                                                                                      "accepted_tokens"))
    generated = delta("vllm:generation_tokens_total")
    return {
        "method": method, "clients": len(results), "left_early": sum(r.leaves_early for r in results),
        "aborted_by_server": delta("vllm:request_success_total", finished_reason="abort"),
        "completed_equal_offline": sum(1 for r in complete if r.error is None and r.token_ids ==
                                       expected[r.prompt].token_ids),
        "completed": len(complete), "generated_tokens": generated, "wall_s": wall,
        "throughput_tok_s": generated / wall if wall > 0 else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "acceptance": accepted / drafted if drafted else None, "tau": 1 + accepted / drafts if drafts else None,
        "server_up": up, "kv_free_after": idle, "problems": problems,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    conversations = load_prompts()
    print(f"offline reference: {len(conversations)} prompts alone, greedy, {args.max_tokens} tokens at most",
          file=sys.stderr, flush=True)
    offline = {m: LLM(args.model, speculative_config=METHODS[m], max_num_seqs=args.clients) for m in args.methods}
    expected = offline_outputs(offline["plain" if "plain" in offline else args.methods[0]], conversations,
                               args.max_tokens)
    rows = []
    for round_index in range(args.rounds):
        for method in args.methods:
            print(f"round {round_index + 1}, {method}: starting the server", file=sys.stderr, flush=True)
            server = ServerProcess(args.model, METHODS[method], max_num_seqs=args.clients)
            try:
                before = metric_values(httpx.get(f"{server.url}/metrics", timeout=30).text)
                results, wall = asyncio.run(load_round(server.url, conversations, args))
                row = check_and_measure(method, results, wall, expected, server.url, before)
            finally:
                server.stop()
            row["round"] = round_index + 1
            if not args.no_offline:
                row["offline_tok_s"] = offline_throughput(offline[method], conversations, args.clients, args.max_tokens)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "problems"}), file=sys.stderr, flush=True)
            for problem in row["problems"]:
                print(f"  PROBLEM: {problem}", file=sys.stderr, flush=True)
    print("| round | method | clients (left early) | completed = offline | server up | KV free after | tok/s | "
          "TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | accept | tau | offline tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        accept = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        print(f"| {r['round']} | {r['method']} | {r['clients']} ({r['left_early']}) | {r['completed_equal_offline']}"
              f"/{r['completed']} | {'yes' if r['server_up'] else 'NO'} | {'yes' if r['kv_free_after'] else 'NO'} | "
              f"{r['throughput_tok_s']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
              f"{1000 * r['itl_p50_s']:.0f} / {1000 * r['itl_p99_s']:.0f} | {accept} | {tau} | "
              f"{r.get('offline_tok_s', float('nan')):.1f} |")
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method]
        print(f"{method}: median tok/s {statistics.median(r['throughput_tok_s'] for r in mine):.1f} over "
              f"{len(mine)} round(s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
