"""python -m nanospec.serve: an OpenAI-compatible server (see nanospec/serve/__init__.py).

    python -m nanospec.serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'

Listens on 127.0.0.1:8000 unless told otherwise. With --api-key (or NANOSPEC_API_KEY) every /v1 route,
/tokenize and /detokenize need 'Authorization: Bearer KEY'. Ctrl-C or SIGTERM shuts down gracefully (open
requests are aborted), then the process ends by that signal, as uvicorn does (status 130 / 143 in a shell).
Exit status 2: bad arguments or a model that cannot be loaded (one 'error:' line on stderr).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys

EXIT_OK, EXIT_USAGE = 0, 2  # (after a signal uvicorn ends the process by that signal)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nanospec.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: --model as given, or SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("NANOSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $NANOSPEC_API_KEY, else none)")
    p.add_argument("--speculative-config", default=None, type=_json_object,
                   help="JSON, as LLM(speculative_config=...), e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (CUDA default) / float16")
    p.add_argument("--device", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many processes (gloo on CPU, NCCL on CUDA: one GPU each)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in one batch at most (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (default: see LLM)")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that give no seed")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="requests waiting beyond --max-num-seqs before new ones get HTTP 503 (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body (default 1 MiB; larger: HTTP 413)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = p.parse_args(argv)
    for name in ("max_queue_len", "max_request_bytes"):
        if getattr(args, name) < (0 if name == "max_queue_len" else 1):
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: too small")
    return args


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv=None) -> int:
    args = parse_args(argv)
    import uvicorn

    from nanospec import LLM
    from nanospec.serve.app import build_app

    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    print(f"loading {args.model or 'SmolLM2-135M-Instruct (embedded)'} ...", file=sys.stderr, flush=True)
    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative_config=args.speculative_config,
                  num_blocks=args.num_blocks, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not _is_loopback(args.host) and args.api_key is None:
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    app = build_app(llm, model_name=name, api_key=args.api_key, max_queue_len=args.max_queue_len,
                    max_request_bytes=args.max_request_bytes)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        llm.shutdown()  # the tensor-parallel workers, if any
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
