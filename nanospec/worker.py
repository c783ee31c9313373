"""The processes of tensor parallelism: starting them, the workers' loop, and ending them.

The **driver** (rank 0 of T) runs the engine and its own shard; **workers** (ranks 1 .. T-1) hold their shards of the
target (and of a sharded draft) with their own KV pools, and run the driver's commands (:mod:`nanospec.model.commands`)
so that every rank enters the model's collectives together. Workers are spawned by ``LLM`` (a ``TCPStore`` on
127.0.0.1 where each checks in), or under **torchrun** every rank runs the script and ranks > 0 serve until the
driver shuts down, then exit. Groups, made on every rank in the same order:

    the world         the target's group: NCCL on CUDA (one GPU per rank), gloo on a CPU
    control           gloo over every rank: the driver's commands (no timeout while idle)
    draft             the draft's group: [0] (draft on the driver alone) or every rank

A worker that dies is seen before the next command or by the failed collective, and raises
:class:`~nanospec.model.parallel.TensorParallelError` in the caller.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from nanospec.cache.kv_cache import KVCache
from nanospec.model.commands import DRAFT, TARGET, CommandChannel, Op
from nanospec.model.driver_runner import DriverRunner
from nanospec.model.llama import Llama
from nanospec.model.loader import Checkpoint, load_checkpoint
from nanospec.model.parallel import ParallelGroup, TensorParallelError
from nanospec.model.runner import ModelRunner

START_TIMEOUT = datetime.timedelta(seconds=120)   # for every worker to check in
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # a collective of the model's that never completes
IDLE = datetime.timedelta(days=365)               # a worker waits for the driver's next command as long as it takes


@dataclass
class ModelSpec:
    """What a rank needs to build its shard of one model and its runner (the driver's numbers)."""
    source: str | os.PathLike | Checkpoint | None  # a checkpoint path (None: the embedded model), or the checkpoint
    dtype: torch.dtype
    max_len: int | None  # the RoPE table's length (Llama's max_len)
    num_blocks: int
    block_size: int
    max_num_seqs: int = 1
    max_query_len: int = 1
    max_model_len: int = 1
    enforce_eager: bool = True
    quantization: str | None = None  # as LLM(quantization=...)


class TensorParallel:
    """This process's place in the group: rank, device, groups; on the driver the spawned workers too."""

    def __init__(self, rank: int, world_size: int, device: torch.device, draft_size: int | None,
                 processes: list | None = None, owns_process_group: bool = True):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.processes = processes or []
        self.broken: str | None = None  # why the group failed (then every command raises TensorParallelError)
        self.closed = False
        self.setup_sent = False  # until then the workers wait for or build their setup: no command reaches them
        self.owns_process_group = owns_process_group  # False: torchrun's script made the group, and destroys it
        self.target = ParallelGroup(dist.group.WORLD, rank, world_size)
        self.channel = CommandChannel(dist.new_group(backend="gloo", timeout=IDLE), rank)
        self.draft: ParallelGroup | None = None  # None on a rank outside the draft's group
        if draft_size is not None:
            ranks = list(range(draft_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.draft = ParallelGroup(group, rank, draft_size)
        self._saved_threads = torch.get_num_threads()

    # ---------------------------------------------------------------- the driver
    def driver_runner(self, local: ModelRunner, model_id: int) -> DriverRunner:
        return DriverRunner(local, self.channel, model_id, self)

    def send_setup(self, target: ModelSpec, draft: ModelSpec | None) -> None:
        """What the workers build: the target's shard and a sharded draft's (None: no draft, or one on the driver
        alone); returns once every worker has built them, or raises TensorParallelError for one that failed to."""
        dist.broadcast_object_list([target, draft], src=0, group=self.channel.group)
        try:
            dist.barrier(group=self.channel.group)
        except Exception:
            self.check(2.0)
            raise
        self.setup_sent = True

    def check(self, grace: float = 0.0) -> None:
        """Raise TensorParallelError if a spawned worker has exited (waiting up to ``grace`` seconds for one to)."""
        deadline = time.monotonic() + grace
        while True:
            if self.broken is not None:
                raise TensorParallelError(self.broken)
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    self.broken = (f"tensor-parallel worker rank {rank} (pid {process.pid}) died "
                                   f"(exit code {process.exitcode})")
                    raise TensorParallelError(self.broken)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def shutdown(self) -> None:
        """End every worker (SHUTDOWN, then terminate what is left) and the process group; idempotent."""
        if self.closed:
            return
        self.closed = True
        leaving = self.rank == 0 and self.broken is None and self.setup_sent
        if leaving:
            try:
                self.check()
                self.channel.send(Op.SHUTDOWN)
            except Exception:  # a dead worker: the others are terminated below
                leaving = False
        for process in self.processes:
            process.join(timeout=10 if leaving else 0.5)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        try:
            if self.owns_process_group:
                dist.destroy_process_group()
            else:  # the world is the script's: only the groups made here go
                dist.destroy_process_group(self.channel.group)
                if self.draft is not None and self.draft.group is not dist.group.WORLD:
                    dist.destroy_process_group(self.draft.group)
        except Exception:
            pass
        torch.set_num_threads(self._saved_threads)
        self.broken = self.broken or "this LLM was shut down"

    # ---------------------------------------------------------------- a worker
    def serve(self) -> None:
        """A worker's life: build what the driver's setup says, then run its commands until SHUTDOWN."""
        specs: list[ModelSpec | None] = [None, None]
        dist.broadcast_object_list(specs, src=0, group=self.channel.group)
        runners = {}
        for model_id, spec, tp in zip((TARGET, DRAFT), specs, (self.target, self.draft)):
            if spec is not None:
                runners[model_id] = build_runner(build_model(spec.source, spec.dtype, spec.max_len, self.device, tp,
                                                             quantization=spec.quantization), spec)
        dist.barrier(group=self.channel.group)  # built: the driver's send_setup returns
        while True:
            command = self.channel.receive()
            if command.op == Op.SHUTDOWN:
                return
            runner = runners[command.model]
            if command.op == Op.EXECUTE:
                runner.execute(command.batch())
            elif command.op == Op.COPY_KV:
                runner.copy_kv_slots(*command.tensors)
            elif command.op == Op.GATHER_EMBEDDING:
                runner.model.embed.whole()


def build_model(source, dtype: torch.dtype, max_len: int | None, device: torch.device, tp: ParallelGroup | None,
                quantization: str | None = None) -> Llama:
    """This rank's shard of the model at ``source`` (a path, None: the embedded model, or a checkpoint)."""
    checkpoint = source if isinstance(source, Checkpoint) else load_checkpoint(source, dtype, quantization)
    return Llama(checkpoint.config, checkpoint.tensors, device, dtype, max_len=max_len, tp=tp)


def build_runner(model: Llama, spec: ModelSpec) -> ModelRunner:
    """A model's KV pool (its KV heads, the driver's number of blocks) and its runner."""
    c = model.config
    kv_cache = KVCache(c.num_hidden_layers, spec.num_blocks, spec.block_size, model.num_kv_heads, c.head_dim,
                       spec.dtype, model.device)
    return ModelRunner(model, kv_cache, max_num_seqs=spec.max_num_seqs, max_query_len=spec.max_query_len,
                       max_model_len=spec.max_model_len, enforce_eager=spec.enforce_eager)


def serve_as_worker(parallel: TensorParallel) -> None:
    """Under torchrun, on a rank > 0: serve the driver until it shuts down, then exit the process."""
    try:
        parallel.serve()
    finally:
        parallel.shutdown()
    raise SystemExit(0)


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else torch.device("cpu")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_world(world_size: int, device: torch.device) -> None:
    """ValueError, naming the value, for a group of ``world_size`` ranks that this launch cannot run: one GPU named
    (rank r runs on ``cuda:r``); under torchrun, another number of processes; spawned on CUDA, more ranks than GPUs."""
    if world_size > 1 and device.type == "cuda" and device.index is not None:
        raise ValueError(f"device={str(device)!r} names one GPU, but tensor_parallel_size={world_size} puts rank r "
                         f"on cuda:r: pass device='cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES")
    if _under_torchrun():
        launched = int(os.environ["WORLD_SIZE"])
        if launched != world_size:
            raise ValueError(f"tensor_parallel_size={world_size} but torchrun started {launched} processes "
                             f"(WORLD_SIZE): they must be equal")
    elif device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs (one per rank), this machine "
                         f"has {torch.cuda.device_count()}")


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def start(world_size: int, draft_size: int | None, device: torch.device) -> TensorParallel:
    """Join (torchrun) or create (spawn) the group of ``world_size`` ranks (:func:`check_world` checked it);
    RuntimeError when a worker fails to start."""
    if _under_torchrun():
        return _join_torchrun(world_size, draft_size, device)
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialized in this process: one "
                           "tensor-parallel LLM at a time (shut the other down first)")
    # on a CPU the ranks share the cores: each gets its share of this process's threads
    threads = max(1, torch.get_num_threads() // world_size) if device.type == "cpu" else torch.get_num_threads()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=START_TIMEOUT, wait_for_workers=False)
    context = mp.get_context("spawn")
    processes = []
    try:
        for rank in range(1, world_size):
            process = context.Process(target=_spawned_worker, daemon=True, name=f"nanospec-tp-worker-{rank}",
                                      args=(rank, world_size, draft_size, device.type, store.port, threads))
            process.start()
            processes.append(process)
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while store.add("checked_in", 0) < world_size - 1:
            for rank, process in enumerate(processes, start=1):
                if not process.is_alive():
                    raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {process.pid}) exited while starting "
                                       f"(exit code {process.exitcode}); its error is above, on stderr")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {START_TIMEOUT.seconds} s")
            time.sleep(0.02)
        dist.init_process_group(_backend(device), store=store, rank=0, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
        tp = TensorParallel(0, world_size, _rank_device(device, 0), draft_size, processes)
        torch.set_num_threads(threads)  # after TensorParallel saved the caller's count, which shutdown() restores
        return tp
    except BaseException:
        for process in processes:
            process.kill()
            process.join()
        raise


def _spawned_worker(rank: int, world_size: int, draft_size: int | None, device_type: str, port: int,
                    threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle (it then ends the workers)
    # tqdm's default lock (the loading bars') is a named semaphore, which a worker terminated out of step leaves behind
    # for the resource tracker to warn of at exit; a thread lock serves a worker's one thread of bars
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=START_TIMEOUT)
    store.add("checked_in", 1)
    device = _rank_device(torch.device(device_type), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    tp = TensorParallel(rank, world_size, device, draft_size)
    try:
        tp.serve()
    except Exception as error:  # e.g. the driver went away (its connections closed): one line, not a traceback
        print(f"nanospec tensor-parallel worker rank {rank}: {type(error).__name__}: {str(error)[:500]}",
              file=sys.stderr)
        sys.exit(1)
    finally:
        tp.shutdown()  # a worker's: the process group goes


def _join_torchrun(world_size: int, draft_size: int | None, device: torch.device) -> TensorParallel:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    rank_device = _rank_device(device, local_rank)
    if rank_device.type == "cuda":
        torch.cuda.set_device(rank_device)
    made_here = not dist.is_initialized()  # the script may have made the world group itself
    if made_here:
        dist.init_process_group(_backend(device), init_method="env://", rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, world_size, rank_device, draft_size, owns_process_group=made_here)
