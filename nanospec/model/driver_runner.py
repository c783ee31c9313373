"""The driver's runner of a tensor-parallel model: every call goes to the workers as a command
(:mod:`nanospec.model.commands`), then runs on the driver's shard, so all ranks enter the collectives together.
A call that fails part-way leaves the ranks out of step, so it is fatal: it raises
:class:`~nanospec.model.parallel.TensorParallelError` (an interrupt, Ctrl-C's KeyboardInterrupt or SystemExit, is raised
as it is), remembered by the group's ``health`` for every later call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanospec.model.commands import CommandChannel, Op
from nanospec.model.forward_batch import ForwardBatch
from nanospec.model.parallel import TensorParallelError, VocabParallelEmbedding
from nanospec.model.runner import ModelRunner


class DriverRunner:
    """``health`` (the worker group's): ``broken``, why the group failed once it has (text: an exception would keep
    its frames alive), and ``check(grace)``, which raises TensorParallelError if the group is broken or a worker is
    gone (waiting up to ``grace`` seconds)."""

    def __init__(self, local: ModelRunner, channel: CommandChannel, model_id: int, health):
        self.local = local
        self.channel = channel
        self.model_id = model_id
        self.health = health
        self.model = local.model
        self.kv_cache = local.kv_cache
        self.device = local.device

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The driver's alone: after each all-reduce every rank holds the whole residual stream, so the driver's shard
        keeps the auxiliary states (``aux_hidden``) and the workers compute none."""
        return self.local.aux_layers

    @aux_layers.setter
    def aux_layers(self, layers: tuple[int, ...]) -> None:
        self.local.aux_layers = layers

    @property
    def aux_hidden(self) -> torch.Tensor | None:
        return self.local.aux_hidden

    def whole_embedding(self) -> VocabParallelEmbedding:
        """The target's token embedding, whole on the driver: every rank's vocabulary rows gathered once."""
        return self._mirrored(lambda: self.channel.send(Op.GATHER_EMBEDDING, self.model_id),
                              lambda: self.model.embed.whole())

    def to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.local.to_device(tensors)

    def execute(self, batch: ForwardBatch, hidden_states: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[R, vocab]`` (and the final hidden states when asked) on the driver, after every rank ran."""
        return self._mirrored(lambda: self.channel.send_batch(Op.EXECUTE, self.model_id, batch),
                              lambda: self.local.execute(batch, hidden_states))

    def copy_kv_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        self._mirrored(lambda: self.channel.send(Op.COPY_KV, self.model_id, [src_slots.cpu(), dst_slots.cpu()]),
                       lambda: self.local.copy_kv_slots(src_slots, dst_slots))

    def _mirrored(self, send: Callable[[], None], run: Callable[[], object]):
        health = self.health
        try:
            health.check(0.0)
            send()
            return run()
        except TensorParallelError:
            raise
        except BaseException as error:
            if isinstance(error, Exception):
                try:  # a worker that died makes a collective fail a moment before its exit can be seen
                    health.check(2.0)
                except TensorParallelError as died:
                    raise died from error
            health.broken = (f"a tensor-parallel command failed part-way and the ranks are out of step: "
                             f"{type(error).__name__}: {error}")
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: the caller's, raised as they are
                raise
            raise TensorParallelError(health.broken) from error
