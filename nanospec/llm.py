"""The public entry point, shaped like vLLM's ``LLM``.

    llm = LLM()                                            # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=64))[0]
    out.outputs[0].text, out.outputs[0].token_ids          # a RequestOutput per prompt, its n completions
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=64))[0].outputs[0].text
    for chunk in llm.stream("Hello", SamplingParams(max_tokens=32)): print(chunk.delta_text, end="")
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from typing import Sequence as Seq

from tqdm import tqdm

from nanospec.chat_messages import check_messages
from nanospec.device import resolve_device, resolve_dtype
from nanospec.engine_args import EngineArgs, build_engine
from nanospec.model.generation_config import default_sampling
from nanospec.model.loader import Checkpoint
from nanospec.model.random_model import random_checkpoint
from nanospec.outputs import CompletionOutput, RequestOutput
from nanospec.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """``LLM(model=None, dtype=None, device=None, **engine_args)``: the engine :class:`~nanospec.engine_args.EngineArgs`
    describes, and ``generate``, ``chat``, ``stream``, ``abort``, ``get_tokenizer``. With ``tensor_parallel_size`` > 1
    this process is the driver (:mod:`nanospec.worker`); ``shutdown()`` or leaving a ``with`` block ends the workers."""

    def __init__(self, model=None, dtype=None, device=None, **engine_args):
        known = [field.name for field in dataclasses.fields(EngineArgs)]
        unknown = sorted(set(engine_args) - set(known))
        if unknown:  # e.g. vLLM's gpu_memory_utilization: the KV pool's size is kv_cache_memory (bytes) or num_blocks
            raise ValueError(f"LLM() takes no argument {', '.join(map(repr, unknown))}; its engine arguments are "
                             f"{', '.join(known)} (the KV pool: kv_cache_memory in bytes, or num_blocks)")
        self._start(EngineArgs(model, dtype, device, **engine_args))

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        # the model's generation_config.json (a bad one: refused before the weights); none for weights in memory
        self.default_sampling = {} if isinstance(args.model, Checkpoint) else default_sampling(args.model)[0]
        self.engine, self.parallel = build_engine(args)
        if self.parallel is not None:  # shutdown() at garbage collection or at interpreter exit, whichever is first
            self._finalizer = weakref.finalize(self, self.parallel.shutdown)
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer
        self.config, self.device, self.dtype = self.model.config, self.model.device, self.model.dtype
        # outputs not yet taken by the call that owns their request: every engine step serves every
        # request, so a generate() call also advances an open stream (and the stream must get them)
        self._outputs: dict[int, list[CompletionOutput]] = {}

    @classmethod
    def with_random_weights(cls, shape: dict, dtype=None, device=None, **kwargs) -> LLM:
        """An ``LLM`` over a random-weight Llama of the given shape (the embedded vocabulary), for speed
        measurements."""
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        return cls(random_checkpoint(shape, device=device, dtype=dtype), dtype=dtype, device=device, **kwargs)

    # ---------------------------------------------------------------- inputs
    @staticmethod
    def _unwrap(prompt) -> Prompt:
        """vLLM's prompt dicts, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, as the text or ids."""
        if not isinstance(prompt, dict):
            return prompt
        if len(prompt) != 1 or not {"prompt", "prompt_token_ids"} & prompt.keys():
            raise ValueError(f"a prompt dict takes one key, 'prompt' or 'prompt_token_ids'; got {sorted(prompt)}")
        return next(iter(prompt.values()))

    def _encode(self, prompt: Prompt, add_special_tokens: bool) -> list[int]:
        """Token ids as given, or of text: a raw prompt with the tokenizer's special tokens (BOS where it adds one),
        a rendered chat (``add_special_tokens`` False) without, as vLLM encodes them."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text or token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)), None)
            if bad is not None:
                raise ValueError(f"token ids must be ints, got {bad!r} ({type(bad).__name__})")
            return list(prompt)
        raise ValueError("a prompt must be a string, a list of token ids or a dict of one; "
                         f"got {type(prompt).__name__}")

    @staticmethod
    def _as_prompt_list(prompts) -> list[Prompt]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):  # one list of token ids, or a list of prompts
            return [list(prompts)] if prompts and all(isinstance(t, int) for t in prompts) else list(prompts)
        raise ValueError("prompts must be a string, a list of token ids, a prompt dict, or a list of those; "
                         f"got {type(prompts).__name__}")

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``, ``chat`` and ``stream`` use where no SamplingParams is given, as vLLM's ``LLM``: the
        model's ``generation_config.json`` (the embedded SmolLM2: temperature 0.2, top-p 0.9), over SamplingParams'
        defaults."""
        return SamplingParams(**self.default_sampling)

    def _params_list(self, params, n: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or self.get_default_sampling_params()] * n
        if not isinstance(params, (list, tuple)):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        return params

    def _add_all(self, prompts, params, add_special_tokens: bool = True,
                 numbered: bool = True) -> list[tuple[Prompt, list[int]]]:
        """Encode and validate every prompt, then queue ``n`` requests per prompt; a bad one queues nothing, its
        ValueError starting "prompt i: " where ``numbered``. Per prompt: the prompt and its requests' ids, one per
        completion in ``index`` order."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._params_list(params, len(prompt_list))
        encoded = []
        for i, (prompt, p) in enumerate(zip(prompt_list, params_list)):
            try:
                prompt_list[i] = prompt = self._unwrap(prompt)
                encoded.append(self._encode(prompt, add_special_tokens))
                self.engine.validate_prompt(encoded[-1], p.for_choice(0))
            except ValueError as e:
                if not numbered:
                    raise
                raise ValueError(f"prompt {i}: {e}") from None
        return [(prompt, [self.engine.add_request(ids, p.for_choice(c)) for c in range(p.n)])
                for prompt, ids, p in zip(prompt_list, encoded, params_list)]

    # ---------------------------------------------------------------- generation
    def _step(self) -> None:
        outputs = self.engine.step()
        if not outputs and not self.engine.has_unfinished():
            raise RuntimeError("the engine has no work left but a caller is still waiting for a request")
        for out in outputs:
            if out.request_id in self._outputs:
                self._outputs[out.request_id].append(out)

    def _take(self, request_id: int) -> list[CompletionOutput]:
        taken, self._outputs[request_id] = self._outputs[request_id], []
        return taken

    def _release(self, request_id: int) -> None:
        self._outputs.pop(request_id, None)
        self.engine.pop_finished(request_id)

    def abort(self, request_id: int) -> None:
        """End a running request; whoever waits on it gets a last output with ``finish_reason == "abort"``."""
        final = self.engine.abort(request_id)
        if final is not None and request_id in self._outputs:
            self._outputs[request_id].append(final)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion: one ``RequestOutput`` per prompt, in order, its ``n`` completions in
        ``outputs``. A completion that fails inside a step ends with ``finish_reason == "error"``."""
        return self._run(self._add_all(prompts, sampling_params), use_tqdm)

    def _run(self, added: list[tuple[Prompt, list[int]]], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request ``_add_all`` queued has finished; a ``RequestOutput`` per prompt."""
        ids = [rid for _, rids in added for rid in rids]
        self._outputs.update((rid, []) for rid in ids)
        finished: dict[int, CompletionOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        try:
            while len(finished) < len(ids):
                self._step()
                for rid in ids:
                    for out in self._take(rid):
                        if out.finished and rid not in finished:
                            finished[rid] = out
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            for rid in ids:
                self._release(rid)
            bar.close()
        outputs = []
        for prompt, rids in added:
            for index, rid in enumerate(rids):
                finished[rid].index = index
            outputs.append(RequestOutput(rids[0], prompt if isinstance(prompt, str) else None,
                                         finished[rids[0]].prompt_token_ids, [finished[rid] for rid in rids]))
        return outputs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> RequestStream:
        """A ``RequestStream`` of one completion's outputs, one per step that produced tokens."""
        return self._stream(prompt, sampling_params, add_special_tokens=True)

    def _stream(self, prompt: Prompt, sampling_params, add_special_tokens: bool) -> RequestStream:
        if isinstance(prompt, (list, tuple)) and prompt and not all(isinstance(t, int) for t in prompt):
            raise ValueError("stream() takes one prompt (a string or a list of token ids); use generate() for several")
        (params,) = self._params_list(sampling_params, 1)  # a SamplingParams, or a list of one
        if params.n != 1:
            raise ValueError(f"stream() serves one completion: n must be 1, got {params.n} (use generate())")
        ((_, (rid,)),) = self._add_all([prompt] if not isinstance(prompt, str) else prompt, params,
                                       add_special_tokens, numbered=False)
        self._outputs[rid] = []
        return RequestStream(self, rid)

    def _render_chat(self, messages, where: str = "messages", add_generation_prompt: bool = True,
                     continue_final_message: bool = False) -> str:
        """The checked conversation through the chat template, the assistant's turn opened (unless not asked, or
        the last message is continued)."""
        return self.tokenizer.apply_chat_template(check_messages(messages, where),
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, checked as the server checks
        them; a ``RequestOutput`` per conversation, its ``prompt`` the rendered conversation (vLLM's arguments:
        ``continue_final_message`` with ``add_generation_prompt=False`` lets the model go on with the last message,
        e.g. an assistant's answer begun for it)."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
            conversations = [(c, f"messages[{i}]") for i, c in enumerate(messages)]
        else:
            conversations = [(messages, "messages")]
        prompts = [self._render_chat(c, where, add_generation_prompt, continue_final_message)
                   for c, where in conversations]
        return self._run(self._add_all(prompts, sampling_params, add_special_tokens=False), use_tqdm)

    def stream_chat(self, messages, sampling_params: SamplingParams | None = None) -> RequestStream:
        return self._stream(self._render_chat(messages), sampling_params, add_special_tokens=False)

    # ---------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """End the tensor-parallel workers and the process group; the LLM cannot run afterwards."""
        if getattr(self, "parallel", None) is not None:
            self._finalizer()  # parallel.shutdown(), once

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- introspection
    def get_tokenizer(self):
        """The model's tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.tokenizer

    def kv_cache_stats(self) -> dict:
        """``free_blocks``: blocks a request can take, free or holding a cached prefix (``cached_blocks``)."""
        bm = self.engine.block_manager
        return {"free_blocks": bm.num_free_blocks, "cached_blocks": bm.num_cached_blocks,
                "total_blocks": bm.num_blocks, "block_size": bm.block_size}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only while no request runs. Returns whether it did."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict:
        s = self.engine.stats  # num_steps, num_generated_tokens, num_draft_tokens, num_accepted_tokens, *_seconds
        return {"quantization": self.model.quantization,  # e.g. "int4-g32 (120), int8 (1)", "float32 (9)"
                **dataclasses.asdict(s),
                "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0,
                "num_preemptions": self.engine.scheduler.num_preemptions,
                "prefix_cache_queries": self.engine.block_manager.stats.queries,  # prompt tokens looked up
                "prefix_cache_hits": self.engine.block_manager.stats.hits}        # of those, not computed again


class RequestStream:
    """One completion's outputs as an iterator, the last finished. ``close()``, or dropping the stream, aborts the
    request."""

    def __init__(self, llm: LLM, request_id: int):
        self.request_id = request_id
        self._llm = llm
        self._pending: deque[CompletionOutput] = deque()
        self._done = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> CompletionOutput:
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

