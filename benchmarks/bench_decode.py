"""Batch-1 decode and prefill speed: nanospec vs transformers, same model, same dtype, one process.

    python benchmarks/bench_decode.py                       # embedded SmolLM2, fp32 on CPU
    python benchmarks/bench_decode.py --dtype bfloat16 --device cuda --batch-sizes 1 32
    python benchmarks/bench_decode.py --random-shape llama-1b --device cuda   # random weights, no files

Decode tok/s is measured between the first and the last generated token (prefill excluded), greedy,
eos ignored. The roofline is the memory bandwidth measured here (a large tensor copy) divided by the
bytes one decode step must read (every weight once, plus the KV cache read by attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.model.embedded import embedded_model_path  # noqa: E402

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden press adapted from wine making. ") * 8

RANDOM_SHAPES = {  # vocab of the embedded tokenizer so text can be decoded; other dims as named
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_bandwidth(device, nbytes=1 << 30) -> float:
    """Read bandwidth in bytes/s: the sum of a large tensor (decode reads weights, writes little), best of 5."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        src.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def _read_bytes(layer) -> int:
    """Bytes one call of a linear layer reads of its weight: the copy its kernel on this device reads (on a CPU,
    oneDNN's packed float copy, torch's int4 layout with its scales and zeros, or the padded int8 copy)."""
    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
    if getattr(layer, "cpu_scale", None) is not None:  # int8 on a CPU
        return nbytes([layer.cpu_q, layer.cpu_scale])
    if getattr(layer, "packed", None) is not None:  # float through oneDNN, or int4 on a CPU
        return nbytes([layer.packed, getattr(layer, "scales_and_zeros", None)])
    w = layer.weight
    if isinstance(w, torch.Tensor):
        return nbytes([w])
    return nbytes([getattr(w, f.name) for f in dataclasses.fields(w) if isinstance(getattr(w, f.name), torch.Tensor)])


def weight_bytes(llm: LLM) -> int:
    """Bytes one decode step reads: every matrix (the head once, tied or not; the embedding only gathers rows)
    and every norm, as loaded (float or quantized)."""
    m = llm.model
    matrices = [m.lm_head] + [getattr(layer, name) for layer in m.layers
                              for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    norms = [m.norm] + [n for layer in m.layers for n in (layer.input_norm, layer.post_attention_norm)]
    return sum(_read_bytes(w) for w in matrices) + sum(n.numel() * n.element_size() for n in norms)


def time_nanospec(llm: LLM, prompt_ids: list[int], batch: int, new_tokens: int, device) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s summed over the batch)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine = llm.engine
    for _ in range(batch):
        llm.engine.add_request(list(prompt_ids), params)
    sync(device)
    t0 = time.perf_counter()
    engine.step()  # prefill of the whole batch
    sync(device)
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync(device)
    t2 = time.perf_counter()
    for seq_id in list(engine.sequences):
        engine.pop_finished(seq_id)
    return batch * len(prompt_ids) / (t1 - t0), batch * steps / (t2 - t1)


def time_transformers(model, prompt_ids, batch: int, new_tokens: int, device) -> tuple[float, float]:
    ids = torch.tensor([prompt_ids] * batch, device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n):
        sync(device)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync(device)
        return time.perf_counter() - t

    prefill = run(1)
    total = run(new_tokens)
    return batch * len(prompt_ids) / prefill, batch * (new_tokens - 1) / (total - prefill)


def load_transformers(args, dtype, device):
    from transformers import AutoModelForCausalLM

    if args.random_shape:
        return None
    path = Path(args.model) if args.model else embedded_model_path()
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--random-shape", choices=sorted(RANDOM_SHAPES), default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (the default on CUDA is to capture decode and verify steps)")
    p.add_argument("--quantization", default="auto", help="LLM's: auto, int4, int8 or none")
    args = p.parse_args()
    quantization = None if args.quantization == "none" else args.quantization

    torch.set_grad_enabled(False)
    if args.random_shape:
        llm = LLM.with_random_weights(RANDOM_SHAPES[args.random_shape], dtype=args.dtype, device=args.device,
                                      enforce_eager=args.enforce_eager or None, quantization=quantization)
    else:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager or None,
                  quantization=quantization)
    device, dtype = llm.device, llm.dtype
    hf = None if args.no_transformers else load_transformers(args, dtype, device)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    bandwidth = measure_bandwidth(device)
    wbytes = weight_bytes(llm)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"threads {torch.get_num_threads()}, dtype {dtype}, prompt {len(prompt_ids)} tokens, "
          f"{args.new_tokens} new tokens, best of {args.repeats} alternating rounds, "
          f"weights {llm.stats()['quantization']}")
    print(f"measured bandwidth {bandwidth / 1e9:.1f} GB/s; weights {wbytes / 1e6:.0f} MB -> batch-1 roofline "
          f"{bandwidth / wbytes:.1f} tok/s")
    header = f"{'engine':<14}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'roofline':>10}{'vs hf':>8}"
    print(header)
    print("-" * len(header))
    for batch in args.batch_sizes:
        time_nanospec(llm, prompt_ids[:16], batch, 4, device)  # warm-up
        if hf is not None:
            time_transformers(hf, prompt_ids[:16], batch, 4, device)
        # Alternate the engines so that a machine whose speed drifts (a shared 2-core VM does) slows both
        # alike; the ratio is the median of the per-round ratios.
        ns, hf_runs = [], []
        for _ in range(args.repeats):
            ns.append(time_nanospec(llm, prompt_ids, batch, args.new_tokens, device))
            if hf is not None:
                hf_runs.append(time_transformers(hf, prompt_ids, batch, args.new_tokens, device))
        ns_prefill, ns_decode = max(r[0] for r in ns), max(r[1] for r in ns)
        ratio = "-"
        if hf_runs:
            hf_prefill, hf_decode = max(r[0] for r in hf_runs), max(r[1] for r in hf_runs)
            ratio = f"{statistics.median(n[1] / h[1] for n, h in zip(ns, hf_runs)):.2f}x"
            print(f"{'transformers':<14}{batch:>6}{hf_prefill:>15.1f}{hf_decode:>14.1f}"
                  f"{hf_decode / batch / (bandwidth / wbytes):>10.0%}{'':>8}")
        print(f"{'nanospec':<14}{batch:>6}{ns_prefill:>15.1f}{ns_decode:>14.1f}"
              f"{ns_decode / batch / (bandwidth / wbytes):>10.0%}{ratio:>8}")

if __name__ == "__main__":
    main()
