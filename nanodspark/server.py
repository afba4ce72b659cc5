"""An OpenAI-compatible HTTP server around one `LLMEngine` (walkthrough chapter 08).

The idea
--------
`LLMEngine` is not thread-safe, and one `step()` can take a while, so it must never run on the
asyncio event loop that serves HTTP. The server therefore has two sides that talk only through
queues:

* **The engine thread** (`EngineLoop`) owns the engine. It drains an inbox of commands
  (`add`, `abort`, `abort_all`), runs `engine.step()` while there is work, and otherwise sleeps on a
  `threading.Condition`. Every `RequestOutput` goes to the asyncio queue of its request, put there
  with `loop.call_soon_threadsafe` (the only safe way to touch asyncio objects from another
  thread). A finished request is `release`d at once, so the engine forgets it.
* **The handlers** (FastAPI, on the event loop) validate the JSON, tokenize in a worker thread,
  put an `add` command in the inbox and `await` their queue: first an acceptance (or the engine's
  refusal, which becomes a 400/429), then outputs. A streaming handler turns each output into a
  server-sent event; a plain one collects them into one JSON answer. Nothing on the event loop
  blocks: the only lock it takes is the inbox's, held for an append.

Abort. A client that goes away mid-stream cancels the response task; `_Stream.__call__` catches
that in a `finally` and sends `abort` to the engine thread, which frees the request's KV blocks.
A non-streaming handler polls `request.is_disconnected()` while it waits. Shutdown (uvicorn's
SIGINT/SIGTERM handling through `HTTPServer`) first aborts every request, so open streams end at
once; then the app's lifespan exit stops the engine thread and joins it.

Invariants
----------
* Only the engine thread calls the engine after startup; handlers use nothing of it but
  immutable facts read before the thread starts (the tokenizer, the context and KV limits).
* Every accepted request ends with exactly one finished output on its queue (stop, length or
  abort) or an error item, and is released by the engine thread right after.
* `inflight` (requests between acceptance and their handler's end) is changed only on the event
  loop; beyond `max_queue` new requests get 429 before they reach the engine.
* Errors have the OpenAI shape `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import Metrics
from .sampling import SamplingParams

log = logging.getLogger("nanodspark.server")


# ----------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ----------------------------------------------------------------------------- engine thread
ACCEPTED = "accepted"  # first item on a request's queue when the engine took it


@dataclass(eq=False)
class Handle:
    """One request as the HTTP side sees it: its id and the queue its outputs arrive on."""
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    finished: bool = False        # its finished output (or an error) was consumed
    closed: bool = False          # its handler is done with it


class EngineLoop:
    """The one thread that owns the engine: commands in, `RequestOutput`s out."""

    def __init__(self, engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._stopping = False
        self._handles: dict[str, Handle] = {}   # engine thread only
        self._thread = threading.Thread(target=self._run, name="nanodspark-engine", daemon=True)
        self.error: BaseException | None = None  # set if the loop itself died

    # -- called from the event loop ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 60) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, handle: Handle, prompt_ids: list[int], params: SamplingParams) -> None:
        self._send(("add", handle, prompt_ids, params))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        self._send(("abort_all",))

    def _send(self, cmd: tuple) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            self._publish_state()
            while True:
                with self._cond:
                    while not self._inbox and not self._stopping and not eng.has_unfinished():
                        self._cond.wait()
                    if self._stopping:
                        break
                    cmds = list(self._inbox)
                    self._inbox.clear()
                for cmd in cmds:
                    self._command(cmd)
                if eng.has_unfinished():
                    try:
                        outs = eng.step()
                    except Exception as e:  # a bug or an OOM in one step: fail its requests, keep serving
                        log.exception("engine step failed")
                        self._fail_all(APIError(500, f"engine step failed: {e}", "server_error"))
                        outs = []
                    self._publish_state()
                    for out in outs:
                        self._publish(out)
                    if not outs and eng.has_unfinished():
                        with self._cond:  # nothing could be scheduled this step: do not spin
                            self._cond.wait(0.005)
                else:
                    self._publish_state()
        except BaseException as e:  # noqa: BLE001 - report, then let /health say so
            log.exception("engine thread died")
            self.error = e
        finally:
            self._shutdown()

    def _command(self, cmd: tuple) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, h, prompt_ids, params = cmd
            try:
                eng.add_request(prompt_ids, params, request_id=h.request_id)
            except OverflowError as e:
                return self._deliver(h, APIError(429, f"server busy: {e}", "rate_limit_error"))
            except ValueError as e:
                return self._deliver(h, _bad(str(e)))
            except Exception as e:  # noqa: BLE001
                log.exception("add_request failed")
                return self._deliver(h, APIError(500, f"could not add the request: {e}", "server_error"))
            self._handles[h.request_id] = h
            self.metrics.request_started(h.request_id, h.arrival)
            self._deliver(h, ACCEPTED)
        else:  # "abort" one request, or "abort_all"
            for rid in (cmd[1],) if cmd[0] == "abort" else list(self._handles):
                out = eng.abort(rid)
                if out is not None:
                    self._publish(out)

    def _publish(self, out) -> None:
        self.metrics.on_output(out)
        if out.finished:
            h = self._handles.pop(out.request_id, None)
            self.engine.release(out.request_id)
        else:
            h = self._handles.get(out.request_id)
        if h is not None and (out.text_delta or out.finished):  # handlers only need text
            self._deliver(h, out)

    def _publish_state(self) -> None:
        s = self.engine.scheduler
        spec = self.engine.spec.summary() if self.engine.spec is not None else None
        self.metrics.set_engine_state(len(s.running), len(s.waiting), self.engine.kv_usage(), spec)

    def _fail_all(self, err: APIError) -> None:
        for rid, h in list(self._handles.items()):
            try:
                self.engine.abort(rid)
                self.engine.release(rid)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                log.exception("abort of %s failed", rid)
            self.metrics.forget(rid)
            self._deliver(h, err)
        self._handles.clear()

    def _shutdown(self) -> None:
        """Abort everything still known, so that every waiting handler gets its end."""
        for rid in list(self._handles):
            try:
                out = self.engine.abort(rid)
                if out is not None:
                    self._publish(out)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s at shutdown failed", rid)
        self._fail_all(APIError(503, "the server is shutting down", "server_error"))
        with self._cond:
            for cmd in self._inbox:
                if cmd[0] == "add":
                    self._deliver(cmd[1], APIError(503, "the server is shutting down", "server_error"))
            self._inbox.clear()

    @staticmethod
    def _deliver(h: Handle, item) -> None:
        try:
            h.loop.call_soon_threadsafe(h.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


# ----------------------------------------------------------------------------- request parsing
_TYPES = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


def _get(body: dict, name: str, kind: str, default=None):
    """body[name] checked against `kind`; missing or null gives `default`."""
    v = body.get(name)
    if v is None:
        return default
    ok, what = _TYPES[kind]
    if not ok(v):
        raise _bad(f"'{name}' must be {what}, got {json.dumps(v)[:60]}", name)
    return v


def _reject_unsupported(body: dict) -> None:
    n = _get(body, "n", "int", 1)
    if n != 1:
        raise _bad(f"only n=1 is supported, got n={n}", "n")
    if _get(body, "best_of", "int", 1) != 1:
        raise _bad("best_of is not supported", "best_of")
    if body.get("echo"):
        raise _bad("echo is not supported", "echo")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, "number", 0) != 0:
            raise _bad(f"{name} is not supported", name)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported", "logit_bias")
    if body.get("suffix"):
        raise _bad("suffix is not supported", "suffix")
    if body.get("tools") or body.get("functions"):
        raise _bad("tools are not supported", "tools")


def parse_sampling(body: dict, max_tokens_default: int) -> SamplingParams:
    """The OpenAI sampling fields (plus `top_k`, `ignore_eos`) -> validated `SamplingParams`."""
    _reject_unsupported(body)
    max_tokens = _get(body, "max_tokens", "int")
    if max_tokens is None:
        max_tokens = _get(body, "max_completion_tokens", "int", max_tokens_default)
    if max_tokens < 1:
        raise _bad(f"max_tokens must be a positive integer, got {max_tokens}", "max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    top_k = _get(body, "top_k", "int", 0)
    seed = _get(body, "seed", "int")
    if seed is not None and not -2**63 <= seed < 2**64:
        raise _bad("'seed' must fit in 64 bits", "seed")
    params = SamplingParams(
        temperature=float(_get(body, "temperature", "number", 1.0)),
        top_p=float(_get(body, "top_p", "number", 1.0)),
        top_k=0 if top_k == -1 else top_k,   # -1 is a common spelling of "off"
        max_tokens=max_tokens,
        stop=[s for s in stop if s],
        seed=seed,
        ignore_eos=_get(body, "ignore_eos", "bool", False),
    )
    try:
        return params.validate()
    except ValueError as e:
        raise _bad(str(e)) from None


def _message_text(m, i: int) -> dict:
    """One chat message -> {role, content: str}; content may be a list of text parts."""
    if not isinstance(m, dict):
        raise _bad(f"messages[{i}] must be an object", "messages")
    role, content = m.get("role"), m.get("content")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise _bad(f"messages[{i}].role must be system, user or assistant, got {json.dumps(role)[:40]}", "messages")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": role, "content": content}


# ----------------------------------------------------------------------------- responses
def _usage(out) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens, "speculative": out.spec}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


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
            raise _bad(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        model = _get(body, "model", "str")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return body

    async def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise _bad("this model has no tokenizer.json: send the prompt as a list of token ids", "prompt")
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
            yield _sse(first_chunk)
        while True:
            item = await h.queue.get()
            if isinstance(item, APIError):
                h.finished = True
                yield _sse(item.body())
                break
            if item.finished:
                h.finished = True
            yield _sse(chunk(item.text_delta, item.finish_reason if item.finished else None))
            if item.finished:
                if include_usage:
                    yield _sse({**chunk("", None), "choices": [], "usage": _usage(item)})
                break
        yield "data: [DONE]\n\n"

    @staticmethod
    def _stream_options(body: dict) -> bool:
        opts = _get(body, "stream_options", "dict", {})
        return bool(_get(opts, "include_usage", "bool", False))

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, request: Request):
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise _bad("batched prompts are not supported: send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await self._encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise _bad("'prompt' must be a string or a list of token ids", "prompt")
        if not ids:
            raise _bad("the prompt is empty", "prompt")
        params = parse_sampling(body, max_tokens_default=16)
        stream = _get(body, "stream", "bool", False)
        include_usage = self._stream_options(body)
        h = await self._submit(ids, params, "cmpl")
        base = {"id": h.request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}

        def chunk(text, finish_reason):
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

        if stream:
            return _Stream(self._events(h, chunk, include_usage), lambda: self._close(h))
        text, out = await self._collect(request, h)
        return {**chunk(text, out.finish_reason), "usage": _usage(out)}

    async def chat_completions(self, request: Request):
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
        messages = [_message_text(m, i) for i, m in enumerate(messages)]
        if self.tokenizer is None:
            raise _bad("this model has no tokenizer.json, so chat is unavailable; use /v1/completions "
                       "with token ids", "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise _bad(str(e), "messages") from None
        ids = await self._encode(text)
        params = parse_sampling(body, max_tokens_default=max(1, self.max_request_tokens - len(ids)))
        stream = _get(body, "stream", "bool", False)
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
                "usage": _usage(out)}

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
