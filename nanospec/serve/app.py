"""The OpenAI-compatible HTTP server (FastAPI), one request top to bottom:

    POST /v1/chat/completions (or /v1/completions)
      1. the API key, when the server has one (401)
      2. read the body, at most ``max_request_bytes`` (413), and check it (protocol.py; 400 naming the field)
      3. the model must be the served one (404)
      4. check the messages (nanospec.chat_messages, as LLM.chat does), render the chat template and tokenize; the
         fields the request leaves out come from the model's default sampling (--generation-config); max_tokens
         defaults to the model's, else 16 for completions, what the context (or a smaller KV pool) leaves for chat;
         prompt + max_tokens within the context and the KV pool, SamplingParams valid (400), all before any work
      5. room in the queue for every completion (503), then n completions per prompt go to the engine loop
         (engine_loop.py); their outputs arrive, as they are made, on this HTTP request's own asyncio queue
      6. stream: a server-sent event per output (new text, new log-probs), the usage when asked for, then
         ``data: [DONE]``; or wait for every completion and answer once
      7. the client goes away (mid-stream, or while waiting): every unfinished completion is aborted and its KV
         blocks return to the pool between two engine steps

Also ``/v1/models``, ``/tokenize``, ``/detokenize`` (behind the key, like ``/v1``), ``/health`` and ``/metrics``
(Prometheus, metrics.py; open, as vLLM's are). Every answer that is not a success, an unknown route (404) or method
(405) too, is an OpenAI-style error object.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanospec.chat_messages import check_messages
from nanospec.llm import LLM
from nanospec.outputs import CompletionOutput
from nanospec.sampling_params import SamplingParams
from nanospec.serve.engine_loop import EngineLoop, QueueFull, ServedEngine, ServedRequest
from nanospec.serve.metrics import ServerMetrics
from nanospec.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                                     TokenizeRequest)
from nanospec.serve.responses import Formatter, error_body, sse, usage


class APIError(Exception):
    """Answered as an OpenAI-style error object with this HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 499: "invalid_request_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.TYPES.get(self.status, "invalid_request_error"),
                          self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def build_app(llm: LLM, *, model_name: str, api_key: str | None = None, max_queue_len: int = 256,
              max_request_bytes: int = 1 << 20, default_sampling: dict | None = None) -> FastAPI:
    """A FastAPI app serving ``llm.engine`` (through :class:`~nanospec.serve.engine_loop.ServedEngine`); its lifespan
    starts and stops the engine loop (``app.state.engine_loop``).
    ``default_sampling``: SamplingParams fields for what a request leaves out (the model's, see
    :func:`nanospec.model.generation_config.default_sampling`); None: the API's own defaults."""
    server = Server(llm.engine, model_name, api_key, max_queue_len, max_request_bytes, default_sampling or {})

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine_loop.start()
        yield
        server.engine_loop.stop()

    app = FastAPI(title="nanospec", lifespan=lifespan)
    app.state.engine_loop = server.engine_loop

    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Starlette's own answers (no such route: 404; a route without that method: 405) as error objects."""
        detail = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        response = APIError(error.status_code, detail.get(error.status_code, str(error.detail))).response()
        response.headers.update(error.headers or {})
        return response

    async def server_error(request: Request, error: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(error).__name__}: {error}").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    return app


class Server:
    def __init__(self, engine: ServedEngine, model_name: str, api_key: str | None, max_queue_len: int,
                 max_request_bytes: int, default_sampling: dict):
        self.engine = engine
        self.defaults = default_sampling
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_model_len = engine.max_model_len
        self.prometheus = ServerMetrics(model_name, engine.load().max_guess_depth)
        self.engine_loop = EngineLoop(engine, self.prometheus, max_queue_len)
        self.created = int(time.time())

    # ---------------------------------------------------------------- the completion endpoints
    async def completions(self, request: Request):
        body = await self._parse(request, CompletionRequest)
        echo_only = body.max_tokens == 0  # (OpenAI's and vLLM's: the prompt scored; one token is made, not shown)
        if echo_only and not body.echo:
            raise APIError(400, "max_tokens: 0 makes nothing, which only echo asks for (the prompt and, with logprobs, "
                                "its log-probabilities): give max_tokens >= 1, or echo: true", "max_tokens")
        if echo_only:
            body = body.model_copy(update={"max_tokens": 1})
        given = body.prompts()
        prompts = [self._encode(p, body.add_special_tokens) for p in given]
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", "prompt")
        params = self._params(body, prompts, "prompt", 16, body.logprobs)  # 16: OpenAI's default max_tokens
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else self._prompt_text(p) for p in given]
            params = [replace(p, prompt_logprobs=body.logprobs) for p in params]
        fmt = Formatter(self.tokenizer, self.model_name, chat=False, token_ids=body.return_token_ids, echo=echo,
                        n=body.n, echo_only=echo_only)
        return await self._generate(request, body, fmt, prompts, params)

    async def chat_completions(self, request: Request):
        body = await self._parse(request, ChatCompletionRequest)
        messages = self._messages(body.messages)
        try:
            logprobs = body.num_logprobs()
        except ValueError as e:
            raise APIError(400, str(e), "top_logprobs") from None
        prompt = self._encode(self._render(messages, body), body.add_special_tokens)
        params = self._params(body, [prompt], "messages", None, logprobs)
        fmt = Formatter(self.tokenizer, self.model_name, chat=True, token_ids=body.return_token_ids)
        return await self._generate(request, body, fmt, [prompt], params)

    def _params(self, body: SamplingFields, prompts: list[list[int]], prompt_field: str, default_max_tokens: int | None,
                logprobs: int | None) -> list[SamplingParams]:
        """Each prompt's SamplingParams, the prompt checked against the context and the KV pool: 400s. max_tokens:
        the request's, else the model's default, else ``default_max_tokens`` (None: what the context leaves), each
        default cut to what the context leaves after that prompt (or the KV pool, where it holds less:
        ``max_request_len``); a prompt that leaves no room is the prompt's fault (``param`` is ``prompt_field``), one
        that leaves too little for the max_tokens the request asked for is the field it gave (chat:
        max_completion_tokens, where given); the same for the KV pool."""
        asked_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        asked = getattr(body, asked_field)
        every = []
        for i, ids in enumerate(prompts):
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            room = self.engine.max_request_len - len(ids)
            max_tokens = asked or max(min(self.defaults.get("max_tokens") or default_max_tokens or room, room), 1)
            try:
                params = body.sampling_params(max_tokens, logprobs, self.defaults)
            except ValueError as e:
                raise APIError(400, str(e), _field_named(e, body)) from None
            if len(ids) >= self.max_model_len:
                raise APIError(400, f"{where}{prompt_field}: {len(ids)} tokens, but this model's context is "
                                    f"{self.max_model_len} tokens (the prompt and at least one generated token); "
                                    f"shorten the {'prompt' if prompt_field == 'prompt' else 'conversation'}",
                               prompt_field)
            if len(ids) + max_tokens > self.max_model_len:
                raise APIError(400, f"{where}this model's context is {self.max_model_len} tokens, but "
                                    f"{len(ids) + max_tokens} were asked for ({len(ids)} in the prompt, "
                                    f"{max_tokens} for the completion); shorten the prompt or lower {asked_field}",
                               asked_field if asked else prompt_field)
            try:
                self.engine.validate_prompt(ids, params.for_choice(0))
            except ValueError as e:  # a token id outside the vocabulary, a KV pool too small, a bad stop token id
                field = _field_named(e, body)
                if field is not None:
                    raise APIError(400, f"{where}{e}", field) from None
                try:  # the prompt's fault, unless it passes with one token to generate (a KV pool too small for more)
                    self.engine.validate_prompt(ids, replace(params.for_choice(0), max_tokens=1, min_tokens=0))
                    field = asked_field
                except ValueError:
                    field = prompt_field
                raise APIError(400, f"{where}{field}: {e}", field) from None
            every.append(params)
        return every

    @staticmethod
    def _messages(messages) -> list[dict]:
        try:
            return check_messages(messages)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None

    def _render(self, messages: list[dict], body: ChatCompletionRequest | None = None) -> str:
        """The conversation through the chat template; a chat request may continue its last message instead of
        opening the assistant's turn (vLLM's fields)."""
        opened, continued = (body.add_generation_prompt, body.continue_final_message) if body else (True, False)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=opened,
                                                      continue_final_message=continued)
        except ValueError as e:  # a tokenizer without a chat template, or a message the template does not keep
            raise APIError(400, str(e), "continue_final_message" if str(e).startswith("continue_final_message")
                           else "messages") from None

    async def _generate(self, request: Request, body: SamplingFields, fmt: Formatter, prompts: list[list[int]],
                        params: list[SamplingParams]):
        """Queue n completions per prompt (choice ``i * n + c``: prompt i with ``params[i]``, completion c), then
        answer."""
        outputs: asyncio.Queue = asyncio.Queue()
        n = body.n
        count = len(prompts) * n
        if count > self.engine_loop.capacity:  # (n asked for them, or a list of prompts)
            field = "n" if n > 1 else "prompt"
            raise APIError(400, f"{field}: {count} completions ({len(prompts)} prompts x n={n}) are more than "
                                f"this server ever holds at once ({self.engine_loop.capacity})", field)
        try:
            self.engine_loop.check_room(count)
            served = [self.engine_loop.submit(ids, prompt_params.for_choice(c), i * n + c, outputs)
                      for i, (ids, prompt_params) in enumerate(zip(prompts, params)) for c in range(n)]
        except QueueFull as e:
            raise APIError(503, str(e)) from None
        except RuntimeError as e:
            raise APIError(500, str(e)) from None
        prompt_tokens = sum(len(ids) for ids in prompts)
        if body.stream:
            return StreamingResponse(self._stream(served, outputs, fmt, prompt_tokens, body.stream_usage),
                                     media_type="text/event-stream")
        finals = await self._wait_for_all(request, served, outputs)
        if finals is None:  # the client is gone; nobody reads this
            raise APIError(499, "the client closed the connection before the answer was ready")
        if any(o.finish_reason == "abort" for o in finals):  # (the server's own abort: it is shutting down)
            raise APIError(503, "the server is shutting down; this request was stopped")
        failed = next((o for o in finals if o.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"generation failed: {failed.error}")
        return fmt.response(finals, prompt_tokens)

    async def _stream(self, served: list[ServedRequest], outputs: asyncio.Queue, fmt: Formatter, prompt_tokens: int,
                      stream_usage: str | None):
        """Server-sent events as the outputs arrive; the ``finally`` runs when the client disconnects too (Starlette
        cancels the response), and aborts what is unfinished."""
        sent_tokens = [0] * len(served)  # tokens (and their log-probs) already streamed, per choice
        text_offsets = [0] * len(served)  # (completions' logprobs: where the next token's text starts, as unstreamed)
        echoed = [False] * len(served)  # (completions with echo: the prompt goes out with a choice's first chunk)
        try:
            if fmt.chat:
                for s in served:
                    yield sse(fmt.chunk([fmt.role_choice(s.index)], stream_usage, usage(len(s.prompt_token_ids), 0)))
            async for index, out in self._outputs(served, outputs):
                out = fmt.shown(out)
                if out.finish_reason == "error":
                    yield sse(error_body(500, f"generation failed: {out.error}", "server_error"))
                    continue  # (an abort, the server shutting down, ends the choice with a chunk like any finish)
                new_logprobs = out.logprobs[sent_tokens[index]:] if out.logprobs is not None else None
                if not (out.delta_text or out.finished or new_logprobs or fmt.token_ids):
                    continue  # text held back (a possible stop string, half a character)
                echo = fmt.echo_of(out, index) if not echoed[index] else None
                choice = fmt.delta_choice(index, out.delta_text, out.token_ids[sent_tokens[index]:], new_logprobs,
                                          text_offsets[index], out.finish_reason, out.stop_reason, echo)
                yield sse(fmt.chunk([choice], stream_usage, usage(len(out.prompt_token_ids), len(out.token_ids))))
                echoed[index] = True
                sent_tokens[index] = len(out.token_ids)
                if not fmt.chat and choice["logprobs"] and choice["logprobs"]["tokens"]:
                    text_offsets[index] = choice["logprobs"]["text_offset"][-1] + len(choice["logprobs"]["tokens"][-1])
            if stream_usage is not None:
                yield sse(fmt.chunk([], stream_usage, usage(prompt_tokens, sum(sent_tokens)), last=True))
        except RuntimeError as e:  # the engine stopped
            yield sse(error_body(500, str(e), "server_error"))
        finally:
            self._abort_unfinished(served)
        yield sse("[DONE]")

    async def _outputs(self, served: list[ServedRequest], outputs: asyncio.Queue):
        """``(choice index, CompletionOutput)`` as they come, until every choice has finished."""
        remaining = len(served)
        while remaining:
            item = await outputs.get()
            if isinstance(item, Exception):
                raise RuntimeError(f"the engine failed: {item}")
            remaining -= item[1].finished
            yield item

    async def _wait_for_all(self, request: Request, served: list[ServedRequest],
                            outputs: asyncio.Queue) -> list[CompletionOutput] | None:
        """Every choice's last output, in choice order; None if the client disconnected first (then aborted)."""
        finals: dict[int, CompletionOutput] = {}

        async def collect():
            async for index, out in self._outputs(served, outputs):
                if out.finished:
                    finals[index] = out

        collecting, disconnect = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not collecting.done():
                collecting.cancel()
            self._abort_unfinished(served)
        if not collecting.done() or collecting.cancelled():
            return None
        try:
            collecting.result()
        except RuntimeError as e:
            raise APIError(500, str(e)) from None
        return [finals[i] for i in range(len(served))]

    def _abort_unfinished(self, served: list[ServedRequest]) -> None:
        for s in served:
            self.engine_loop.abort(s)

    # ---------------------------------------------------------------- the other endpoints
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "nanospec", "root": self.model_name,
                                            "max_model_len": self.max_model_len}]}

    async def tokenize(self, request: Request):
        body = await self._parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            text = self._render(self._messages(body.messages))
        else:
            text = body.prompt
        add_special_tokens = body.messages is None if body.add_special_tokens is None else body.add_special_tokens
        tokens = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    async def detokenize(self, request: Request):
        body = await self._parse(request, DetokenizeRequest)
        vocab = self.engine.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is out of the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self._prompt_text(body.tokens)}

    async def health(self):
        if not self.engine_loop.alive:
            raise APIError(503, f"the engine is not running: {self.engine_loop.error or 'stopped'}")
        return Response(status_code=200)

    async def metrics(self):
        return Response(self.prometheus.render(), media_type=CONTENT_TYPE_LATEST)

    # ---------------------------------------------------------------- checks shared by the endpoints
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'")

    async def _parse(self, request: Request, model: type[BaseModel]):
        """Authorize, read at most ``max_request_bytes`` of body, validate it, check the model name."""
        self._authorize(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise APIError(413, f"the request body is {declared} bytes; this server takes at most "
                                f"{self.max_request_bytes}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_request_bytes:
                    raise APIError(413, f"the request body is over {self.max_request_bytes} bytes, this server's limit")
                chunks.append(chunk)
        except ClientDisconnect:  # (an answer nobody reads, and no server error)
            raise APIError(499, "the client closed the connection before the whole body came") from None
        raw = b"".join(chunks)
        try:
            body = model.model_validate_json(raw)
        except ValidationError as e:
            raise _validation_error(e, raw) from None
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                           "model")
        return body

    def _encode(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """Text to token ids, with the tokenizer's special tokens (BOS where it adds one) or without: by default a raw
        prompt with, a rendered chat without, as vLLM encodes them. Token ids are kept as given (and checked against
        the vocabulary with the rest of the prompt)."""
        if not prompt:
            raise APIError(400, "prompt: the prompt is empty: give some text or token ids", "prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def _prompt_text(self, token_ids: list[int]) -> str:
        """A prompt's token ids as text, special tokens (BOS, a chat's markup) included, as vLLM decodes them: what
        /tokenize read back, and the echo that a token-id prompt's log-probabilities line up with."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


def _field_named(error: ValueError, body: BaseModel) -> str | None:
    """The request field an error message starts with ("min_tokens must be ..."), if any."""
    first = str(error).split(maxsplit=1)[0].rstrip(":") if str(error) else ""
    return first if first in type(body).model_fields else None


# a \uXXXX escape (its backslash not itself escaped) of half a UTF-16 surrogate pair without its other half
_LONE_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<![89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2})")


def _validation_error(error: ValidationError, raw: bytes) -> APIError:
    """pydantic's errors as one 400: each with its field path, what was wrong and (briefly) what was given."""
    parts, param = [], None
    for e in error.errors()[:3]:
        if e["type"] == "json_invalid":
            lone = _LONE_SURROGATE.search(raw)
            if lone is not None:
                return APIError(400, f"the body holds {lone.group(1).decode()}, half of a UTF-16 surrogate pair "
                                     f"without its other half: that is not a character, and text must be characters "
                                     f"(send the character itself, or a high \\ud800-\\udbff escape followed by a "
                                     f"low \\udc00-\\udfff one)")
            return APIError(400, f"the body is not valid JSON: {e['msg']}")
        where = ".".join(str(x) for x in e["loc"]) or "body"
        given = repr(e.get("input"))
        parts.append(f"{where}: {e['msg']} (got {given[:60] + '...' if len(given) > 60 else given})")
        if param is None and e["loc"]:
            param = str(e["loc"][0])
    return APIError(400, "; ".join(parts), param)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
