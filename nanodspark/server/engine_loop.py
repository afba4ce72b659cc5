"""The engine thread: the only caller of the engine while serving (walkthrough chapter 08).

The idea
--------
`LLMEngine` is not thread-safe, and one `step()` can take a while, so it must never run on the
asyncio event loop that serves HTTP. `EngineLoop` owns a `threading.Thread` that owns the engine,
and the HTTP side talks to it only through queues:

* **In: the inbox**, a `deque` guarded by a `threading.Condition`. `submit`, `abort` and
  `abort_all` append a command (`add`, `abort`, `abort_all`) and notify; the event loop holds the
  lock only for that append. The thread drains the whole inbox, runs `engine.step()` while there
  is work, and otherwise sleeps on the condition.
* **Out: one `asyncio.Queue` per request**, inside its `Handle`. Every `RequestOutput` is put
  there with `loop.call_soon_threadsafe` (the only safe way to touch asyncio objects from
  another thread). A request's queue gets first `ACCEPTED` or the engine's refusal (an
  `APIError`: 400 for a `ValueError`, 429 for an `OverflowError`), then its outputs that carry
  text, then exactly one finished output.

Failures. A request the engine finishes with reason `"error"` (its own fault, e.g. logits that
are not finite: the engine isolates it and the batch goes on) gets a 500 of its own, with the
engine's reason. A step that raises is an engine-wide fault: every request in flight gets a 500
(through `engine.fail_all` where the engine has it, which also resets its device state) and the
thread keeps serving new requests — unless the error is `fatal` (a lost tensor-parallel worker,
distributed.py): then the thread ends and `on_fatal` stops the server. On `stop()` (the app's
lifespan exit) the thread aborts everything still known, answers queued `add`s with 503, and is
joined.

Invariants
----------
* Only the engine thread calls the engine after `start()`.
* Every accepted request ends with exactly one finished output on its queue (stop, length or
  abort) or an error item, and is released by the engine thread right after, so the engine
  forgets it.
* `_handles` is touched only by the engine thread; the event loop touches only the inbox.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from .metrics import Metrics
from .openai_api import APIError, bad_request

# The engine thread is part of the server, so it logs under the server's name: one logger
# filters everything the server says.
log = logging.getLogger("nanodspark.server")


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
    refusal_param: str | None = None  # the field a 400 from add_request names (the handler's checks came first)
    stream: bool = True           # text every step (SSE); False: the whole text with the final output


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
        self.on_fatal = None                     # called (engine thread) after it died: HTTPServer exits

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
                        if getattr(e, "fatal", False):  # the engine cannot go on (a lost tensor-parallel rank)
                            self._fail_all(APIError(500, f"engine stopped: {e}", "server_error"))
                            raise
                        log.exception("engine step failed")
                        self._step_failed(f"engine step failed: {e}")
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
            if self.error is not None and self.on_fatal is not None:
                self.on_fatal(self.error)     # the server stops (HTTPServer)

    def _command(self, cmd: tuple) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, h, prompt_ids, params = cmd
            try:
                eng.add_request(prompt_ids, params, request_id=h.request_id, stream_text=h.stream)
            except OverflowError as e:
                return self._deliver(h, APIError(429, f"server busy: {e}", "rate_limit_error"))
            except ValueError as e:
                return self._deliver(h, bad_request(str(e), h.refusal_param))
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

    def _publish(self, out, error: str | None = None) -> None:
        self.metrics.on_output(out)
        if out.finished:
            h = self._handles.pop(out.request_id, None)
            self.engine.release(out.request_id)
        else:
            h = self._handles.get(out.request_id)
        if h is None:
            return
        if out.finished and out.finish_reason == "error":   # the engine stopped this request alone
            why = getattr(out, "error", None) or error or "the engine could not continue it"
            self._deliver(h, APIError(500, f"the engine stopped this request: {why}", "server_error",
                                      code="request_failed"))
        elif out.text_delta or out.finished:  # handlers only need text
            self._deliver(h, out)

    def _step_failed(self, message: str) -> None:
        """An engine-wide fault: every request in flight ends with a 500; new ones are served."""
        fail_all = getattr(self.engine, "fail_all", None)
        if fail_all is None:
            return self._fail_all(APIError(500, message, "server_error"))
        try:
            outs = fail_all(message)
        except Exception:  # noqa: BLE001 - fall back to aborting one by one
            log.exception("fail_all failed")
            return self._fail_all(APIError(500, message, "server_error"))
        for out in outs:
            self._publish(out, error=message)
        self._fail_all(APIError(500, message, "server_error"))  # any the engine did not name

    def _publish_state(self) -> None:
        s = self.engine.scheduler
        spec = self.engine.metrics.summary() if self.engine.metrics is not None else None
        eplb = self.engine.eplb.summary() if self.engine.eplb is not None else None   # no sync
        self.metrics.set_engine_state(len(s.running), len(s.waiting), self.engine.kv_usage(), spec, eplb)

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
