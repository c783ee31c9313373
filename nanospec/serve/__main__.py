"""python -m nanospec.serve: an OpenAI-compatible server (see nanospec/serve/__init__.py).

    python -m nanospec.serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'

Listens on 127.0.0.1:8000 unless told otherwise. With --api-key (or NANOSPEC_API_KEY) every /v1 route,
/tokenize and /detokenize need 'Authorization: Bearer KEY'. Sampling a request leaves out comes from the model
(--generation-config auto: its generation_config.json, a .gguf's general.sampling keys; the embedded SmolLM2:
temperature 0.2, top-p 0.9, as the chat), said in the start-up log. Every argument is checked, and the address
bound, before the model loads.
Ctrl-C or SIGTERM shuts down gracefully: every open stream ends with a chunk whose finish_reason is "abort" and
'data: [DONE]', then the process ends by that signal, as uvicorn does (status 130 / 143 in a shell).
Exit status 2: bad arguments, an address that cannot be bound, or a model that cannot be loaded (one 'error:' line
on stderr).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys

EXIT_OK, EXIT_USAGE = 0, 2  # (after a signal uvicorn ends the process by that signal)
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


class UsageError(Exception):
    """A bad argument: one 'error:' line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, each checked (UsageError naming the bad one), the speculative config parsed and the default
    sampling read, all without loading anything."""
    p = _Parser(prog="python -m nanospec.serve", description=__doc__,
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
    p.add_argument("--generation-config", default="auto",
                   help="the default sampling: 'auto' (the model's generation_config.json, a .gguf's general.sampling "
                        "keys; the embedded model: temperature 0.2, top_p 0.9), 'vllm' (the API's: temperature 1), "
                        "or a directory holding a generation_config.json")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (CUDA default) / float16")
    p.add_argument("--quantization", default="auto",
                   help="weights: auto (the default: a GGUF's 4-bit blocks kept, a Hugging Face checkpoint as "
                        "stored), int4 (groups of 32), int4-g64, int4-g128, int8 (per channel), or none (float)")
    p.add_argument("--device", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many processes (gloo on CPU, NCCL on CUDA: one GPU each)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in one batch at most (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one step computes at most (default 512 on a CPU, 4096 on a GPU)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="a longer prompt runs a chunk a step beside the decoding requests (default on)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (default: see LLM)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the K/V of prompt prefixes already computed (default on)")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that give no seed")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="requests waiting beyond --max-num-seqs before new ones get HTTP 503 (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body (default 1 MiB; larger: HTTP 413)")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    args = p.parse_args(argv)
    _check(args)
    return args


def _check(args: argparse.Namespace) -> None:
    """What argparse cannot see: ranges, an API key a client can send, the model path, the engine's arguments
    (``args.engine``, an :class:`~nanospec.engine_args.EngineArgs`), the default sampling, the host."""
    from nanospec.engine_args import EngineArgs
    from nanospec.model.generation_config import default_sampling
    from nanospec.model.quantization import quantization_from_cli

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be in [0, 65535] (0 picks a free port)")
    if args.max_queue_len < 0:
        raise UsageError(f"--max-queue-len {args.max_queue_len}: must be >= 0")
    if args.max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes {args.max_request_bytes}: must be >= 1")
    key = args.api_key
    if key is not None and not (key.strip() and key.isascii() and key.isprintable() and not key.endswith(" ")):
        raise UsageError("the API key (--api-key or NANOSPEC_API_KEY) must be printable ASCII, not empty and not "
                         "ending in a space: clients send it in an HTTP header, which carries nothing else (unset "
                         "both to serve without a key)")
    try:
        args.engine = EngineArgs(args.model, args.dtype, args.device, speculative_config=args.speculative_config,
                                 num_blocks=args.num_blocks, block_size=args.block_size,
                                 kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                                 seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                                 enable_prefix_caching=args.enable_prefix_caching,
                                 enable_chunked_prefill=args.enable_chunked_prefill,
                                 quantization=quantization_from_cli(args.quantization))
        args.default_sampling, args.default_sampling_source = default_sampling(args.engine.model,
                                                                               args.generation_config)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    try:
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {args.host}: not an address this machine can listen on ({e})") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (connections wait in its backlog until the server
    accepts them); OSError (e.g. the port is in use) otherwise."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError:
        sock.close()
        raise
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        sock = bind(args.host, args.port)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    with sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from nanospec import LLM
    from nanospec.device import fix_malloc_mmap_threshold
    from nanospec.log import logger, set_level
    from nanospec.model.generation_config import describe
    from nanospec.serve.app import build_app

    fix_malloc_mmap_threshold()
    set_level(args.log_level)
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    try:
        llm = LLM.from_args(args.engine)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if not _is_loopback(args.host) and args.api_key is None:
            logger.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
        logger.info("default sampling, for what a request leaves out (from %s): %s", args.default_sampling_source,
                    describe(args.default_sampling))
        app = build_app(llm, model_name=name, api_key=args.api_key, max_queue_len=args.max_queue_len,
                        max_request_bytes=args.max_request_bytes, default_sampling=args.default_sampling)
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
        uvicorn_handle_exit = server.handle_exit

        def handle_exit(sig, frame):  # Ctrl-C / SIGTERM: every open stream gets its last chunk and [DONE] first
            app.state.engine_loop.abort_all()
            uvicorn_handle_exit(sig, frame)

        server.handle_exit = handle_exit
        host, port = sock.getsockname()[:2]
        logger.info("serving %s, running on http://%s:%d (Ctrl-C or SIGTERM stops)", name,
                    f"[{host}]" if ":" in host else host, port)
        server.run(sockets=[sock])
    finally:
        llm.shutdown()  # the tensor-parallel workers, if any
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
