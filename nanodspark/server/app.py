"""An OpenAI-compatible HTTP server around one `LLMEngine` (walkthrough chapter 08).

The idea
--------
`LLMEngine` is not thread-safe, and one `step()` can take a while, so it must never run on the
asyncio event loop that serves HTTP. The server therefore has two sides that talk only through
queues, and three files:

* `engine_loop.py`: **the engine thread** (`EngineLoop`) owns the engine. Commands come in
  through an inbox; each request's outputs go out to its own asyncio queue (its `Handle`).
* `openai_api.py`: **the OpenAI shapes**: validation of request bodies into `SamplingParams`,
  chat messages, response chunks, server-sent events and errors (`APIError`). No thread, no app.
* this file: **the handlers** (FastAPI, on the event loop) read the JSON, tokenize in a worker
  thread, put an `add` command in the inbox and `await` their queue: first an acceptance (or the
  engine's refusal, which becomes a 400/429), then outputs. A streaming handler turns each output
  into a server-sent event; a plain one collects them into one JSON answer. Nothing on the event
  loop blocks: the only lock it takes is the inbox's, held for an append. `create_app` wires the
  routes, the error handlers and the metrics middleware; `HTTPServer` runs the app with uvicorn.

Abort. A client that goes away mid-stream cancels the response task; `_Stream.__call__` catches
that in a `finally` and sends `abort` to the engine thread, which frees the request's KV blocks.
A non-streaming handler polls `request.is_disconnected()` while it waits. Shutdown (uvicorn's
SIGINT/SIGTERM handling through `HTTPServer`) first aborts every request, so open streams end at
once; then the app's lifespan exit stops the engine thread and joins it.

Invariants
----------
* Handlers use nothing of the engine but immutable facts read before the engine thread starts
  (the tokenizer, the context and KV limits); after that only the engine thread calls it.
* `inflight` (requests between acceptance and their handler's end) is changed only on the event
  loop, exactly once up and once down per accepted request; beyond `max_queue` new requests get
  429 before they reach the engine.
* Every error, ours or FastAPI's, is answered in the OpenAI shape (`APIError`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import SamplingParams
from .engine_loop import EngineLoop, Handle
from .metrics import Metrics
from .openai_api import APIError, bad_request, get_field, message_text, parse_sampling, sse_event, usage_of

__all__ = ["HTTPServer", "OpenAIServer", "create_app"]

log = logging.getLogger("nanodspark.server")


# ----------------------------------------------------------------------------- responses
class _Stream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, disconnect, cancel)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _CountRequests:
    """ASGI middleware: count every answered HTTP request by endpoint and status code."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.count_request(scope["path"], status)


# ----------------------------------------------------------------------------- the server
class OpenAIServer:
    """Routes and request flow; `create_app` wires it into FastAPI."""

    DISCONNECT_POLL_S = 0.5   # how often a non-streaming handler checks for a gone client

    def __init__(self, engine, model_name: str, max_queue: int = 0):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        # The longest prompt + output the KV cache can ever hold (add_request refuses more);
        # it bounds the default max_tokens of chat. Read once, before the engine thread starts.
        kv_tokens = min(bm.num_blocks for bm in engine.scheduler.managers.values()) * engine.config.block_size
        self.max_request_tokens = min(self.max_model_len, kv_tokens - engine.decode_rows)
        self.max_queue = max_queue or engine.config.max_num_seqs + engine.config.max_waiting
        self.metrics = Metrics()
        self.loop = EngineLoop(engine, self.metrics)
        self.inflight = 0
        self.closing = False
        self.created = int(time.time())

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort running ones, so open streams end now (finish_reason
        "abort", then `[DONE]`) instead of holding the shutdown until they complete."""
        self.closing = True
        self.loop.abort_all()

    # -- request flow --------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        model = get_field(body, "model", "str")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return body

    async def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer.json: send the prompt as a list of token ids", "prompt")
        return await asyncio.to_thread(self.tokenizer.encode, text)

    async def _submit(self, prompt_ids: list[int], params: SamplingParams, prefix: str) -> Handle:
        if self.closing or not self.loop.alive:
            raise APIError(503, "the server is shutting down" if self.closing else "the engine is not running",
                           "server_error")
        if self.inflight >= self.max_queue:
            raise APIError(429, f"server busy: {self.inflight} requests in flight (max {self.max_queue})",
                           "rate_limit_error")
        h = Handle(f"{prefix}-{uuid.uuid4().hex}", asyncio.get_running_loop())
        self.inflight += 1
        try:
            self.loop.submit(h, prompt_ids, params)
            first = await h.queue.get()
        except BaseException:
            self._close(h)
            raise
        if isinstance(first, APIError):
            h.finished = True
            self._close(h)
            raise first
        return h

    def _close(self, h: Handle) -> None:
        """The handler is done with `h`: abort it if it did not finish, and stop counting it."""
        if h.closed:
            return
        h.closed = True
        self.inflight -= 1
        if not h.finished:
            self.loop.abort(h.request_id)

    async def _collect(self, request: Request, h: Handle) -> tuple[str, object]:
        """Wait for the whole answer: (text, final output). Aborts if the client goes away."""
        parts = []
        next_check = time.monotonic() + self.DISCONNECT_POLL_S
        try:
            while True:
                try:
                    item = await asyncio.wait_for(h.queue.get(), self.DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    item = None
                if time.monotonic() >= next_check:  # outputs may flow without pause: check on a clock
                    next_check = time.monotonic() + self.DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected", "client_closed")
                if item is None:
                    continue
                if isinstance(item, APIError):
                    h.finished = True
                    raise item
                parts.append(item.text_delta)
                if item.finished:
                    h.finished = True
                    return "".join(parts), item
        finally:
            self._close(h)

    async def _events(self, h: Handle, chunk, include_usage: bool, first_chunk=None):
        """Server-sent events: OpenAI chunks, an optional usage chunk, then `[DONE]`."""
        if first_chunk is not None:
            yield sse_event(first_chunk)
        while True:
            item = await h.queue.get()
            if isinstance(item, APIError):
                h.finished = True
                yield sse_event(item.body())
                break
            if item.finished:
                h.finished = True
            yield sse_event(chunk(item.text_delta, item.finish_reason if item.finished else None))
            if item.finished:
                if include_usage:
                    yield sse_event({**chunk("", None), "choices": [], "usage": usage_of(item)})
                break
        yield "data: [DONE]\n\n"

    @staticmethod
    def _stream_options(body: dict) -> bool:
        opts = get_field(body, "stream_options", "dict", {})
        return bool(get_field(opts, "include_usage", "bool", False))

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, request: Request):
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await self._encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        params = parse_sampling(body, max_tokens_default=16)
        stream = get_field(body, "stream", "bool", False)
        include_usage = self._stream_options(body)
        h = await self._submit(ids, params, "cmpl")
        base = {"id": h.request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}

        def chunk(text, finish_reason):
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

        if stream:
            return _Stream(self._events(h, chunk, include_usage), lambda: self._close(h))
        text, out = await self._collect(request, h)
        return {**chunk(text, out.finish_reason), "usage": usage_of(out)}

    async def chat_completions(self, request: Request):
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
        messages = [message_text(m, i) for i, m in enumerate(messages)]
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer.json, so chat is unavailable; use /v1/completions "
                       "with token ids", "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        ids = await self._encode(text)
        params = parse_sampling(body, max_tokens_default=max(1, self.max_request_tokens - len(ids)))
        stream = get_field(body, "stream", "bool", False)
        include_usage = self._stream_options(body)
        h = await self._submit(ids, params, "chatcmpl")
        base = {"id": h.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        def chunk(text, finish_reason, delta=None):
            return {**base, "choices": [{"index": 0, "delta": delta if delta is not None else (
                {"content": text} if text or finish_reason is None else {}),
                "logprobs": None, "finish_reason": finish_reason}]}

        if stream:
            first = chunk("", None, {"role": "assistant", "content": ""})
            return _Stream(self._events(h, chunk, include_usage, first), lambda: self._close(h))
        text, out = await self._collect(request, h)
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": out.finish_reason}],
                "usage": usage_of(out)}

    def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "nanodspark", "max_model_len": self.max_model_len}]}

    def health(self):
        if self.loop.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "engine not running"}, status_code=503)

    def render_metrics(self):
        data, ctype = self.metrics.render()
        return Response(data, media_type=ctype)


class HTTPServer(uvicorn.Server):
    """uvicorn's server for an app from `create_app`: on shutdown (SIGINT, SIGTERM or
    `should_exit`) it first aborts every request, then lets uvicorn close the connections and run
    the lifespan exit, which joins the engine thread. `on_ready()` runs once the socket is bound."""

    def __init__(self, app: FastAPI, on_ready=None, **config):
        super().__init__(uvicorn.Config(app, **config))
        self.openai_server: OpenAIServer = app.state.server
        self.on_ready = on_ready
        self.openai_server.loop.on_fatal = self._engine_died

    def _engine_died(self, error: BaseException) -> None:
        log.error("the engine stopped (%s); shutting the server down", error)
        self.should_exit = True

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()

    async def shutdown(self, sockets=None):
        self.openai_server.begin_shutdown()
        await super().shutdown(sockets)


def create_app(engine, model_name: str = "nanodspark", max_queue: int = 0) -> FastAPI:
    """A FastAPI app serving `engine`; its lifespan starts and stops the engine thread."""
    server = OpenAIServer(engine, model_name, max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="nanodspark", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_CountRequests, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {exc}", "server_error").response()

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.render_metrics, methods=["GET"])
    return app
