"""One engine, many clients: a single thread steps the engine; the HTTP side (asyncio) never touches it.

    HTTP handler (event loop)                      engine thread (the only one that touches the engine)
    -------------------------                      ------------------------------------------------------
    submit(prompt ids, params, queue) --commands-> between two steps: add the new requests, abort the gone ones
    await queue.get()                 <-outputs--- engine.step(); each output to its request's queue
    abort(request)  (client gone)     --commands-> engine.abort(): its KV blocks return to the pool at once

Requests join and leave the running batch between steps (continuous batching across connections). The thread
sleeps on the command queue when no request is unfinished, so an idle server costs nothing. Outputs cross back
with ``loop.call_soon_threadsafe``; everything the HTTP side keeps (the in-flight count) is changed on the event
loop only, everything the engine keeps on the engine thread only.

The server reaches the engine only through :class:`ServedEngine` (``LLM.engine`` is one).

If a step raises (a bug: the engine already ends only the requests that fail alone), every waiting request gets
the error, the loop stops and ``/health`` reports it dead. When the server shuts down (``abort_all``, from its
signal handler) every request is aborted between two steps, so each client gets its last output at once, and
the loop takes no new request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from nanospec.engine import EngineLoad
from nanospec.outputs import CompletionOutput
from nanospec.sampling_params import SamplingParams
from nanospec.serve.metrics import RequestProgress, ServerMetrics
from nanospec.tokenizer import Tokenizer

log = logging.getLogger("nanospec.serve")


@runtime_checkable
class ServedEngine(Protocol):
    """Everything the server asks of the engine (:class:`nanospec.engine.Engine` is one): its tokenizer and limits;
    ``validate_prompt``, called on the HTTP side before any work (it reads nothing a step changes); and, on the engine
    thread alone, requests in (``add_request``), steps, requests out (``abort``, ``pop_finished``) and ``load()``
    for the metrics."""
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_request_len: int  # the context, or less where the KV pool holds less
    max_num_seqs: int

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int: ...
    def step(self) -> list[CompletionOutput]: ...
    def has_unfinished(self) -> bool: ...
    def abort(self, request_id: int) -> CompletionOutput | None: ...
    def pop_finished(self, request_id: int) -> None: ...
    def load(self) -> EngineLoad: ...


class QueueFull(Exception):
    """More requests in flight than the server takes (HTTP 503)."""


@dataclass(eq=False)
class ServedRequest:
    """One completion (one choice) in flight: its outputs go to ``queue`` as ``(index, CompletionOutput)``; an
    exception put there means the engine died."""
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int                  # the choice index in its HTTP response
    queue: asyncio.Queue
    progress: RequestProgress = field(default_factory=lambda: RequestProgress(time.perf_counter()))
    request_id: int | None = None   # the engine's, set by the engine thread
    finished: bool = False          # the HTTP side has seen its last output


class EngineLoop:
    def __init__(self, engine: ServedEngine, metrics: ServerMetrics, max_queue_len: int = 256):
        self.engine = engine
        self.metrics = metrics
        self.capacity = self.engine.max_num_seqs + max_queue_len  # requests in flight at most
        self.num_in_flight = 0           # event loop only
        self.error: str | None = None    # why the engine thread stopped, if it did
        self.closing = False             # the server is shutting down: no new requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- the HTTP side (event loop)
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanospec-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._commands.put(("stop", None))
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def check_room(self, count: int) -> None:
        """Raise QueueFull unless ``count`` more requests fit (none while the server shuts down)."""
        if self.closing:
            raise QueueFull("the server is shutting down")
        if self.num_in_flight + count > self.capacity:
            raise QueueFull(f"the server is full ({self.num_in_flight} requests in flight, at most {self.capacity}); "
                            f"retry later")

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, index: int,
               outputs: asyncio.Queue) -> ServedRequest:
        """Queue one completion (already validated: ``engine.validate_prompt``); its outputs go to ``outputs``."""
        if not self.alive:
            raise RuntimeError(f"the engine is not running: {self.error or 'stopped'}")
        self.check_room(1)
        request = ServedRequest(prompt_token_ids, params, index, outputs)
        self.num_in_flight += 1
        self._commands.put(("add", request))
        return request

    def abort(self, request: ServedRequest) -> None:
        """The client is gone: end the request between two steps and free its KV blocks."""
        if not request.finished:
            self._commands.put(("abort", request))

    def abort_all(self) -> None:
        """The server is shutting down: abort every request between two steps (each gets its last output, finish
        reason "abort") and take no new one. Safe from a signal handler (it only sets a flag and queues)."""
        self.closing = True
        self._commands.put(("abort_all", None))

    def _deliver(self, request: ServedRequest, item: CompletionOutput | Exception) -> None:
        if request.finished:
            return
        if isinstance(item, Exception) or item.finished:
            request.finished = True
            self.num_in_flight -= 1
        request.queue.put_nowait(item if isinstance(item, Exception) else (request.index, item))

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        requests: dict[int, ServedRequest] = {}  # engine request id -> request
        try:
            while True:
                if not self._apply_commands(requests, wait=not self.engine.has_unfinished()):
                    break
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    now = time.perf_counter()
                    self.metrics.observe_load(self.engine.load())
                    for out in outputs:
                        self._send(requests, out, now)
        except Exception as error:  # a bug: tell every waiting client and stop
            self.error = f"{type(error).__name__}: {error}"
            log.error("the engine loop stopped:\n%s", traceback.format_exc())
            for request in requests.values():
                self._loop.call_soon_threadsafe(self._deliver, request, RuntimeError(self.error))
            self._fail_queued_commands()

    def _apply_commands(self, requests: dict[int, ServedRequest], wait: bool) -> bool:
        """Apply every queued command (waiting for one first if ``wait``); False on stop."""
        while True:
            try:
                kind, request = self._commands.get(block=wait)
            except queue.Empty:
                return True
            wait = False
            if kind == "stop":
                for rid in list(requests):
                    self.engine.abort(rid)
                return False
            if kind == "add":
                try:
                    request.request_id = self.engine.add_request(request.prompt_token_ids, request.params)
                except ValueError as error:  # validated before; reported, not fatal
                    self._loop.call_soon_threadsafe(self._deliver, request, error)
                    continue
                requests[request.request_id] = request
            elif kind == "abort" and request.request_id in requests:
                self._abort(requests, request.request_id)
            elif kind == "abort_all":
                for rid in list(requests):
                    self._abort(requests, rid)

    def _abort(self, requests: dict[int, ServedRequest], request_id: int) -> None:
        final = self.engine.abort(request_id)
        if final is not None:
            self._send(requests, final, time.perf_counter())
        self.metrics.observe_load(self.engine.load())

    def _send(self, requests: dict[int, ServedRequest], out: CompletionOutput, now: float) -> None:
        request = requests.get(out.request_id)
        if request is None:
            return
        self.metrics.observe_output(request.progress, out, now)
        if out.finished:
            del requests[out.request_id]
            self.engine.pop_finished(out.request_id)
        self._loop.call_soon_threadsafe(self._deliver, request, out)

    def _fail_queued_commands(self) -> None:
        while True:
            try:
                kind, request = self._commands.get(block=False)
            except queue.Empty:
                return
            if kind == "add":
                self._loop.call_soon_threadsafe(self._deliver, request, RuntimeError(self.error))
