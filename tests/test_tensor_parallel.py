"""Tensor parallelism on a CPU with gloo: 2 ranks (the driver and one spawned worker) against 1.

What must hold: greedy output identical to tensor_parallel_size=1 for plain decoding, n-gram (a tree: accepted
paths' K/V moved on every rank), a draft on the driver alone (draft TP 1), a sharded draft (draft TP 2, whose one KV
head is replicated on both ranks) and an EAGLE-3 head on the driver; seeded sampling identical too; no KV block left
in any pool (the block tables are the driver's alone: the workers' pools are indexed only through them); a worker
that dies raises TensorParallelError within seconds; shutdown, the context manager, interpreter exit and a killed
driver leave no process behind; torchrun runs example 08 with 2 processes. The target's vocabulary (321) does not
split evenly, so the head's padding is exercised.

Why "identical" can be asked of fp32 that is summed differently: the row-parallel all-reduce adds two partial
sums where one rank's matmul adds all terms in one order, a ~1e-7 relative difference; greedy tokens flip only
at near ties, which these random models (weights of std 0.2, logits far from uniform) do not have on these
prompts. A flip would fail the test, not be tolerated.

Each 2-rank LLM costs a process start (seconds on the 2-core CI machine), so each is built once per module and
serves several checks; one torch.distributed group per process means one 2-rank LLM at a time.
"""

import dataclasses
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanospec import LLM, SamplingParams
from nanospec.model.parallel import TensorParallelError, check_shardable, head_range, vocab_range
import test_eagle3
from checkout import ROOT, checkout_env
from tiny import assert_no_leak, make_tiny_llama

PROMPTS = ["The quick brown fox", "abc abc abc abc abc", "Hello, world! Hello, world!", "x = [1, 2, 3]; y = [1, 2,"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, seed=7, ignore_eos=True)
KW = dict(num_blocks=64, block_size=8, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_target")
    make_tiny_llama(path, seed=3, num_heads=4, num_kv_heads=1, layers=2, vocab=321)  # its KV head on both ranks
    return str(path)


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_draft")  # another shape than the target's: a mix-up would show
    make_tiny_llama(path, seed=4, num_heads=2, num_kv_heads=2, head_dim=8, hidden=32, ffn=64, layers=1, vocab=321)
    return str(path)


def _run(llm, params, **overrides):
    params = dataclasses.replace(params, **overrides)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def _assert_workers_gone(llm):
    for process in llm.parallel.processes:
        assert not process.is_alive(), f"worker pid {process.pid} still running"
    assert not multiprocessing.active_children()
    assert not dist.is_initialized()


# ---------------------------------------------------------------- the sharding arithmetic
def test_head_and_vocab_ranges():
    assert [head_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # KV heads replicated
    assert [vocab_range(321, r, 2) for r in range(2)] == [(0, 161), (161, 321)]
    assert [vocab_range(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def test_bad_sizes_are_refused_before_any_process_starts(target_path, draft_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(target_path, tensor_parallel_size=3, **KW)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer in"):
        LLM(target_path, tensor_parallel_size=0, **KW)
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size'\]=3"):
        LLM(target_path, tensor_parallel_size=2, **KW,
            speculative_config={"method": "draft", "model": draft_path, "draft_tensor_parallel_size": 3})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(target_path, tensor_parallel_size=2, **KW,
            speculative_config={"method": "ngram", "draft_tensor_parallel_size": 1})
    from nanospec.model.config import LlamaConfig
    with pytest.raises(ValueError, match="neither divides the model's 3 KV heads"):
        check_shardable(LlamaConfig(num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                                    intermediate_size=64), 2)
    assert not multiprocessing.active_children()


def test_a_group_the_launch_cannot_run_is_refused_before_any_weight_is_read(target_path, monkeypatch):
    """More ranks than GPUs, one GPU named, or another size than torchrun started: a ValueError naming the value
    before the checkpoint is read (minutes for a large one), as for any other engine argument."""
    import nanospec.engine_args

    def read_weights(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the size was checked")

    monkeypatch.setattr(nanospec.engine_args, "load_checkpoint", read_weights)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs \(one per rank\), this machine has 1"):
        LLM(target_path, tensor_parallel_size=2, device="cuda")
    with pytest.raises(ValueError, match=r"device='cuda:1' names one GPU, but tensor_parallel_size=2 puts rank r"):
        LLM(target_path, tensor_parallel_size=2, device="cuda:1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but torchrun started 4 processes"):
        LLM(target_path, tensor_parallel_size=2, **KW)
    assert not multiprocessing.active_children()


# ---------------------------------------------------------------- TP 2 against TP 1
class TestDraftOnTwoRanks:
    """Target and draft both on 2 ranks; plain requests through ``speculate=False``. (A class, so that its 2-rank
    LLM is shut down before the next test starts one: one process group per process.)"""

    @pytest.fixture(scope="class")
    @classmethod
    def llms(cls, target_path, draft_path):
        spec = {"method": "draft", "model": draft_path, "num_speculative_tokens": 3, "adaptive": False}
        one = LLM(target_path, **KW, speculative_config=spec)
        with LLM(target_path, tensor_parallel_size=2, **KW, speculative_config=spec) as two:
            yield one, two
        _assert_workers_gone(two)

    def test_plain_greedy_and_seeded_sampling_equal_tp1(self, llms):
        one, two = llms
        assert two.engine.model.num_heads == 2 and two.engine.model.num_kv_heads == 1  # half the q heads, the KV head
        for params in (GREEDY, SAMPLED):
            assert _run(two, params, speculate=False) == _run(one, params, speculate=False)
        assert_no_leak(two)

    def test_prompt_logprobs_equal_tp1(self, llms):
        """The prompt rows' logits come from the 2-rank forward, gathered over the vocabulary shards."""
        one, two = llms
        params = dataclasses.replace(GREEDY, max_tokens=4, prompt_logprobs=2)
        for a, b in zip(two.generate(PROMPTS, params), one.generate(PROMPTS, params)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_logprobs[0] is None
            assert len(a.prompt_logprobs) == len(a.prompt_token_ids) > 1
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert_no_leak(two)

    def test_sharded_draft_equals_tp1(self, llms):
        one, two = llms
        proposer = two.engine.speculator.proposer
        assert proposer.sharded and proposer.model.num_heads == proposer.model.num_kv_heads == 1
        for params in (GREEDY, SAMPLED):  # sampled: rejection sampling's tokens depend on the draft's distributions
            assert _run(two, params) == _run(one, params)
            assert two.stats()["num_accepted_tokens"] == one.stats()["num_accepted_tokens"]
        assert two.stats()["num_draft_tokens"] == one.stats()["num_draft_tokens"] > 0
        assert_no_leak(two)

    def test_prefix_cache_on_every_rank_equals_no_cache(self, llms, target_path, draft_path):
        """Prompts that start with blocks the 2-rank engine computed before (each rank's pool written through the
        driver's block tables, target and sharded draft alike) give the tokens of a 1-rank engine without the
        cache."""
        _, two = llms
        spec = {"method": "draft", "model": draft_path, "num_speculative_tokens": 3, "adaptive": False}
        off = LLM(target_path, **KW, speculative_config=spec, enable_prefix_caching=False)
        turns = [p + " and then" for p in PROMPTS]
        hits = two.stats()["prefix_cache_hits"]
        draft_hits = two.engine.speculator.proposer.block_manager.stats.hits
        assert _run(two, GREEDY) == _run(off, GREEDY)
        assert [o.outputs[0].token_ids for o in two.generate(turns, GREEDY)] == \
            [o.outputs[0].token_ids for o in off.generate(turns, GREEDY)]
        assert two.stats()["prefix_cache_hits"] > hits
        assert two.engine.speculator.proposer.block_manager.stats.hits > draft_hits
        assert_no_leak(two)


def test_ngram_tree_equals_tp1(target_path):
    """Prompts that hold the model's own continuation, so that n-gram trees get accepted paths off the chain (their
    K/V moved on both ranks); decode and verify steps through the static buffers (``enforce_eager=False``)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "max_candidates": 3, "adaptive": False}
    one = LLM(target_path, **KW, speculative_config=spec, enforce_eager=False)
    prompts = []
    for prompt in PROMPTS:
        ids = one.tokenizer.encode(prompt)
        own = one.generate([ids], dataclasses.replace(GREEDY, speculate=False))[0].outputs[0].token_ids
        prompts.append(ids + own + ids)
    expected = [out.outputs[0].token_ids for out in one.generate(prompts, GREEDY)]
    with LLM(target_path, tensor_parallel_size=2, **KW, speculative_config=spec, enforce_eager=False) as two:
        assert [out.outputs[0].token_ids for out in two.generate(prompts, GREEDY)] == expected
        assert two.stats()["num_accepted_tokens"] == one.stats()["num_accepted_tokens"] > 0
        assert_no_leak(two)
    _assert_workers_gone(two)


def test_mlp_speculator_equals_tp1(target_path, tmp_path):
    """The MLP speculator reads the target's hidden state, gathered on the driver from the sharded forward: a
    beam of candidates with prompt lookup gives TP 1's tokens and acceptance at TP 2, greedy and seeded."""
    from nanospec.model.mlp_speculator import save_mlp_speculator
    from tiny import most_common_successors, successor_speculator

    plain = LLM(target_path, **KW)
    ids = [plain.tokenizer.encode(p) for p in PROMPTS]
    outputs = [out.outputs[0].token_ids for out in plain.generate(ids, GREEDY)]
    model = successor_speculator(most_common_successors([i + o for i, o in zip(ids, outputs)]),
                                 plain.config.hidden_size, plain.config.vocab_size)
    spec = {"method": "mlp_speculator", "model": str(save_mlp_speculator(model, tmp_path, dtype=torch.float32)),
            "tree_top_k": 2, "prompt_lookup": True, "adaptive": False}
    one = LLM(target_path, **KW, speculative_config=spec)
    expected = [_run(one, params) for params in (GREEDY, SAMPLED)]
    assert expected[0] == outputs
    with LLM(target_path, tensor_parallel_size=2, **KW, speculative_config=spec) as two:
        assert [_run(two, params) for params in (GREEDY, SAMPLED)] == expected
        assert two.stats()["num_accepted_tokens"] == one.stats()["num_accepted_tokens"] > 0
        assert_no_leak(two)
    _assert_workers_gone(two)


def test_draft_on_the_driver_alone_equals_tp1(target_path):
    """Draft TP 1, the draft being the target itself guessing a tree: paths accepted off the chain (their target K/V
    moved on both ranks), the accepted path and bonus token backfilled into the draft's KV; the draft is whole on
    the driver and sends the workers nothing."""
    spec = {"method": "draft", "model": target_path, "num_speculative_tokens": 3, "tree_top_k": 2,
            "draft_tensor_parallel_size": 1, "adaptive": False}
    one = LLM(target_path, **KW, speculative_config=spec)
    expected = _run(one, GREEDY)
    with LLM(target_path, tensor_parallel_size=2, **KW, speculative_config=spec) as two:
        proposer = two.engine.speculator.proposer
        assert not proposer.sharded and proposer.model.tp is None and proposer.model.num_heads == 4
        assert _run(two, GREEDY) == expected
        assert two.stats()["num_accepted_tokens"] == one.stats()["num_accepted_tokens"] > 0
        assert _run(two, SAMPLED) == _run(one, SAMPLED)
        assert_no_leak(two)
    _assert_workers_gone(two)


def test_eagle3_head_on_the_driver_equals_tp1(tmp_path, monkeypatch):
    """An EAGLE-3 head at TP 2 runs on the driver alone: it fuses the residual streams that the driver's shard keeps
    (the workers keep none) and embeds with the target's table gathered whole onto the driver (321 rows, split
    unevenly). Greedy and seeded tokens, acceptance and every guess drafted equal TP 1's, and every block of the
    target's pools and the head's returns: a head that guesses the most common successor drafting a chain (guesses
    accepted and rejected), and a random head drafting EAGLE-2's tree (its guesses read every auxiliary state)."""
    target = tmp_path / "target"
    model = make_tiny_llama(target, seed=1, layers=3, vocab=321)  # 3 layers: the head's default (2, 1, 0)
    plain = LLM(str(target), **KW)
    ids = [plain.tokenizer.encode(p) for p in PROMPTS]
    outputs = [out.outputs[0].token_ids for out in plain.generate(ids, GREEDY)]
    monkeypatch.setattr(test_eagle3, "VOCAB", 321)  # the head's config names this target's vocabulary
    successor = test_eagle3.build_successor_head(tmp_path / "successor", model, [i + o for i, o in zip(ids, outputs)])
    config = test_eagle3.head_config(draft_vocab_size=100)
    tensors = test_eagle3.random_tensors(config, seed=2, embedding=False, hot=list(range(3, 203, 2)))
    random = test_eagle3.write_head(tmp_path / "random", tensors, config)
    for head, tree in ((successor, {}), (random, {"tree_top_k": 2, "tree_budget": 5})):
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False, **tree}
        one = LLM(str(target), **KW, speculative_config=spec)
        steps = test_eagle3.record_trees(one)
        expected = [_run(one, params) for params in (GREEDY, SAMPLED)]
        assert expected[0] == outputs
        with LLM(str(target), tensor_parallel_size=2, **KW, speculative_config=spec) as two:
            assert two.engine.runner.aux_layers == (0, 1, 2)
            assert torch.equal(two.engine.speculator.proposer.embed.weight, one.engine.model.embed.weight)
            two_steps = test_eagle3.record_trees(two)
            assert [_run(two, params) for params in (GREEDY, SAMPLED)] == expected
            drafted = [[(t.token_ids, t.parents) for _, _, t in s if t is not None] for s in (steps, two_steps)]
            assert drafted[0] == drafted[1] and len(drafted[0]) > 20
            stats = two.stats()
            assert stats["num_accepted_tokens"] == one.stats()["num_accepted_tokens"]
            if head is successor:
                assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
            test_eagle3.assert_head_blocks_returned(two)
        _assert_workers_gone(two)


def test_quantized_target_and_draft_under_tp(draft_path, tmp_path):
    """An int4 target (q/k/v and gate/up split by rows, o and down by columns on group boundaries) with a sharded
    int8 draft at TP 2: speculation equals plain decoding at TP 2, greedy and seeded, and the first token's
    log-probabilities are TP 1's up to rounding (the int4 kernels round each rank's partial sums to bfloat16, so
    TP 2 is not TP 1 bit for bit). A width that does not split into whole int4 groups is refused before any process
    starts."""
    target = str(tmp_path)
    make_tiny_llama(tmp_path, seed=3, num_heads=4, num_kv_heads=1, layers=2, vocab=321, ffn=128)
    spec = {"method": "draft", "model": draft_path, "num_speculative_tokens": 2, "quantization": "int8",
            "acceptance": "coupled", "adaptive": False}
    first = dataclasses.replace(GREEDY, max_tokens=1, logprobs=3)
    one = [out.outputs[0] for out in LLM(target, **KW, quantization="int4").generate(PROMPTS, first)]
    with LLM(target, tensor_parallel_size=2, **KW, quantization="int4", speculative_config=spec) as two:
        assert two.model.quantization == "int4-g32 (9)" and two.engine.speculator.proposer.sharded
        for params in (GREEDY, SAMPLED):
            assert _run(two, params) == _run(two, params, speculate=False)
        assert two.stats()["num_accepted_tokens"] > 0
        for a, b in zip((out.outputs[0] for out in two.generate(PROMPTS, first)), one):
            assert a.token_ids == b.token_ids and abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.05
        assert_no_leak(two)
    _assert_workers_gone(two)
    make_tiny_llama(tmp_path, seed=3, num_heads=4, num_kv_heads=1, layers=2, vocab=321, ffn=96)
    with pytest.raises(ValueError, match=r"intermediate_size \(96\) into 48 inputs a rank, not whole int4 groups"):
        LLM(target, tensor_parallel_size=2, **KW, quantization="int4")
    assert not multiprocessing.active_children()


def test_the_ranks_on_a_cpu_split_the_default_kv_budget(target_path, monkeypatch):
    """On a CPU every rank's KV pool lies in the one machine's memory, so by default the ranks split the share of it
    that one pool gets (a quarter; here shrunk to 100 blocks of this model): TP 2, its one KV head on both ranks,
    gets 50 blocks a rank where TP 1 gets 100, and runs as TP 1 does."""
    from nanospec.cache import kv_cache

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_block = kv_cache.kv_bytes_per_block(2, KW["block_size"], 1, 16, torch.float32)
    monkeypatch.setattr(kv_cache, "CPU_MEMORY_SHARE", 100.5 * per_block / memory)
    kw = {**KW, "num_blocks": None}
    one = LLM(target_path, **kw)
    assert one.kv_cache_stats()["total_blocks"] == 100
    with LLM(target_path, tensor_parallel_size=2, **kw) as two:
        assert two.kv_cache_stats()["total_blocks"] == 50
        assert _run(two, GREEDY) == _run(one, GREEDY)
        assert_no_leak(two)
    _assert_workers_gone(two)


# ---------------------------------------------------------------- lifecycle
def test_dead_worker_raises_within_seconds_and_shutdown_ends_everything(target_path):
    with LLM(target_path, tensor_parallel_size=2, **KW) as llm:
        llm.generate(PROMPTS[:1], GREEDY)
        worker = llm.parallel.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"worker rank 1 \(pid {worker.pid}\) died \(exit code -9\)"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True))
        assert time.monotonic() - start < 5
        with pytest.raises(TensorParallelError):  # and every later call
            llm.generate(PROMPTS[:1], GREEDY)
    _assert_workers_gone(llm)
    with pytest.raises(TensorParallelError, match="died"):
        llm.generate(PROMPTS[:1], GREEDY)


def test_ctrl_c_inside_a_step_raises_keyboard_interrupt(target_path, monkeypatch):
    """Ctrl-C while the driver runs its shard (the worker already in the forward's collectives) reaches the caller as
    KeyboardInterrupt at once, as at TP 1 (the chat's Ctrl-C handling catches it), not as a TensorParallelError;
    the ranks are out of step, so the next call raises TensorParallelError naming it, every block is back in the pool
    and leaving the block ends the stuck worker."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with LLM(target_path, tensor_parallel_size=2, **KW) as llm:
        llm.generate(PROMPTS[:1], GREEDY)
        monkeypatch.setattr(llm.engine.runner.local, "execute", interrupted)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 1
        assert_no_leak(llm)
        with pytest.raises(TensorParallelError, match="out of step: KeyboardInterrupt"):
            llm.generate(PROMPTS[:1], GREEDY)
    _assert_workers_gone(llm)


def test_a_group_out_of_step_ends_without_a_leak_warning(target_path):
    """A group left out of step (Ctrl-C inside a step) ends by terminating its worker, and the script exits without
    the resource tracker's warning of leaked semaphores (named semaphores a terminated worker held)."""
    script = textwrap.dedent(f"""
        from nanospec import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({target_path!r}, tensor_parallel_size=2, num_blocks=32, device="cpu", dtype="float32")
            def interrupted(*args, **kwargs):
                raise KeyboardInterrupt
            llm.engine.runner.local.execute = interrupted
            try:
                llm.generate(["hi"], SamplingParams(max_tokens=2))
            except KeyboardInterrupt:
                llm.shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=checkout_env())
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr


def _worker_failing_to_build(*args):
    """A spawned worker (started by reference to this module) that cannot build its shard."""
    import nanospec.worker

    def build_model(*args, **kwargs):
        raise MemoryError("no memory for this rank's shard")

    nanospec.worker.build_model = build_model
    nanospec.worker._spawned_worker(*args)


def test_a_worker_that_cannot_build_its_shard_fails_the_llm(target_path, monkeypatch):
    """LLM() returns once every worker has built its shards: a worker that fails to (here out of memory) makes LLM()
    raise TensorParallelError naming it, not return an engine whose first request fails, and nothing is left."""
    import nanospec.worker

    monkeypatch.setattr(nanospec.worker, "_spawned_worker", _worker_failing_to_build)
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) died \(exit code 1\)"):
        LLM(target_path, tensor_parallel_size=2, **KW)
    assert not multiprocessing.active_children()
    assert not dist.is_initialized()


@pytest.mark.parametrize("ending", ["exit", "killed"])
def test_the_workers_end_with_their_driver(target_path, ending):
    """A script that never calls shutdown() and exits, or whose driver is killed (no atexit, no finalizer): its
    worker is gone within seconds either way (in the second case its receive fails on the closed connection)."""
    script = textwrap.dedent(f"""
        import os, signal
        from nanospec import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({target_path!r}, tensor_parallel_size=2, num_blocks=32, device="cpu", dtype="float32")
            llm.generate(["hi"], SamplingParams(max_tokens=2))
            print(llm.parallel.processes[0].pid, flush=True)
            if {ending!r} == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=checkout_env())
    assert done.returncode == (0 if ending == "exit" else -signal.SIGKILL), done.stderr
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"worker {pid} outlived its driver ({ending})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")  # a zombie (exited, not yet reaped by init) is gone too
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_torchrun_runs_example_08(target_path, draft_path):
    """The documented way across machines, here 2 processes on one: torchrun starts both ranks of example 08."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         str(ROOT / "examples" / "08_tensor_parallel.py"), "--model", target_path, "--draft", draft_path,
         "--draft-tp", "1", "--max-tokens", "6", "--cpu"],
        capture_output=True, text=True, timeout=300, env=checkout_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "same tokens as tensor_parallel_size=1: True" in done.stdout


# ---------------------------------------------------------------- NCCL, on one GPU
@pytest.mark.parametrize("backend, device", [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=pytest.mark.gpu)])
def test_collectives_at_world_size_1(backend, device, target_path):
    """NCCL with several ranks needs several GPUs, and the GPU machines here have one each: this runs the sharded
    code path (every all-reduce and the logits' all-gather through the backend) at world size 1 and compares it
    with the plain model. On the CPU the same test runs with gloo."""
    from nanospec.cache.kv_cache import KVCache
    from nanospec.model.forward_batch import build_forward_batch
    from nanospec.model.llama import Llama
    from nanospec.model.parallel import ParallelGroup
    from nanospec.model.loader import load_checkpoint

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        checkpoint = load_checkpoint(target_path, torch.float32)
        group = ParallelGroup(dist.group.WORLD, 0, 1, force_collectives=True)
        models = [Llama(checkpoint.config, checkpoint.tensors, device, torch.float32, max_len=256, tp=tp)
                  for tp in (None, group)]
        assert models[0].tp is None and models[1].tp is group
        logits = []
        for model in models:
            kv = KVCache(model.config.num_hidden_layers, 4, 16, model.num_kv_heads, model.head_dim, torch.float32,
                         device)
            batch = build_forward_batch([[5, 6, 7, 8]], [0], [[0]], 16, [[0, 1, 2, 3]], device)
            logits.append(model.compute_logits(model.forward(batch, kv)))
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()
