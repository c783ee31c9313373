"""Every knob of an engine, validated once (:class:`EngineArgs`), and :func:`build_engine`, shared by ``LLM``, the
server and the tensor-parallel workers. ``model``: an HF directory, a ``.gguf`` file, a Hugging Face Hub id (its
cached or downloaded snapshot: :mod:`nanospec.model.hub`), the embedded SmolLM2 (None) or a ``Checkpoint``;
``num_blocks`` None sizes the KV pool (:func:`nanospec.cache.kv_cache.pool_blocks`); ``enforce_eager`` False runs
decode and verify from static buffers (CUDA graphs on CUDA). The rest: ``docs/``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch

from nanospec.cache.kv_cache import check_holds_a_block, kv_bytes_per_block, pool_blocks
from nanospec.device import resolve_device, resolve_dtype
from nanospec.engine import Engine
from nanospec.log import logger
from nanospec.model.commands import DRAFT, TARGET
from nanospec.model.config import LlamaConfig
from nanospec.model.embedded import EMBEDDED_MODEL_FILE
from nanospec.model.hub import resolve_model_path
from nanospec.model.loader import Checkpoint, OpenCheckpoint, load_checkpoint, open_checkpoint, round_checkpoint
from nanospec.model.parallel import check_shardable, kv_heads_per_rank
from nanospec.model.quantization import int4_group_size, parse_quantization
from nanospec.speculative.config import (SpeculativeConfig, draft_tensor_parallel_size, make_proposer,
                                         parse_speculative_config)
from nanospec.speculative.draft import check_draft_config, check_draft_shardable, check_draft_tokenizer
from nanospec.tokenizer import Tokenizer
from nanospec.worker import ModelSpec, TensorParallel, build_model, build_runner, check_world, serve_as_worker
from nanospec.worker import start as start_tensor_parallel


@dataclass
class EngineArgs:
    model: str | os.PathLike | Checkpoint | None = None
    dtype: str | torch.dtype | None = None   # None: bfloat16 on CUDA, float32 on a CPU
    device: str | torch.device | None = None  # None: CUDA when there is a GPU
    speculative_config: dict | None = None
    num_blocks: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: 512 on a CPU (llama.cpp's batch), 4096 on a GPU
    max_model_len: int | None = None  # None: the model's context (or the draft's, if shorter)
    seed: int = 0
    enforce_eager: bool | None = None
    tensor_parallel_size: int = 1
    quantization: str | None = "auto"  # "int4", "int4-g64", "int4-g128", "int8" or None (float weights)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # a prompt longer than the step's token budget runs a chunk a step

    def __post_init__(self):
        """Every check that needs no weights; ``device``, ``dtype`` and ``speculative`` come out resolved."""
        if self.model is not None and not isinstance(self.model, (str, os.PathLike, Checkpoint)):
            raise ValueError(f"model must be a path or None, got {self.model!r}")
        if isinstance(self.model, (str, os.PathLike)) and os.fspath(self.model) == "":
            raise ValueError("model is an empty path: give a Hugging Face directory, a .gguf file or a Hub id (None: "
                             "the embedded model)")
        _check_int("block_size", self.block_size, 1, 4096)
        _check_int("num_blocks", self.num_blocks, 1, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1, 1 << 16)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        _check_int("kv_cache_memory", self.kv_cache_memory, 1, optional=True, unit=" (bytes)")
        _check_int("max_model_len", self.max_model_len, 2, optional=True)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 1024)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True, False or None, got {self.enforce_eager!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        parse_quantization(self.quantization)
        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        if self.max_num_batched_tokens is None:  # on a CPU 512 prompt tokens are seconds of a step already
            self.max_num_batched_tokens = 4096 if self.device.type == "cuda" else 512
        self.speculative: SpeculativeConfig | None = parse_speculative_config(self.speculative_config)
        if self.device.type == "cuda":  # "auto" on a GPU: float weights (cuBLAS prefills faster than the int4 matmul)
            self.quantization = None if self.quantization == "auto" else self.quantization
            if self.speculative is not None and self.speculative.quantization == "auto":
                self.speculative = replace(self.speculative, quantization=None)
        if self.speculative is not None and self.speculative.dtype is not None:
            try:  # a bad draft dtype fails here, before any loading
                resolve_dtype(self.speculative.dtype, self.device)
            except ValueError as e:
                raise ValueError(f"speculative_config['dtype']: {e}") from None
        self.draft_tensor_parallel_size = draft_tensor_parallel_size(self.speculative, self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:  # the processes torchrun started, or the GPUs there are
            check_world(self.tensor_parallel_size, self.device)
        if isinstance(self.model, (str, os.PathLike)):  # last: a Hub id may download
            self.model = str(resolve_model_path(self.model))


def build_engine(args: EngineArgs) -> tuple[Engine, TensorParallel | None]:
    """The engine over the model (this rank's shard) and the tensor-parallel group (None at T = 1), which the caller
    shuts down. Under torchrun a rank > 0 serves as a worker, then exits."""
    start = time.perf_counter()
    fits = _Fits(args)
    if isinstance(args.model, Checkpoint):
        fits.config(args.model.config)
        fits.tokenizer(args.model.tokenizer)
        checkpoint = round_checkpoint(args.model, args.quantization)
    else:
        logger.info("loading %s ...", args.model if args.model is not None else f"{EMBEDDED_MODEL_FILE} (embedded)")
        checkpoint = load_checkpoint(args.model, args.dtype, args.quantization, check_config=fits.config,
                                     check_tokenizer=fits.tokenizer)
    parallel = None
    if args.tensor_parallel_size > 1:  # again, with the int4 groups the weights came in
        check_shardable(checkpoint.config, args.tensor_parallel_size, group_size=int4_group_size(checkpoint.tensors))
        parallel = start_tensor_parallel(args.tensor_parallel_size, args.draft_tensor_parallel_size, args.device)
        if parallel.rank != 0:
            del checkpoint
            serve_as_worker(parallel)  # exits the process
    try:
        engine = _build(args, checkpoint, parallel, parallel.device if parallel is not None else args.device,
                        fits.draft)
    except BaseException:
        if parallel is not None:
            parallel.shutdown()
        raise
    logger.info("ready in %.1f s", time.perf_counter() - start)
    return engine, parallel


class _Fits:
    """What the target's config and tokenizer must fit, each checked as soon as it is read, before any weight (the
    target's or the draft's): ValueError for ``max_model_len`` beyond its context, a ``tensor_parallel_size`` that
    does not split its heads, a ``kv_cache_memory`` that holds no block of its K/V, and a draft model that cannot
    draft for it (its config and tokenizer alone read). ``draft``: that draft model, opened (None: no draft model)."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.draft: OpenCheckpoint | None = None

    def config(self, config: LlamaConfig) -> None:
        args = self.args
        context = config.max_position_embeddings
        if args.max_model_len is not None and not 1 < args.max_model_len <= context:
            raise ValueError(f"max_model_len must be in (1, {context}], got {args.max_model_len}")
        check_shardable(config, args.tensor_parallel_size)
        if args.speculative is not None and args.speculative.method == "draft":
            path = args.speculative.model
            self.draft = draft = open_checkpoint(path)  # a GGUF's header: parsed here, once
            check_draft_config(draft.config, config, path, args.max_model_len)
            check_draft_shardable(draft.config, path, args.draft_tensor_parallel_size)
        if args.num_blocks is None and args.kv_cache_memory is not None:
            kv_heads = kv_heads_per_rank(config.num_key_value_heads, args.tensor_parallel_size)
            check_holds_a_block(args.kv_cache_memory, kv_bytes_per_block(config.num_hidden_layers, args.block_size,
                                                                          kv_heads, config.head_dim, args.dtype))

    def tokenizer(self, tokenizer: Tokenizer) -> None:
        if self.draft is not None:
            check_draft_tokenizer(self.draft.tokenizer(), tokenizer, self.args.speculative.model)


def _build(args: EngineArgs, checkpoint: Checkpoint, parallel: TensorParallel | None, device: torch.device,
           draft: OpenCheckpoint | None) -> Engine:
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    max_model_len = target_max_len = args.max_model_len or config.max_position_embeddings
    source = args.model if not isinstance(args.model, Checkpoint) else checkpoint
    model = build_model(checkpoint, args.dtype, target_max_len, device, parallel.target if parallel else None)
    del checkpoint
    per_block = kv_bytes_per_block(config.num_hidden_layers, args.block_size, model.num_kv_heads, config.head_dim,
                                   args.dtype)  # this rank's KV heads
    pools = parallel.world_size if parallel is not None and device.type == "cpu" else 1  # the ranks share the memory
    num_blocks = pool_blocks(per_block, device, args.block_size, max_model_len, args.max_num_seqs, args.num_blocks,
                             args.kv_cache_memory, pools)
    logger.info("model: %d layers, %s%s on %s%s; KV cache: %d blocks of %d tokens (%.2f GiB)", config.num_hidden_layers,
                str(args.dtype).removeprefix("torch."),
                f", weights {model.quantization}" if model.quantization else "", device,
                f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else "", num_blocks, args.block_size,
                num_blocks * per_block / 2**30)
    proposer = None
    if args.speculative is not None:
        logger.info("speculation: %s%s ...", args.speculative.method,
                    f" with {args.speculative.model}" if args.speculative.model is not None else "")
        proposer = make_proposer(args.speculative, config, tokenizer, num_blocks, args.block_size, device,
                                 args.dtype, max_model_len, parallel.draft if parallel is not None else None,
                                 args.enable_prefix_caching, model.matmul_dtype, draft)
        if proposer.max_model_len is not None and proposer.max_model_len < max_model_len:
            max_model_len = proposer.max_model_len  # the draft guesses only within its own context (_Fits)
    enforce_eager = args.enforce_eager if args.enforce_eager is not None else device.type != "cuda"
    max_query_len = 1 + (proposer.max_tokens_per_step if proposer is not None else 0)  # a root and its guesses
    target = ModelSpec(source, args.dtype, target_max_len, num_blocks, args.block_size, args.max_num_seqs,
                       max_query_len, max_model_len, enforce_eager, args.quantization)
    runner = build_runner(model, target)
    if parallel is not None:
        draft = None
        if getattr(proposer, "sharded", False):  # the workers build their shards of the draft too
            draft = ModelSpec(args.speculative.model, proposer.dtype, proposer.max_len, num_blocks, args.block_size,
                              quantization=args.speculative.quantization)
            proposer.runner = parallel.driver_runner(proposer.runner, DRAFT)
        parallel.send_setup(target, draft)
        runner = parallel.driver_runner(runner, TARGET)
    return Engine(runner, tokenizer, num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                  enable_prefix_caching=args.enable_prefix_caching,
                  enable_chunked_prefill=args.enable_chunked_prefill, proposer=proposer, seed=args.seed,
                  adaptive_speculation=args.speculative is None or args.speculative.adaptive,
                  tune_threads=device.type == "cpu" and parallel is None)


def _check_int(name: str, value, minimum: int, maximum: int | None = None, *, optional: bool = False,
               unit: str = "") -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (maximum and value > maximum):
        bounds = f"in [{minimum}, {maximum}]" if maximum else f">= {minimum}"
        raise ValueError(f"{name} must be an integer {bounds}{unit}, got {value!r}")
