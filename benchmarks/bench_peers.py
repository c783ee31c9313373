"""nanospec beside llama.cpp on the same GGUF, the same threads, alternating prompt by prompt (batch 1, greedy).

    python benchmarks/bench_peers.py                         # every engine, every benchmark prompt, 128 tokens
    python benchmarks/bench_peers.py --limit 6 --engines nanospec llama.cpp
    python benchmarks/bench_peers.py --batch 8 --engines nanospec nanospec-float32   # batch 8, nanospec only
    python benchmarks/bench_peers.py --context-tokens 2000 --limit 4 --max-tokens 32   # after a long document

The peer is llama.cpp through ``llama-cpp-python``, an optional extra that compiles from source (about 20 minutes
on a 2-core CPU; ``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`` for this CPU's vector units).
Without it the llama.cpp engines are skipped, with a line that says so.

Engines (``--engines``):
    nanospec                  the default LLM(): the GGUF's 4-bit weights kept (quantization "auto")
    nanospec-spec             the same with its served default speculator ({"method": "mlp_speculator"})
    nanospec-ngram            the same with n-gram speculation
    nanospec-float32          quantization=None: every weight dequantized to float32
    llama.cpp                 llama-cpp-python, plain
    llama.cpp-lookup          llama-cpp-python with its prompt-lookup draft (LlamaPromptLookupDecoding)

Every engine gets the same token ids (the chat template applied by nanospec's tokenizer) and generates until eos
or --max-tokens, streaming (``--context-tokens N``: each prompt comes after a document of the other
prompts' texts, prompt i's starting with prompt i + 1's, so that the message is about N tokens); per prompt it records the time to the first token (prefill) and the time of the rest
(decode). Reported per engine: decode tok/s (tokens after the first / their time), prefill tok/s (prompt tokens /
time to the first token), end-to-end tok/s, each summed over all prompts, and its ratio to the first engine. A
warm-up request runs on every engine first. ``--batch B`` runs nanospec engines only, B prompts in one generate
call (throughput: generated tokens / wall time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.model.embedded import embedded_model_path  # noqa: E402

HERE = Path(__file__).resolve().parent
NANOSPEC_ENGINES = {
    "nanospec": dict(),
    "nanospec-spec": dict(speculative_config={"method": "mlp_speculator"}),
    "nanospec-ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 5}),
    "nanospec-float32": dict(quantization=None, dtype="float32"),
}
LLAMA_CPP_ENGINES = ("llama.cpp", "llama.cpp-lookup")
INSTALL_LLAMA_CPP = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=["nanospec", "llama.cpp", "nanospec-spec", "llama.cpp-lookup"],
                   choices=[*NANOSPEC_ENGINES, *LLAMA_CPP_ENGINES])
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", default=str(HERE / "prompts.jsonl"))
    p.add_argument("--limit", type=int, default=None, help="the first N prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every engine (default: all)")
    p.add_argument("--batch", type=int, default=1, help="B prompts per generate call (nanospec engines only)")
    p.add_argument("--lookup-tokens", type=int, default=5, help="llama.cpp-lookup's guesses per step")
    p.add_argument("--context-tokens", type=int, default=None,
                   help="put a document before each prompt, for messages of about N tokens")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def with_documents(tokenizer, texts: list[str], num_tokens: int) -> list[str]:
    """Each text after a document of the others (text i's starting with text i + 1's), cut so that the two make
    about ``num_tokens`` tokens."""
    out = []
    for i, text in enumerate(texts):
        others = texts[i + 1:] + texts[:i + 1]
        document = tokenizer.encode("\n\n".join(others * (num_tokens // 50 + 1)))
        room = max(num_tokens - len(tokenizer.encode(text)) - 2, 0)
        out.append(tokenizer.decode(document[:room]) + "\n\n" + text)
    return out


class NanospecEngine:
    def __init__(self, name: str, model: str | None, kwargs: dict):
        self.name = name
        self.llm = LLM(model, max_num_seqs=8, max_model_len=4096, **kwargs)

    def run(self, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        """(tokens, seconds to the first token, seconds of the rest)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        start = time.perf_counter()
        first = None
        tokens: list[int] = []
        for out in self.llm.stream(ids, params):
            if first is None:
                first = time.perf_counter()
            tokens = out.token_ids
        return list(tokens), first - start, time.perf_counter() - first

    def run_batch(self, batch: list[list[int]], max_tokens: int) -> tuple[int, float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        start = time.perf_counter()
        outs = self.llm.generate(batch, params)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


class LlamaCppEngine:
    def __init__(self, name: str, model: Path, threads: int, lookup_tokens: int):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.name = name
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if name == "llama.cpp-lookup" else None
        self.llm = llama_cpp.Llama(model_path=str(model), n_threads=threads, n_threads_batch=threads, n_ctx=4096,
                                   n_batch=512, draft_model=draft, verbose=False)
        self.eos = self.llm.token_eos()

    def run(self, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        self.llm.reset()
        start = time.perf_counter()
        first = None
        tokens: list[int] = []
        for token in self.llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            if token == self.eos:
                break
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
        end = time.perf_counter()
        return tokens, first - start, end - first


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else embedded_model_path()
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit] if args.limit else prompts
    engines_asked = list(args.engines)
    if args.batch > 1:
        engines_asked = [e for e in engines_asked if e in NANOSPEC_ENGINES]
    if any(e in LLAMA_CPP_ENGINES for e in engines_asked) and not llama_cpp_available():
        skipped = ", ".join(e for e in engines_asked if e in LLAMA_CPP_ENGINES)
        print(f"llama-cpp-python is not installed: skipping {skipped} (install it with {INSTALL_LLAMA_CPP}; it "
              f"compiles llama.cpp, ~20 minutes)", file=sys.stderr)
        engines_asked = [e for e in engines_asked if e not in LLAMA_CPP_ENGINES]
    if not engines_asked:
        print("no engine left to run", file=sys.stderr)
        return 2
    engines = []
    for name in engines_asked:
        if name in NANOSPEC_ENGINES:
            engines.append(NanospecEngine(name, args.model, NANOSPEC_ENGINES[name]))
        else:
            engines.append(LlamaCppEngine(name, model, args.threads, args.lookup_tokens))
    tokenizer = next((e.llm.tokenizer for e in engines if isinstance(e, NanospecEngine)), None) or \
        LLM(args.model).tokenizer
    texts = [p["prompt"] for p in prompts]
    if args.context_tokens:
        texts = with_documents(tokenizer, texts, args.context_tokens)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True)) for text in texts]
    print(f"{len(prompts)} prompts of {sum(map(len, ids)) / len(ids):.0f} tokens on average, {args.max_tokens} new "
          f"tokens at most, batch {args.batch}, {args.threads} threads, "
          f"torch {torch.__version__}, model {model.name}; load average {os.getloadavg()[0]:.2f}")
    results = run_batches(engines, ids, args) if args.batch > 1 else run_alternating(engines, ids, args)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


def run_alternating(engines, ids, args) -> dict:
    for engine in engines:  # warm-up
        engine.run(ids[0], 8)
    totals = {e.name: dict(prompt_tokens=0, decode_tokens=0, tokens=0, prefill_s=0.0, decode_s=0.0)
              for e in engines}
    outputs = {e.name: [] for e in engines}
    for i, prompt_ids in enumerate(ids):
        order = engines if i % 2 == 0 else engines[::-1]  # alternate which engine goes first
        for engine in order:
            tokens, prefill_s, decode_s = engine.run(prompt_ids, args.max_tokens)
            t = totals[engine.name]
            t["prompt_tokens"] += len(prompt_ids)
            t["tokens"] += len(tokens)
            t["decode_tokens"] += max(len(tokens) - 1, 0)
            t["prefill_s"] += prefill_s
            t["decode_s"] += decode_s
            outputs[engine.name].append(tokens)
    base = engines[0].name
    rates = {name: dict(decode=t["decode_tokens"] / t["decode_s"], prefill=t["prompt_tokens"] / t["prefill_s"],
                        end_to_end=t["tokens"] / (t["prefill_s"] + t["decode_s"])) for name, t in totals.items()}
    print(f"\n{'engine':18s} {'decode tok/s':>13s} {'prefill tok/s':>14s} {'end-to-end tok/s':>17s}   "
          f"(x {base}: decode, prefill, end to end)   greedy tokens equal to {base}'s")
    for name, r in rates.items():
        same = sum(a == b for a, b in zip(outputs[name], outputs[base]))
        print(f"{name:18s} {r['decode']:13.1f} {r['prefill']:14.1f} {r['end_to_end']:17.1f}   "
              f"({r['decode'] / rates[base]['decode']:.2f}x, {r['prefill'] / rates[base]['prefill']:.2f}x, "
              f"{r['end_to_end'] / rates[base]['end_to_end']:.2f}x)   {same}/{len(ids)}")
    return {"totals": totals, "rates": rates, "outputs": outputs}


def run_batches(engines, ids, args) -> dict:
    for engine in engines:
        engine.run_batch(ids[: args.batch], 8)
    totals = {e.name: [0, 0.0] for e in engines}
    for start in range(0, len(ids), args.batch):
        batch = ids[start:start + args.batch]
        for engine in engines if start % 2 == 0 else engines[::-1]:
            tokens, seconds = engine.run_batch(batch, args.max_tokens)
            totals[engine.name][0] += tokens
            totals[engine.name][1] += seconds
    base = engines[0].name
    rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    print(f"\n{'engine':18s} {'tok/s (batch ' + str(args.batch) + ')':>18s}")
    for name, r in rates.items():
        print(f"{name:18s} {r:18.1f}   ({r / rates[base]:.2f}x {base})")
    return {"totals": totals, "rates": rates}


if __name__ == "__main__":
    sys.exit(main())
