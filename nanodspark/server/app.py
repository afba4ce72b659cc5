"""An OpenAI-compatible HTTP server around one engine (walkthrough chapter 08).

The idea
--------
`LLMEngine` is not thread-safe, and one `step()` can take a while, so it never runs on the
asyncio event loop that serves HTTP. The engine side (`EngineLoop`, engine_loop.py) owns the
engine and speaks token ids only, in the engine-core process (`CoreClient`, core.py: `serve.py`'s
default) or in a thread of this process (`create_app(engine)`: the tests, `--single-process`).
This side does the rest. The handlers (FastAPI, on the event loop) read the body (at most
`max_body_bytes`, else 413), hand it to a small pool of worker threads that parses, checks and
tokenizes it (`_prepare_completion`, `_prepare_chat`; the OpenAI shapes are openai_api.py's),
`submit` it and `await` its `Handle`'s queue, which `OutputProcessor` (outputs.py) fills with an
acceptance (or a 400/429 refusal), then text, then the finish. A streaming handler turns each
output into a server-sent event; a plain one collects them into one JSON answer. `create_app`
wires the routes (with `/version`, `/tokenize`, `/detokenize`), the API key, the error handlers
and the metrics middleware; `HTTPServer` runs the app with uvicorn.

Limits (chapter 08 lists them), each checked before the work it protects: the body's size (413;
the bodies held at once are bounded too, else 429); the JSON's depth and text (400,
`parse_json_body`); a text prompt longer in characters than the context can hold in tokens (400,
not tokenized); prompt + `max_tokens` over the context (400 with the arithmetic). Tokenizing
runs in the pool with the interpreter lock released (`Tokenizer.encode_releasing_gil`).

Abort: a client that goes away mid-stream ends its events (`_Stream` watches for the
disconnect), and `_Stream.__call__` sends `abort` in a `finally`; a non-streaming handler polls
`request.is_disconnected()`. Shutdown (`HTTPServer`) first aborts every request, then the
lifespan exit stops the engine side. With an API key every `/v1` route wants `Authorization:
Bearer KEY` (else 401); `/health`, `/metrics`, `/version`, `/tokenize` and `/detokenize` stay
open, as vLLM's do.

Invariants
----------
* Handlers use nothing of the engine but `EngineInfo`, read before the engine side starts; the
  tokenizer is this process's own. Worker threads never touch the engine side or a `Handle`.
* `inflight` (requests between acceptance and their handler's end) changes only on the event
  loop, once up and once down per accepted request; beyond `max_queue`, 429 before the engine.
* Every error, ours or FastAPI's, is answered in the OpenAI shape (`APIError`); a malformed
  request never reaches the generic 500 handler, so its keep-alive connection stays open.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..request import RequestOutput
from ..sampling import SamplingParams
from .core import CoreLink
from .engine_loop import EngineInfo, EngineLoop
from .metrics import Metrics
from .openai_api import (APIError, bad_request, check_context, check_fields, get_field, message_text,
                         parse_json_body, parse_sampling, requested_max_tokens, sse_event, usage_of)
from .outputs import Handle, OutputProcessor

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_PREPARE_INLINE_BYTES", "DEFAULT_PREPARE_THREADS", "HTTPServer",
           "OpenAIServer", "create_app"]

log = logging.getLogger("nanodspark.server")

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024   # a 4,096-token prompt is ~20 kB of text or ids; 2 MiB leaves room
DEFAULT_PREPARE_THREADS = 2                # worker threads that parse, validate and tokenize request bodies
# Bodies up to this size are prepared on the event loop: their work (a 256-token prompt: ~0.1 ms)
# costs less than a hop to a worker thread and back, which must win the interpreter lock from a
# busy event loop each way (at load, inline preparation served 1.3-1.7x the tok/s of the threads).
DEFAULT_PREPARE_INLINE_BYTES = 8 * 1024
BODY_BUDGET_FACTOR = 16                    # bodies held at once: at most this many max-size bodies' bytes


@dataclass
class _Prepared:
    """A request body turned into what the engine takes (the worker threads' result)."""
    ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    limit_param: str = "max_tokens"   # the field that set the output limit (named by a KV refusal)


# ----------------------------------------------------------------------------- responses
GONE = object()   # put on a streaming handle's queue when its client disconnects


class _Stream(Response):
    """Server-sent events as a lean ASGI response. Starlette's `StreamingResponse` builds an
    anyio task group per response to notice a client that leaves; at hundreds of streams that
    is a fair share of the event loop. Here one plain task waits for the disconnect and calls
    `on_disconnect` (which ends the events), and `on_close` runs however the response ends."""

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, content, on_close, on_disconnect):     # (a Response, so FastAPI passes it through)
        self.content, self.on_close, self.on_disconnect = content, on_close, on_disconnect
        self.status_code, self.background, self.raw_headers = 200, None, list(self.HEADERS)

    async def __call__(self, scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.on_disconnect()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.content:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.on_close()


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

    def __init__(self, engine, model_name: str, max_queue: int = 0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, prepare_threads: int = DEFAULT_PREPARE_THREADS,
                 api_key: str | None = None, prepare_inline_bytes: int = DEFAULT_PREPARE_INLINE_BYTES):
        if max_body_bytes < 1 or prepare_threads < 1:
            raise ValueError("max_body_bytes and prepare_threads must be positive")
        if prepare_inline_bytes < 0:
            raise ValueError("prepare_inline_bytes must be 0 or more")
        self.prepare_inline_bytes = prepare_inline_bytes
        if isinstance(engine, CoreLink):     # the engine in its own process (serve.py)
            self.engine, self.loop = None, engine
            self.info, self.tokenizer = engine.info, engine.tokenizer
        else:                                # an LLMEngine, driven by a thread of this process
            self.engine, self.loop = engine, EngineLoop(engine)
            self.info, self.tokenizer = EngineInfo.of(engine), engine.tokenizer
        info = self.info
        self.model_name = model_name
        self.api_key = api_key
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        # The longest prompt + output the KV cache can ever hold (add_request refuses more);
        # it bounds the default max_tokens of chat.
        self.max_request_tokens = info.max_request_tokens
        self.max_queue = max_queue or info.max_num_seqs + info.max_waiting
        # Input limits: a text with more characters than this has more tokens than the context
        # (None: the tokenizer gives no bound on the characters of one token).
        longest = getattr(self.tokenizer, "longest_token_chars", None)
        self.longest_token_chars = longest
        self.max_prompt_chars = self.max_model_len * longest if longest else None
        self.max_body_bytes = max_body_bytes
        self.body_budget = BODY_BUDGET_FACTOR * max_body_bytes
        self.held_body_bytes = 0       # bytes of bodies being read or waiting for a worker (event loop only)
        self._encode = None
        if self.tokenizer is not None:
            self._encode = getattr(self.tokenizer, "encode_releasing_gil", None) or self.tokenizer.encode
        self.pool = ThreadPoolExecutor(prepare_threads, thread_name_prefix="nanodspark-prepare")
        self.metrics = Metrics()
        self.metrics.track_inflight(lambda: self.inflight)
        self.outputs = OutputProcessor(self.tokenizer, self.metrics, self.loop.abort)
        self.inflight = 0
        self.closing = False
        self.created = int(time.time())

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort running ones, so open streams end now (finish_reason
        "abort", then `[DONE]`) instead of holding the shutdown until they complete."""
        self.closing = True
        self.loop.abort_all()

    # -- request flow: the event loop ------------------------------------------------------------
    def _refuse_if_closed(self) -> None:
        if self.closing or not self.loop.alive:
            raise APIError(503, "the server is shutting down" if self.closing else "the engine is not running",
                           "server_error")

    def _too_large(self, size: int | None) -> APIError:
        what = f"has {size} bytes" if size is not None else f"is over {self.max_body_bytes} bytes"
        return APIError(413, f"the request body {what}; this server accepts at most {self.max_body_bytes} bytes "
                             "(serve.py --max-body-bytes)", code="request_too_large")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed `max_body_bytes`: from its
        Content-Length before a byte is read, else while it streams in. uvicorn reads and drops
        whatever the client still sends, so the connection stays usable."""
        self._refuse_if_closed()
        if self.inflight >= self.max_queue:   # full: refuse before reading anything
            raise APIError(429, f"server busy: {self.inflight} requests in flight (max {self.max_queue})",
                           "rate_limit_error")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared))
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                self.held_body_bytes += len(chunk)
                chunks.append(chunk)
                if size > self.max_body_bytes:
                    raise self._too_large(None)
                if self.held_body_bytes > self.body_budget:
                    raise APIError(429, "server busy: too many large request bodies at once", "rate_limit_error")
        except BaseException as e:
            self.held_body_bytes -= size
            if isinstance(e, ClientDisconnect):
                raise APIError(499, "client disconnected", "client_closed") from None
            raise
        return b"".join(chunks)

    async def _prepare(self, request: Request, work) -> _Prepared:
        """Read the body, then run `work(raw)` (parse, validate, tokenize): here if the body is
        small, else in a worker thread."""
        raw = await self._read_body(request)
        try:
            if len(raw) <= self.prepare_inline_bytes:
                return work(raw)
            return await asyncio.get_running_loop().run_in_executor(self.pool, work, raw)
        except RuntimeError as e:   # the pool was shut down under us
            if self.closing or "shutdown" in str(e):
                raise APIError(503, "the server is shutting down", "server_error") from None
            raise
        finally:
            self.held_body_bytes -= len(raw)

    # -- request flow: the worker threads ---------------------------------------------------------
    def _body(self, raw: bytes, endpoint: str) -> dict:
        body = parse_json_body(raw)
        model = get_field(body, "model", "str")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        check_fields(body, endpoint)
        return body

    def _check_chars(self, n: int, param: str) -> None:
        """Refuse a text that cannot fit the context, from its length alone (before tokenizing)."""
        if self.max_prompt_chars is not None and n > self.max_prompt_chars:
            what = "the messages have" if param == "messages" else "the prompt has"
            raise bad_request(
                f"{what} {n} characters, more than can fit this model's maximum context length of "
                f"{self.max_model_len} tokens: no token of its tokenizer stands for more than "
                f"{self.longest_token_chars} characters, so at most {self.max_prompt_chars} characters fit; "
                "shorten the prompt", param, code="context_length_exceeded")

    def _tokenize(self, text: str, param: str) -> list[int]:
        if self._encode is None:
            raise bad_request("this model has no tokenizer.json: send the prompt as a list of token ids", param)
        try:
            return self._encode(text)
        except (TypeError, ValueError) as e:
            raise bad_request(f"the {param} could not be tokenized: {e}", param) from None

    def _sampling(self, body: dict, default: int) -> tuple:
        """The checks that need no tokenizer, done before tokenizing: (params, whether the client
        set the output limit itself, the name of that field, stream, include_usage)."""
        params = parse_sampling(body, max_tokens_default=default)
        given = requested_max_tokens(body)
        return (params, given is not None, given[0] if given else "max_tokens",
                get_field(body, "stream", "bool", False), self._stream_options(body))

    def _finish(self, ids: list[int], checked: tuple, prompt_param: str, room: int) -> _Prepared:
        """The checks on the token ids: not empty, and prompt + output limit within the context.
        A default output limit never overflows: it is cut to the `room` left after the prompt."""
        params, explicit, limit_param, stream, include_usage = checked
        if not ids:
            raise bad_request("the prompt is empty", prompt_param)
        if not explicit:
            params.max_tokens = max(1, min(params.max_tokens, room - len(ids)))
        check_context(len(ids), params.max_tokens, self.max_model_len, prompt_param, limit_param)
        return _Prepared(ids, params, stream, include_usage, limit_param)

    def _prepare_completion(self, raw: bytes) -> _Prepared:
        body = self._body(raw, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
            prompt = prompt[0]
        if not isinstance(prompt, (str, list)):
            raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
        checked = self._sampling(body, 16)   # completions' default max_tokens, as OpenAI's
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            ids = self._tokenize(prompt, "prompt")
        else:
            check_context(len(prompt), 1, self.max_model_len, "prompt")   # before looking at each id
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", "prompt")
            ids = prompt
        return self._finish(ids, checked, "prompt", self.max_model_len)

    def _prepare_chat(self, raw: bytes) -> _Prepared:
        body = self._body(raw, "chat")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
        messages = [message_text(m, i) for i, m in enumerate(messages)]
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer.json, so chat is unavailable; use /v1/completions "
                              "with token ids", "messages")
        # chat's default max_tokens: what is left of the context (and of the KV cache)
        checked = self._sampling(body, self.max_request_tokens)
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        ids = self._tokenize(text, "messages")
        return self._finish(ids, checked, "messages", self.max_request_tokens)

    async def _submit(self, prep: _Prepared, prefix: str, received: float | None = None) -> Handle:
        self._refuse_if_closed()
        if self.inflight >= self.max_queue:
            raise APIError(429, f"server busy: {self.inflight} requests in flight (max {self.max_queue})",
                           "rate_limit_error")
        # What the engine may still refuse after our checks (a request the KV cache can never
        # hold) is about the output limit: its 400 names that field.
        h = Handle(f"{prefix}-{uuid.uuid4().hex}", prep.params, len(prep.ids), prep.stream,
                   refusal_param=prep.limit_param, received=received)
        self.inflight += 1
        try:
            self.outputs.register(h)
            self.loop.submit(h.request_id, prep.ids, prep.params)
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
        if not (h.finished or h.ended):
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

    def _stream(self, h: Handle, events) -> _Stream:
        return _Stream(events, lambda: self._close(h), lambda: h.queue.put_nowait(GONE))

    async def _events(self, h: Handle, chunk, include_usage: bool, first_chunk=None):
        """Server-sent events: OpenAI chunks, an optional usage chunk, then `[DONE]`."""
        if first_chunk is not None:
            yield sse_event(first_chunk)
        # A text chunk is this stream's JSON around the text: made once, filled per chunk.
        head, tail = sse_event(chunk("\0", None)).split('"\\u0000"')
        held = None
        while True:
            item, held = held if held is not None else await h.queue.get(), None
            # Outputs that queued up while this stream waited for its turn go out as one chunk.
            while isinstance(item, RequestOutput) and not item.finished and not h.queue.empty():
                later = h.queue.get_nowait()
                if not isinstance(later, RequestOutput):
                    held = later
                    break
                item = dataclasses.replace(later, new_token_ids=item.new_token_ids + later.new_token_ids,
                                           text_delta=item.text_delta + later.text_delta)
            if item is GONE:        # the client left: nothing more to send (`_close` aborts it)
                return
            if isinstance(item, APIError):
                h.finished = True
                yield sse_event(item.body(), ascii=True)
                break
            if item.finished:
                h.finished = True
                yield sse_event(chunk(item.text_delta, item.finish_reason))
            else:
                yield head + json.dumps(item.text_delta, ensure_ascii=False) + tail
            if item.finished:
                if include_usage:
                    yield sse_event({**chunk("", None), "choices": [], "usage": usage_of(item)})
                break
        yield "data: [DONE]\n\n"

    @staticmethod
    def _stream_options(body: dict) -> bool:
        opts = get_field(body, "stream_options", "dict", {})
        include = opts.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
        return bool(include)

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, request: Request):
        received = time.monotonic()
        prep = await self._prepare(request, self._prepare_completion)
        h = await self._submit(prep, "cmpl", received)
        base = {"id": h.request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}

        def chunk(text, finish_reason):
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

        if prep.stream:
            return self._stream(h, self._events(h, chunk, prep.include_usage))
        text, out = await self._collect(request, h)
        return {**chunk(text, out.finish_reason), "usage": usage_of(out)}

    async def chat_completions(self, request: Request):
        received = time.monotonic()
        prep = await self._prepare(request, self._prepare_chat)
        h = await self._submit(prep, "chatcmpl", received)
        base = {"id": h.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        def chunk(text, finish_reason, delta=None):
            return {**base, "choices": [{"index": 0, "delta": delta if delta is not None else (
                {"content": text} if text or finish_reason is None else {}),
                "logprobs": None, "finish_reason": finish_reason}]}

        if prep.stream:
            first = chunk("", None, {"role": "assistant", "content": ""})
            return self._stream(h, self._events(h, chunk, prep.include_usage, first))
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

    @staticmethod
    def version():
        return {"version": package_version()}

    # -- /tokenize and /detokenize (vLLM's shapes) ---------------------------------------------
    async def tokenize(self, request: Request):
        return await self._prepare(request, self._tokenize_body)

    async def detokenize(self, request: Request):
        return await self._prepare(request, self._detokenize_body)

    def _tokenize_body(self, raw: bytes) -> dict:
        body = self._body(raw, "tokenize")
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer.json", "prompt")
        if ("prompt" in body) == ("messages" in body):
            raise bad_request("send either 'prompt' (a string) or 'messages' (a chat)", "prompt")
        special = get_field(body, "add_special_tokens", "bool")
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
            messages = [message_text(m, i) for i, m in enumerate(messages)]
            self._check_chars(sum(len(m["content"]) for m in messages), "messages")
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=get_field(body, "add_generation_prompt", "bool", True))
            param, special = "messages", bool(special)    # a chat template writes its own special tokens
        else:
            text = get_field(body, "prompt", "str")
            if text is None:
                raise bad_request("'prompt' must be a string", "prompt")
            self._check_chars(len(text), "prompt")
            param, special = "prompt", special is not False  # vLLM's default: True
        if special:
            ids = self.tokenizer.tok.encode(text, add_special_tokens=True).ids
        else:
            ids = self._tokenize(text, param)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}
        if get_field(body, "return_token_strs", "bool", False):
            out["token_strs"] = [self.tokenizer.tok.id_to_token(i) for i in ids]
        return out

    def _detokenize_body(self, raw: bytes) -> dict:
        body = self._body(raw, "detokenize")
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer.json", "tokens")
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_request("'tokens' must be a list of token ids", "tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}   # as vLLM's


def package_version() -> str:
    try:
        from importlib.metadata import version
        return version("nanodspark")
    except Exception:  # noqa: BLE001 - not installed (run from a checkout)
        return "unknown"


class HTTPServer(uvicorn.Server):
    """uvicorn's server for an app from `create_app`: on shutdown (SIGINT, SIGTERM or
    `should_exit`) it first aborts every request, then lets uvicorn close the connections and run
    the lifespan exit, which stops the engine side. `on_ready()` runs once the socket is bound;
    `on_shutdown()` (blocking, in a thread) right after the aborts: serve.py stops its other API
    processes there, before its own lifespan exit stops the engine core."""

    def __init__(self, app: FastAPI, on_ready=None, on_shutdown=None, **config):
        super().__init__(uvicorn.Config(app, **config))
        self.openai_server: OpenAIServer = app.state.server
        self.on_ready, self.on_shutdown = on_ready, on_shutdown
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
        if self.on_shutdown is not None:
            await asyncio.to_thread(self.on_shutdown)
        await super().shutdown(sockets)


class _APIKey:
    """ASGI middleware: every `/v1` route wants `Authorization: Bearer <key>`; 401 otherwise."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                err = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>' "
                                    "with the key the server was started with (serve.py --api-key)",
                               "invalid_request_error", code="invalid_api_key")
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


# FastAPI >= 0.160 asks OpenTelemetry for its providers on every request (a few percent of the event
# loop at high load); this server exports Prometheus metrics (/metrics) instead.
_NO_OTEL = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
            if "telemetry" in inspect.signature(FastAPI).parameters else {})


def create_app(engine, model_name: str = "nanodspark", max_queue: int = 0,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, prepare_threads: int = DEFAULT_PREPARE_THREADS,
               api_key: str | None = None, prepare_inline_bytes: int = DEFAULT_PREPARE_INLINE_BYTES,
               share_metrics: tuple | None = None) -> FastAPI:
    """A FastAPI app serving `engine`: an `LLMEngine` (driven by a thread of this process) or a
    ready `CoreLink` (the engine-core process). Its lifespan starts and stops the engine side
    (and the worker threads that prepare request bodies). `share_metrics=(folder, index)`: this is
    one of several API processes, whose /metrics answer for all (metrics.py)."""
    server = OpenAIServer(engine, model_name, max_queue, max_body_bytes, prepare_threads, api_key, prepare_inline_bytes)
    if share_metrics is not None:
        server.metrics.share(*share_metrics)

    async def write_shared_metrics():
        while True:
            await asyncio.sleep(server.metrics.SHARE_INTERVAL_S)
            server.metrics.write_share()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start(server.outputs.on_batch, asyncio.get_running_loop())
        sharing = asyncio.create_task(write_shared_metrics()) if server.metrics.shared else None
        try:
            yield
        finally:
            server.pool.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(server.loop.stop)
            server.outputs.close(APIError(503, "the server is shutting down", "server_error"))
            if sharing is not None:
                sharing.cancel()
                server.metrics.write_share()     # its last counts stay in the others' scrapes

    app = FastAPI(title="nanodspark", lifespan=lifespan, **_NO_OTEL)
    app.state.server = server
    if api_key:
        app.add_middleware(_APIKey, key=api_key)
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
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    return app
