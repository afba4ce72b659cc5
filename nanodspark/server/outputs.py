"""The API side of a request: token ids in, text and answers out (walkthrough chapter 08).

The idea
--------
The engine side (`engine_loop.py`, in a thread or in the engine-core process) sends token ids
only. `OutputProcessor` turns them into what a handler waits for, on the asyncio event loop,
off the step's thread:

* **Text.** Each request's `Handle` is also its detokenizer state (`output_ids`, `text`,
  `emitted`, ...), so the engine's own incremental detokenizer (`detokenizer.commit_text`) runs
  on it unchanged: the text a client streams is the text `LLM.generate` returns offline,
  multi-byte characters included, and a stream holds back `len(stop) - 1` characters.
* **Stop strings** are checked here, on the text. When one completes, the request ends at the
  token that completes it (`finish_reason: "stop"`), the tokens past it are dropped (never
  streamed, not counted in `usage`), and an `abort` goes to the engine, which learns of the stop
  a step or two late, as the overlapped loop learns of an EOS.
* **Answers.** Each handle's `asyncio.Queue` gets `ACCEPTED` or an `APIError`, then outputs that
  carry text (a non-streaming request: one, at the end), then exactly one finish or error.
* **Merged rows.** A row may carry several steps of a request (the `Relay` merges what queued
  while the event loop was busy): its tokens are decoded before its finish is read, so an
  abort or error merged with earlier tokens loses no text and still sees a stop string first.
* **Metrics** (`Metrics`): tokens, latencies and speculative counters as the outputs arrive;
  the engine's gauges from each `EngineState`. Histograms are updated here, never on the step.

Invariants
----------
* Event loop only: nothing here is locked, and nothing here calls the engine.
* A request ends once on this side (its finish, a stop string, an error or `closing`); rows for
  it that come after (tokens past a stop, the engine's abort) are dropped.
* `usage.completion_tokens` counts the tokens whose text was answered: up to the stop.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..detokenizer import commit_text
from ..request import RequestOutput, SpecStats
from ..sampling import SamplingParams
from .metrics import Metrics
from .openai_api import APIError, bad_request

ACCEPTED = "accepted"  # first item on a request's queue when the engine took it


@dataclass(eq=False)
class Handle:
    """One request as the API side sees it: its queue, and its text (the detokenizer's state)."""
    request_id: str
    params: SamplingParams = field(default_factory=SamplingParams)   # stop strings are read here
    num_prompt_tokens: int = 0
    stream: bool = True           # text as it comes (SSE); False: the whole text with the final output
    refusal_param: str | None = None  # the field a 400 from add_request names (the handler's checks came first)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)   # submitted to the engine
    received: float | None = None     # its handler began (the body not yet read)
    finished: bool = False        # its finished output (or an error) was consumed by the handler
    closed: bool = False          # its handler is done with it
    ended: bool = False           # this side has answered its end (the engine may still be running it)
    # the detokenizer's state (detokenizer.py reads and writes these, as on an engine Request)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    detok_prefix: int = 0
    detok_read: int = 0
    held: list[str] = field(default_factory=list)   # a non-streaming request's text until its end
    spec: tuple = ()

    @property
    def stream_text(self) -> bool:
        return self.stream

    # the rest of what the detokenizer reads of an engine Request
    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    def output_slice(self, start: int, stop: int) -> list[int]:
        return self.output_ids[start:stop]

    def truncate_output(self, n: int) -> None:
        del self.output_ids[n:]


class OutputProcessor:
    """`StepOutputs` -> each handle's queue, text, stop strings and metrics (event loop only)."""

    def __init__(self, tokenizer, metrics: Metrics, abort):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.abort = abort                 # request_id -> None: tell the engine side
        self.handles: dict[str, Handle] = {}
        self.closed: APIError | None = None   # the engine side is gone: new requests get this

    def register(self, h: Handle) -> None:
        if self.closed is not None:
            return self._put(h, self.closed)
        self.handles[h.request_id] = h

    def on_batch(self, b) -> None:
        for ev in b.admitted:
            h = self.handles.get(ev[1])
            if h is None:
                continue
            if ev[0] == "accepted":
                self.metrics.request_started(h.request_id, h.arrival, h.received)
                self._put(h, ACCEPTED)
            else:
                _, rid, status, kind, message = ev
                del self.handles[rid]
                self._put(h, bad_request(message, h.refusal_param) if status == 400 else APIError(status, message, kind))
        now = time.monotonic()
        for rid, new_ids, finish, spec in b.rows():
            h = self.handles.get(rid)
            if h is None:
                continue
            if h.ended:        # answered already (a stop string): the engine's late tokens and abort
                if finish is not None:
                    del self.handles[rid]
                continue
            self._on_tokens(h, new_ids, finish, spec, now)
        for rid, status, kind, message in b.failed:
            h = self.handles.pop(rid, None)
            if h is not None and not h.ended:
                self.metrics.forget(rid)
                self._put(h, APIError(status, message, kind))
        for _, queue, prefill in b.waits:
            self.metrics.engine_waits(queue, prefill)
        if b.state is not None:
            s = b.state
            self.metrics.set_engine_state(s.running, s.waiting, s.kv_usage, s.spec, s.eplb, s.device_memory,
                                          s.resident_bytes)
        if b.closing is not None:
            self.close(APIError(*b.closing))
        self.metrics.flush()             # once per delivery, not per row

    def close(self, err: APIError) -> None:
        """The engine side is gone: every request still open gets `err`, and so do new ones."""
        self.closed = err
        for h in self.handles.values():
            if not h.ended:
                self.metrics.forget(h.request_id)
                h.ended = True
                self._put(h, err)
        self.handles.clear()

    # -- one request's row ---------------------------------------------------------------------
    def _on_tokens(self, h: Handle, new_ids: list[int], finish, spec: tuple, now: float) -> None:
        reason, error = finish if finish is not None else (None, None)
        if reason in ("abort", "error") and new_ids:   # a merged row: its tokens' text first, then its end
            self._on_tokens(h, new_ids, None, spec, now)
            if h.ended:                               # they completed a stop string: that is its end
                self.handles.pop(h.request_id, None)
                return None
            new_ids = []
        h.output_ids += new_ids
        h.spec = spec
        if reason in ("abort", "error"):
            self.metrics.on_tokens(h.request_id, len(new_ids), spec, now)
            if reason == "error":    # the engine stopped this request alone (or failed them all)
                self.metrics.on_finish(h.request_id, reason, h.num_prompt_tokens, now)
                h.ended = True
                del self.handles[h.request_id]
                return self._put(h, APIError(500, f"the engine stopped this request: "
                                                  f"{error or 'the engine could not continue it'}",
                                             "server_error", code="request_failed"))
            return self._end(h, reason, new_ids, self._flush(h), now, engine_done=True)
        delta, stop_hit, keep = commit_text(self.tokenizer, h, new_ids, final=reason is not None)
        if stop_hit:               # the text reached a stop string at new_ids[keep - 1]
            new_ids = new_ids[:keep]
            if reason is None:
                self.abort(h.request_id)
            reason = "stop"
        self.metrics.on_tokens(h.request_id, len(new_ids), spec, now)
        if reason is not None:
            return self._end(h, reason, new_ids, delta, now, engine_done=finish is not None)
        if delta:
            if h.stream:
                self._put(h, RequestOutput(h.request_id, new_ids, delta, False, None, h.num_prompt_tokens,
                                           len(h.output_ids), {}))
            else:
                h.held.append(delta)

    def _flush(self, h: Handle) -> str:
        """The text an aborted request has not sent yet (what the stop-string hold kept back, or,
        for text not decoded as it came, all of it)."""
        if not (h.stream_text or h.params.stop) and h.detok_read < len(h.output_ids):
            return commit_text(self.tokenizer, h, h.output_ids[h.detok_read:], final=True).delta
        delta, h.emitted = h.text[h.emitted:], len(h.text)
        return delta

    def _end(self, h: Handle, reason: str, new_ids: list[int], delta: str, now: float, engine_done: bool) -> None:
        self.metrics.on_finish(h.request_id, reason, h.num_prompt_tokens, now)
        h.ended = True
        if engine_done:   # else (a stop string) it stays until the engine's abort, its late rows dropped
            del self.handles[h.request_id]
        text = "".join(h.held) + delta if not h.stream else delta
        self._put(h, RequestOutput(h.request_id, new_ids, text, True, reason, h.num_prompt_tokens,
                                   len(h.output_ids), SpecStats(*h.spec).as_dict() if h.spec else SpecStats().as_dict()))

    @staticmethod
    def _put(h: Handle, item) -> None:
        if not h.closed:
            h.queue.put_nowait(item)
