"""The public entry point, shaped like vLLM's ``LLM``.

    llm = LLM()                                            # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=64))[0]
    out.text, out.token_ids, out.num_steps
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=64))[0].text
    for chunk in llm.stream("Hello", SamplingParams(max_tokens=32)): print(chunk.delta_text, end="")
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from typing import Sequence as Seq

import torch
from tqdm import tqdm

from nanospec.cache.kv_cache import kv_bytes_per_block
from nanospec.chat_messages import check_messages
from nanospec.device import resolve_device, resolve_dtype
from nanospec.engine import Engine, EngineConfig, max_query_len
from nanospec.log import logger
from nanospec.model.embedded import EMBEDDED_MODEL_FILE
from nanospec.model.llama import Llama
from nanospec.model.loader import Checkpoint, load_checkpoint
from nanospec.model.random_model import random_checkpoint
from nanospec.outputs import RequestOutput
from nanospec.sampling_params import SamplingParams
from nanospec.model.parallel import check_shardable
from nanospec.speculative.config import draft_tensor_parallel_size, make_proposer, parse_speculative_config
from nanospec.worker import ModelSpec, TensorParallel, WorkerSetup
from nanospec.worker import start as start_tensor_parallel

Prompt = str | list[int]


class LLM:
    """Load a Llama (HF directory, .gguf file, the embedded SmolLM2 when ``model`` is None, or an
    in-memory ``nanospec.model.loader.Checkpoint``) and serve it.

    KV pool: ``num_blocks`` blocks of ``block_size`` tokens, or as many as ``kv_cache_memory`` bytes
    hold (default: 1 GiB on CPU, 40% of free memory on CUDA, never more than ``max_num_seqs``
    full contexts). ``speculative_config``: see :mod:`nanospec.speculative.config`. ``enforce_eager``
    (vLLM's name): False runs decode and verify steps from static buffers as CUDA graphs (the default on
    CUDA); on a CPU, False runs the same static-buffer path eagerly (the default there is True).

    ``tensor_parallel_size`` T > 1: the model is split over T processes (``nanospec.worker``): this one, the
    driver, and T-1 workers it spawns (or that torchrun started: then on ranks > 0 this constructor serves as a
    worker and exits the process when the driver shuts down). NCCL with one GPU per rank on CUDA, gloo on a CPU.
    ``shutdown()``, leaving a ``with`` block, garbage collection or interpreter exit end the workers. A draft model
    runs on ``speculative_config["draft_tensor_parallel_size"]`` ranks: 1 (the driver alone) or T (the default).
    """

    def __init__(self, model: str | os.PathLike | None = None, dtype=None, device=None, *,
                 speculative_config: dict | None = None, num_blocks: int | None = None, block_size: int = 16,
                 kv_cache_memory: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, seed: int = 0, enforce_eager: bool | None = None,
                 tensor_parallel_size: int = 1):
        if model is not None and not isinstance(model, (str, os.PathLike, Checkpoint)):
            raise ValueError(f"model must be a path or None, got {model!r}")
        _check_int("block_size", block_size, 1, 4096)
        _check_int("num_blocks", num_blocks, 1, optional=True)
        _check_int("max_num_seqs", max_num_seqs, 1, 1 << 16)
        _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_int("kv_cache_memory", kv_cache_memory, 1, optional=True, unit=" (bytes)")
        _check_int("max_model_len", max_model_len, 2, optional=True)
        _check_int("tensor_parallel_size", tensor_parallel_size, 1, 1024)
        self._source = model
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if enforce_eager is not None and not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True, False or None, got {enforce_eager!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        spec_config = parse_speculative_config(speculative_config)
        if spec_config is not None and spec_config.dtype is not None:
            try:  # a bad draft dtype fails here, before any loading
                resolve_dtype(spec_config.dtype, self.device)
            except ValueError as e:
                raise ValueError(f"speculative_config['dtype']: {e}") from None
        draft_tp = draft_tensor_parallel_size(spec_config, tensor_parallel_size)
        start = time.perf_counter()
        if isinstance(model, Checkpoint):
            checkpoint = model
        else:
            logger.info("loading %s ...", model if model is not None else f"{EMBEDDED_MODEL_FILE} (embedded)")
            checkpoint = load_checkpoint(model, self.dtype)
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        context = self.config.max_position_embeddings
        asked_model_len = max_model_len
        if max_model_len is None:
            max_model_len = context
        elif not 1 < max_model_len <= context:
            raise ValueError(f"max_model_len must be in (1, {context}], got {max_model_len}")
        self.parallel: TensorParallel | None = None
        if tensor_parallel_size > 1:
            check_shardable(self.config, tensor_parallel_size)
            self.parallel = start_tensor_parallel(tensor_parallel_size, draft_tp, self.device)
            if self.parallel.rank != 0:  # under torchrun: this process is a worker until the driver shuts down
                del checkpoint
                try:
                    self.parallel.serve()
                finally:
                    self.parallel.shutdown()
                raise SystemExit(0)
            self.device = self.parallel.device
            # shutdown() at garbage collection or at interpreter exit, whichever comes first
            self._finalizer = weakref.finalize(self, self.parallel.shutdown)
        try:
            self._build(checkpoint, spec_config, num_blocks, block_size, kv_cache_memory, max_num_seqs,
                        max_num_batched_tokens, max_model_len, asked_model_len, seed, enforce_eager)
        except BaseException:
            self.shutdown()
            raise
        logger.info("ready in %.1f s", time.perf_counter() - start)

    def _build(self, checkpoint, spec_config, num_blocks, block_size, kv_cache_memory, max_num_seqs,
               max_num_batched_tokens, max_model_len, asked_model_len, seed, enforce_eager) -> None:
        """The model (this rank's shard under tensor parallelism), the KV pool, the proposer and the engine; under
        tensor parallelism the workers get their setup just before the engine's first forward."""
        parallel = self.parallel
        self.model = Llama(checkpoint.config, checkpoint.tensors, self.device, self.dtype, max_len=max_model_len,
                           tp=parallel.target if parallel is not None else None)
        target_source = checkpoint if isinstance(self._source, Checkpoint) else self._source
        del checkpoint
        if num_blocks is None:
            num_blocks = self._blocks_from_memory(kv_cache_memory, block_size, max_model_len, max_num_seqs)
        kv_bytes = self._check_kv_memory(num_blocks, block_size)
        c = self.config
        logger.info("model: %d layers, %s on %s%s; KV cache: %d blocks of %d tokens (%.2f GiB)", c.num_hidden_layers,
                    str(self.dtype).removeprefix("torch."), self.device,
                    f" ({torch.get_num_threads()} threads)" if self.device.type == "cpu" else "", num_blocks,
                    block_size, kv_bytes / 2**30)
        proposer = None
        target_max_len = max_model_len
        if spec_config is not None:
            logger.info("speculation: %s%s ...", spec_config.method,
                        f" with {spec_config.model}" if spec_config.model is not None else "")
            proposer = make_proposer(spec_config, self.config, self.tokenizer, num_blocks, block_size, self.device,
                                     self.dtype, max_model_len, parallel)
            if proposer.max_model_len is not None and proposer.max_model_len < max_model_len:
                if asked_model_len is not None:
                    raise ValueError(f"max_model_len={asked_model_len} is longer than the draft model's context "
                                     f"({proposer.max_model_len} tokens)")
                max_model_len = proposer.max_model_len  # the draft guesses only within its own context
        if enforce_eager is None:
            enforce_eager = self.device.type != "cuda"
        config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                              enforce_eager=enforce_eager)
        if parallel is not None:
            draft = None
            if getattr(proposer, "sharded", False):
                draft = ModelSpec(spec_config.model, proposer.dtype, proposer.max_len, num_blocks, block_size)
            parallel.send_setup(WorkerSetup(
                ModelSpec(target_source, self.dtype, target_max_len, num_blocks, block_size, max_num_seqs,
                          max_query_len(proposer), max_model_len, enforce_eager), draft))
        self.engine = Engine(self.model, self.tokenizer, config, proposer=proposer, seed=seed,
                             adaptive_speculation=spec_config is None or spec_config.adaptive, parallel=parallel)
        # outputs not yet taken by the call that owns their request: every engine step serves every
        # request, so a generate() call also advances an open stream (and the stream must get them)
        self._outputs: dict[int, list[RequestOutput]] = {}

    @classmethod
    def with_random_weights(cls, shape: dict, dtype=None, device=None, **kwargs) -> LLM:
        """An ``LLM`` over a random-weight Llama of the given shape (``LlamaConfig`` fields; the embedded
        SmolLM2's vocabulary and tokenizer), for speed measurements without a model file."""
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        return cls(random_checkpoint(shape, device=device, dtype=dtype), dtype=dtype, device=device, **kwargs)

    def _check_kv_memory(self, num_blocks: int, block_size: int) -> int:
        """The KV pool's bytes; refuse, before allocating, a pool larger than the device's memory."""
        c = self.config
        need = num_blocks * kv_bytes_per_block(c.num_hidden_layers, block_size, self.model.num_kv_heads, c.head_dim,
                                               self.dtype)
        if self.device.type == "cuda":
            have = torch.cuda.mem_get_info(self.device)[0]
        else:
            have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > have:
            raise ValueError(f"num_blocks={num_blocks} of {block_size} tokens needs {need / 2**30:.1f} GiB of KV "
                             f"cache, more than the {have / 2**30:.1f} GiB this {self.device.type} has")
        return need

    def _blocks_from_memory(self, kv_cache_memory, block_size, max_model_len, max_num_seqs) -> int:
        c = self.config
        per_block = kv_bytes_per_block(c.num_hidden_layers, block_size, self.model.num_kv_heads, c.head_dim,
                                       self.dtype)  # this rank's KV heads
        if kv_cache_memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_cache_memory = int(free * 0.4)
            else:
                kv_cache_memory = 1 << 30
        if kv_cache_memory < per_block:
            raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no block ({per_block} bytes each)")
        cap = max_num_seqs * -(-max_model_len // block_size)
        return min(kv_cache_memory // per_block, cap)

    # ---------------------------------------------------------------- inputs
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text or token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)), None)
            if bad is not None:
                raise ValueError(f"token ids must be ints, got {bad!r} ({type(bad).__name__})")
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    @staticmethod
    def _as_prompt_list(prompts) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        if isinstance(prompts, (list, tuple)):
            return list(prompts)
        raise ValueError("prompts must be a string, a list of token ids, or a list of those; "
                         f"got {type(prompts).__name__}")

    def _params_list(self, params, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, (list, tuple)):
            raise ValueError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(p).__name__}")
        return params

    def _add_all(self, prompts, params) -> list[tuple[int, int]]:
        """Encode and validate every prompt first, then queue them, ``n`` requests per prompt (choice ``i`` with
        ``params.for_choice(i)``): a bad one queues nothing. Returns (request id, choice index) pairs."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._params_list(params, len(prompt_list))
        encoded = []
        for i, (prompt, p) in enumerate(zip(prompt_list, params_list)):
            try:
                encoded.append(self._encode(prompt))
                self.engine.validate_prompt(encoded[-1], p.for_choice(0))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return [(self.engine.add_request(ids, p.for_choice(c)), c)
                for ids, p in zip(encoded, params_list) for c in range(p.n)]

    # ---------------------------------------------------------------- generation
    def _step(self) -> None:
        """One engine step; each output waits in its request's queue until its owner takes it."""
        outputs = self.engine.step()
        if not outputs and not self.engine.has_unfinished():
            raise RuntimeError("the engine has no work left but a caller is still waiting for a request")
        for out in outputs:
            if out.request_id in self._outputs:
                self._outputs[out.request_id].append(out)

    def _take(self, request_id: int) -> list[RequestOutput]:
        taken, self._outputs[request_id] = self._outputs[request_id], []
        return taken

    def _release(self, request_id: int) -> None:
        """The owner of a finished (or abandoned) request is done with it."""
        self._outputs.pop(request_id, None)
        self.engine.pop_finished(request_id)

    def abort(self, request_id: int) -> None:
        """End a running request now and free its KV blocks. Whoever waits on it (a stream, a generate call)
        gets a last output with ``finish_reason == "abort"``. Unknown or finished requests are ignored."""
        final = self.engine.abort(request_id)
        if final is not None and request_id in self._outputs:
            self._outputs[request_id].append(final)

    def generate(self, prompts, params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order (with ``n > 1``, a prompt's ``n`` outputs one
        after another, ``index`` 0 .. n-1). A request that fails inside a step ends with ``finish_reason ==
        "error"`` and its ``error``; the others are served as usual."""
        ids_and_choices = self._add_all(prompts, params)
        ids = [rid for rid, _ in ids_and_choices]
        for rid in ids:
            self._outputs[rid] = []
        finished: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating") if use_tqdm else None
        try:
            while len(finished) < len(ids):
                self._step()
                for rid in ids:
                    for out in self._take(rid):
                        if out.finished and rid not in finished:
                            finished[rid] = out
                            if bar is not None:
                                bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            for rid in ids:
                self._release(rid)
            if bar is not None:
                bar.close()
        for rid, choice in ids_and_choices:
            finished[rid].index = choice
        return [finished[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """A ``RequestStream`` of the request's outputs, one per step that produced tokens (``delta_text`` is
        the new text). The prompt is checked and queued here, before the first ``next()``."""
        if isinstance(prompt, (list, tuple)) and prompt and not all(isinstance(t, int) for t in prompt):
            raise ValueError("stream() takes one prompt (a string or a list of token ids); use generate() for several")
        if params is not None and isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"stream() serves one completion: n must be 1, got {params.n} (use generate())")
        ((rid, _),) = self._add_all([prompt] if not isinstance(prompt, str) else prompt, params)
        self._outputs[rid] = []
        return RequestStream(self, rid)

    def _render_chat(self, messages, where: str = "messages") -> list[int]:
        """The conversation, checked as the server checks it (:func:`nanospec.chat_messages.check_messages`), through
        the chat template with the assistant's turn opened, as token ids."""
        text = self.tokenizer.apply_chat_template(check_messages(messages, where), add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def chat(self, messages, params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations. A conversation that
        the server would refuse (empty, an unknown role, a message without content, ...) is refused with the
        server's message, before any work."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
            return self.generate([self._render_chat(c, f"messages[{i}]") for i, c in enumerate(messages)], params)
        return self.generate([self._render_chat(messages)], params)

    def stream_chat(self, messages, params: SamplingParams | None = None) -> RequestStream:
        return self.stream(self._render_chat(messages), params)

    # ---------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """End the tensor-parallel workers and the process group (nothing to do at ``tensor_parallel_size=1``).
        Also done on leaving a ``with LLM(...)`` block and at interpreter exit. The LLM cannot run afterwards."""
        parallel = getattr(self, "parallel", None)
        if parallel is None or parallel.closed:
            return
        self._finalizer()  # parallel.shutdown(), once
        if parallel.broken is None:
            parallel.broken = "this LLM was shut down"

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- introspection
    def kv_cache_stats(self) -> dict:
        bm = self.engine.block_manager
        return {"free_blocks": bm.num_free_blocks, "total_blocks": bm.num_blocks, "block_size": bm.block_size}

    def stats(self) -> dict:
        s = self.engine.stats
        return {
            "num_steps": s.num_steps,
            "num_generated_tokens": s.num_generated_tokens,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0,
            "num_preemptions": self.engine.scheduler.num_preemptions,
            "forward_seconds": s.forward_seconds,
            "step_seconds": s.step_seconds,
        }


class RequestStream:
    """One request's outputs as an iterator: a ``RequestOutput`` per step that produced tokens for it, the last
    one finished (``"stop"``, ``"length"``, ``"abort"`` after ``LLM.abort``, or ``"error"``). ``close()``, or
    dropping the stream, even before its first ``next()``, aborts the request and frees its KV blocks."""

    def __init__(self, llm: LLM, request_id: int):
        self.request_id = request_id
        self._llm = llm
        self._pending: deque[RequestOutput] = deque()
        self._done = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        while not self._pending:
            if self._done:
                raise StopIteration
            self._pending.extend(self._llm._take(self.request_id))
            if not self._pending:
                self._llm._step()
        out = self._pending.popleft()
        if out.finished:
            self._done = True
            self._pending.clear()
            self._llm._release(self.request_id)
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._pending.clear()
            self._llm.abort(self.request_id)
            self._llm._release(self.request_id)

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit the engine may be gone already
            pass


def _check_int(name: str, value, minimum: int, maximum: int | None = None, *, optional: bool = False,
               unit: str = "") -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (maximum and value > maximum):
        bounds = f"in [{minimum}, {maximum}]" if maximum else f">= {minimum}"
        raise ValueError(f"{name} must be an integer {bounds}{unit}, got {value!r}")
