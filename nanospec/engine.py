"""The engine loop. One step:

    seqs      = scheduler.schedule()                    which sequences run (a long prompt: a chunk a step); KV
                                                        blocks reserved
    proposals = speculator.propose(seqs)                a token tree of guesses per sequence (maybe empty)
    batch     = build_step_batch(seqs, proposals)       one ragged batch: prefill, decode and verify alike
    logits, hidden = runner.execute(batch, ...)         ONE target forward (a request's prompt_logprobs: its prompt
                                                        rows' logits, read here, then taken out of the step's)
    verdicts  = speculator.verify(seqs, proposals, ...) accepted path + one token of the target's own
    commit                                              append tokens, stop checks, name full blocks for the
                                                        prefix cache, roll back rejected KV, tell the proposer

After verification ``num_cached_tokens`` moves to just before the newly emitted token and the blocks past it return
to the pool. A prompt's chunk that stops short of its last token draws nothing: it only moves ``num_cached_tokens``.
A failure of the tensor-parallel group is not one request's: it ends the step and reaches the caller.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import torch

from nanospec.cache.block_manager import BlockManager, slots_of
from nanospec.cpu_threads import Contention, ThreadTuner
from nanospec.detokenizer import TextStream
from nanospec.model.parallel import TensorParallelError
from nanospec.model.runner import ModelRunner
from nanospec.outputs import CompletionOutput
from nanospec.sampling.logprobs import take_prompt_logprobs
from nanospec.sampling.penalties import bad_words_token_ids
from nanospec.sampling_params import SamplingParams
from nanospec.scheduler import Scheduler
from nanospec.sequence import Sequence
from nanospec.speculative.proposal import Proposal, Verdict, build_step_batch
from nanospec.speculative.proposer import Proposer
from nanospec.speculative.speculator import Speculator
from nanospec.tokenizer import Tokenizer


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0


@dataclass
class EngineLoad:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # the share of KV blocks in use (cached blocks that no request holds are not)
    num_preemptions: int   # so far
    max_guess_depth: int   # the deepest position a guess can reach (0: no speculation)
    prefix_cache_queries: int = 0  # so far, in tokens: looked up in the prefix cache at admission
    prefix_cache_hits: int = 0     # of those, found there


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, enable_prefix_caching: bool,
                 enable_chunked_prefill: bool = True, proposer: Proposer | None = None, seed: int = 0,
                 adaptive_speculation: bool = True, tune_threads: bool = False):
        """``runner``: the target's, over ``num_blocks`` KV blocks; the sizes as ``EngineArgs`` names them, resolved
        by :func:`~nanospec.engine_args.build_engine`. ``tune_threads``: each step's CPU thread count follows how busy
        the machine is (:mod:`nanospec.cpu_threads`)."""
        self.runner = runner
        self.model, self.kv_cache = runner.model, runner.kv_cache
        self.tokenizer = tokenizer
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs  # what a server reads
        self.vocab_size = self.model.config.vocab_size
        # on a CPU each table's K/V is kept one slice of the cache where it can (see BlockManager)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          consecutive=self.kv_cache.data.device.type == "cpu")
        self.speculator = Speculator(proposer, self.runner, self.block_manager, max_model_len=max_model_len,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     adaptive=adaptive_speculation)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   num_lookahead_slots=self.speculator.num_lookahead_slots,
                                   on_preempt=self.speculator.preempt, enable_chunked_prefill=enable_chunked_prefill)
        # the most tokens (prompt and output) one request may reach: the context, or what the KV pool holds beside a
        # step's guesses where that is less (validate_prompt refuses more); what a server's default max_tokens fills
        pool = num_blocks * block_size
        self.max_request_len = max_model_len if max_model_len <= pool else pool - self.speculator.max_tokens_per_step
        self.threads = ThreadTuner() if tune_threads else None
        self._step_tokens = 0  # the last step's forward, in tokens
        self.sequences: dict[int, Sequence] = {}
        self._stepping = False  # inside step(): an abort waits for the step's end (see abort)
        self._deferred_aborts: list[int] = []
        self.stats = EngineStats()
        self._next_id = 0
        self._seed_rng = random.Random(seed)

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate and queue a request; returns its id. Raises ValueError before any work."""
        bad_words = self.validate_prompt(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seed = (seed + 2**63) % 2**64 - 2**63  # any int as a signed 64-bit seed (the same value modulo 2**64)
        text = TextStream(self.tokenizer, prompt_token_ids, params.stop_list, params.include_stop_str_in_output,
                          params.skip_special_tokens, params.detokenize)
        if params.max_tokens is None:  # until the context ends
            params = replace(params, max_tokens=self.max_model_len - len(prompt_token_ids))
        seq = Sequence(self._next_id, prompt_token_ids, params, seed, text, self._stop_token_ids(params))
        seq.bad_words_token_ids = bad_words
        self.speculator.start(seq)
        self._next_id += 1
        self.sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[list[int]]:
        """Raises ValueError, naming the bad value, for a request this engine cannot run; returns its ``bad_words``
        as token ids (tokenized here to check them against the vocabulary)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:  # (LLM.generate turns n into n requests: params.for_choice(i))
            raise ValueError(f"a request is one completion: n must be 1 here, got {params.n}")
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is out of the vocabulary [0, {vocab})")
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids: token id {t} is out of the vocabulary [0, {vocab})")
        for name in ("logit_bias", "allowed_token_ids"):
            for t in getattr(params, name) or ():
                if t >= vocab:
                    raise ValueError(f"{name}: token id {t} is out of the vocabulary [0, {vocab})")
        bad_words = bad_words_token_ids(params.bad_words or [], self.tokenizer, vocab)  # a token outside: ValueError
        self._check_a_token_can_be_drawn(params, bad_words)
        max_len = self.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens but the context holds {max_len} "
                             f"(prompt + at least one generated token)")
        if params.max_tokens is None and params.min_tokens > max_len - len(prompt_token_ids):
            raise ValueError(f"min_tokens={params.min_tokens} exceeds the {max_len - len(prompt_token_ids)} tokens "
                             f"the context ({max_len}) leaves after the prompt ({len(prompt_token_ids)} tokens)")
        # the most slots a step holds for it: its tokens and a proposal, within the context
        lifetime = min(len(prompt_token_ids) + (params.max_tokens or max_len) + self.speculator.max_tokens_per_step,
                       max_len)
        need = self.block_manager.blocks_for(lifetime)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"the KV pool is too small for this request: it needs {need} blocks of "
                             f"{self.block_manager.block_size} tokens ({lifetime} tokens) but the pool has "
                             f"{self.block_manager.num_blocks}; raise num_blocks / kv_cache_memory or lower max_tokens")
        return bad_words

    def _check_a_token_can_be_drawn(self, params: SamplingParams, bad_words: list[list[int]]) -> None:
        """ValueError where the first token could be no token at all: every token (every one of
        ``allowed_token_ids``) banned as a one-token bad word or, under ``min_tokens``, a stop token held off."""
        allowed = params.allowed_token_ids
        held = set(self._stop_token_ids(params)) if params.min_tokens > 0 else set()
        if allowed and set(allowed) <= held:
            raise ValueError(f"allowed_token_ids: {allowed} are all stop tokens, which min_tokens="
                             f"{params.min_tokens} holds off: no token could be drawn")
        banned = {word[0] for word in bad_words if len(word) == 1}  # banned after any output
        if not banned:
            return
        held_off = f" or stop tokens that min_tokens={params.min_tokens} holds off" if held else ""
        if allowed and set(allowed) <= banned | held:
            raise ValueError(f"allowed_token_ids: {allowed} are all banned by bad_words {params.bad_words}"
                             f"{held_off}: no token could be drawn")
        if not allowed and len(banned | held) >= self.vocab_size:
            raise ValueError(f"bad_words ban every token of the vocabulary ({self.vocab_size}){held_off}: no token "
                             f"could be drawn")

    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        """The tokens that end a request: eos (unless ignored), then its stop_token_ids."""
        eos = [] if params.ignore_eos else self.tokenizer.eos_token_ids
        return list(dict.fromkeys([*eos, *params.stop_token_ids]))

    def abort(self, request_id: int) -> CompletionOutput | None:
        """End a request now (finish reason "abort"); its final output, or None if unknown or finished. Called
        during a step (a dropped stream's finaliser runs wherever the garbage collector does), it ends the request
        when the step ends, its final output among the step's."""
        if self._stepping:
            self._deferred_aborts.append(request_id)
            return None
        seq = self.sequences.pop(request_id, None)
        return None if seq is None or seq.is_finished else self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def load(self) -> EngineLoad:
        """What is running and waiting, and how full the KV pool is (what a server reports)."""
        bm, scheduler = self.block_manager, self.scheduler
        return EngineLoad(len(scheduler.running), len(scheduler.waiting), 1.0 - bm.num_free_blocks / bm.num_blocks,
                          scheduler.num_preemptions, self.speculator.max_guess_depth, bm.stats.queries, bm.stats.hits)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached K/V blocks (the target's and a draft's); only while no request holds a block."""
        return self.block_manager.reset_prefix_cache() and self.speculator.reset_prefix_cache()

    def pop_finished(self, request_id: int) -> None:
        """Forget a finished request. An unfinished one is kept: an abort deferred to the step's end must find it."""
        seq = self.sequences.get(request_id)
        if seq is not None and seq.is_finished:
            del self.sequences[request_id]

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[CompletionOutput]:
        """schedule -> propose -> build the batch -> ONE target forward -> verify -> commit, at ``self.threads``'
        count."""
        saved = torch.get_num_threads()
        threads = self.threads.threads if self.threads is not None else saved
        if threads != saved:
            torch.set_num_threads(threads)
        try:
            self._stepping = True
            with Contention() as timed:
                seqs = self.scheduler.schedule()
                self._copy_placed_prefixes()
                self._step_tokens = 0
                outputs = self._step(seqs) if seqs else []
        finally:
            self._stepping = False
            if threads != saved:
                torch.set_num_threads(saved)
        while self._deferred_aborts:
            if (final := self.abort(self._deferred_aborts.pop(0))) is not None:
                outputs.append(final)
        self.stats.step_seconds += timed.seconds
        if self.threads is not None and self._step_tokens:
            self.threads.observe(threads, self._step_tokens, timed.seconds, timed.waiting)
        return outputs

    def _copy_placed_prefixes(self) -> None:
        """The cached prefixes the scheduler placed by copy (``BlockManager.take_copies``): their K/V, block by
        block."""
        copies = self.block_manager.take_copies()
        if copies:
            size = self.block_manager.block_size
            src, dst = (torch.tensor(slots_of(list(blocks), size, range(len(copies) * size)), dtype=torch.int64)
                        for blocks in zip(*copies))
            self.runner.copy_kv_slots(src, dst)

    def _step(self, seqs: list[Sequence]) -> list[CompletionOutput]:
        # the sequences that draw a token first (their rows lead the batch), then the chunks of longer prompts
        chunks = [seq for seq in seqs if seq.is_prefill_chunk]
        drawing = [seq for seq in seqs if not seq.is_prefill_chunk]
        try:
            proposals = self.speculator.propose(drawing + chunks)[:len(drawing)]
            batch = build_step_batch(drawing + chunks, proposals + [Proposal()] * len(chunks),
                                     self.block_manager.block_size)
            self._step_tokens = batch.num_tokens
            forward_start = time.perf_counter()
            logits, hidden = self.runner.execute(batch, hidden_states=self.speculator.needs_hidden_states)
            self.stats.forward_seconds += time.perf_counter() - forward_start
            if any(seq.needs_prompt_logprobs for seq in drawing):
                logits, hidden = take_prompt_logprobs(logits, hidden, drawing,
                                                      [1 + len(p.fed()[0]) for p in proposals])
            verdicts = self.speculator.verify(drawing, proposals, logits, hidden) if drawing else []
            if chunks:
                self.speculator.read_chunks(chunks, batch.num_tokens - sum(seq.num_new_tokens for seq in chunks))
        except TensorParallelError:  # the whole group failed, not these requests
            raise
        except Exception as error:  # nothing is committed yet: only the requests that fail alone fail
            return self._isolate(seqs, error)
        self.stats.num_steps += 1
        for seq in chunks:  # K/V computed, nothing drawn
            seq.num_cached_tokens += seq.num_new_tokens
            self.block_manager.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_cached_tokens)
        return [self._commit(seq, proposal, verdict) for seq, proposal, verdict in zip(drawing, proposals, verdicts)]

    def _isolate(self, seqs: list[Sequence], error: Exception) -> list[CompletionOutput]:
        """After a failed step: reset each sequence's speculative state, then fail it if alone, else run each alone."""
        for seq in seqs:
            self.speculator.preempt(seq)
        if len(seqs) == 1:
            return [self._fail(seqs[0], error)]
        return [output for seq in seqs for output in self._step([seq])]

    def _fail(self, seq: Sequence, error: Exception) -> CompletionOutput:
        seq.error = f"{type(error).__name__}: {error}"
        return self._finish(seq, "error")

    def _commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> CompletionOutput:
        try:
            finish_reason = self._append(seq, proposal, verdict)
            self.block_manager.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_cached_tokens)
            if finish_reason is not None:
                return self._finish(seq, finish_reason)
            self.speculator.commit(seq, proposal, verdict)
            self.block_manager.truncate(seq.block_table, seq.num_tokens)
        except Exception as error:  # this request alone fails
            return self._fail(seq, error)
        return self._output(seq)

    def _append(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> str | None:
        """Append the emitted tokens up to the first that ends the request; count them. Returns why it ended, or
        None."""
        num_drafts = len(proposal.token_ids)
        num_old = seq.num_tokens
        finish_reason = None
        for i, token in enumerate(verdict.emitted):
            seq.token_ids.append(token)
            if seq.logprobs is not None:
                seq.logprobs.append(verdict.logprobs[i])
            may_stop = seq.num_output_tokens > seq.params.min_tokens  # (stop tokens before it have probability 0)
            stop_token = may_stop and token in seq.stop_token_ids
            # a stop token's text is left out of the text (vLLM's rule), unless include_stop_str_in_output
            if (not stop_token or seq.params.include_stop_str_in_output) \
                    and seq.text_stream.add(token, check_stop=may_stop):
                finish_reason, seq.stop_reason = "stop", seq.text_stream.matched_stop
            elif stop_token:
                finish_reason = "stop"
                # vLLM's: None for the tokenizer's eos; any other stop token (one the request gives, or an eos id
                # only config.json, generation_config.json or a GGUF's eot / eom key names) is the reason
                eos = token == self.tokenizer.eos_token_id and not seq.params.ignore_eos
                seq.stop_reason = None if eos else token
            elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                finish_reason = "length"
            if finish_reason is not None:
                # text held back for an unfinished character, released now, may complete a stop string
                if finish_reason != "stop" and seq.text_stream.finish(check_stop=may_stop):
                    finish_reason, seq.stop_reason = "stop", seq.text_stream.matched_stop
                break
        num_new = seq.num_tokens - num_old
        # K/V now exists for every old token and the accepted path; the last emitted token has none yet
        seq.num_cached_tokens = min(num_old + verdict.num_accepted, seq.num_tokens - 1)
        num_accepted = min(verdict.num_accepted, num_new)  # not the drafts cut off by a finish
        seq.num_steps += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_generated_tokens += num_new
        self.stats.num_accepted_tokens += num_accepted
        return finish_reason

    def _finish(self, seq: Sequence, reason: str) -> CompletionOutput:
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
            self.speculator.free(seq)
        return self._output(seq)

    def _output(self, seq: Sequence) -> CompletionOutput:
        delta = seq.text_stream.take_delta(finished=seq.is_finished)
        return CompletionOutput(
            request_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids, text=seq.text,
            token_ids=seq.output_token_ids, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            num_steps=seq.num_steps, num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens, delta_text=delta, error=seq.error,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            num_cached_tokens=seq.num_prefix_cached_tokens or 0, prompt_logprobs=seq.prompt_logprobs)
