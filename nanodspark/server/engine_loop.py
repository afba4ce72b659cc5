"""The engine side of the server: one loop owns the engine, token ids in and out (chapter 08).

The idea
--------
`LLMEngine` is not thread-safe, and one `step()` can take a while, so it runs in a loop of its
own (`EngineLoop`) that is its only caller while serving. The loop speaks token ids only: the
API side (`outputs.py`) tokenizes, detokenizes and checks stop strings, so the step's thread
never waits for text, JSON or a client.

* **In: the inbox**, a `deque` guarded by a `threading.Condition`. `submit`, `abort`, `abort_all`
  and `stop` append a command and notify. The loop drains the whole inbox, runs `engine.step()`
  while there is work, and otherwise sleeps on the condition.
* **Out: one `StepOutputs` per step**, through `emit`: the requests admitted or refused, each
  request's new token ids (one flat array), its speculative counters, its finish, and now and
  then the engine's state for `/metrics` (`EngineState`, at most every `STATE_INTERVAL_S` and
  whenever the engine goes idle). A finished request is released at once: the engine forgets it.
  On the way to the event loop a `Relay` merges the steps that queued while it was busy.

Where the loop runs is the caller's choice: in a thread of the server's process (`start()`,
`serve.py --single-process`, the tests), or as the main loop of the engine-core process
(`core.py`), whose reader thread fills the same inbox from a pipe.

Failures. A request the engine finishes with reason `"error"` is passed on like any finish (the
API side answers it with its own 500). A step that raises is an engine-wide fault: every request
in flight is failed (`engine.fail_all`, which also resets the device state) and the loop keeps
serving, unless the error is `fatal` (a lost tensor-parallel worker, distributed.py): then
`run()` raises. On `stop()` the loop aborts what is left and emits `closing` (503).

Invariants
----------
* Only the loop calls the engine after it starts; other threads touch only the inbox.
* Every admitted request gets exactly one finish in some `StepOutputs` (stop, length, abort,
  error), or a `failed` entry, or the final `closing`.
* Requests go to the engine without stop strings and with `stream_text=False`: the engine
  itself never streams text.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..request import SpecStats
from ..sampling import SamplingParams

log = logging.getLogger("nanodspark.server")

SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SpecStats))   # steps, drafted, ... per row


# ----------------------------------------------------------------------------- what crosses over
@dataclass
class EngineState:
    """The engine's gauges for /metrics (a snapshot, sent now and then)."""
    running: int
    waiting: int
    kv_usage: dict                          # group -> {used, free, total}
    spec: dict | None = None                # SpecDecoder summary (acceptance, ECE, step times)
    eplb: dict | None = None                # ExpertBalancer summary
    device_memory: tuple[int, int] | None = None   # CUDA bytes (allocated, reserved)
    resident_bytes: int | None = None       # the engine-core process's resident memory (core.py only)


@dataclass
class StepOutputs:
    """What the loop sends the API side after a step (or a batch of commands): token ids, never
    text. Row i is a request with new tokens or a finish; its tokens are
    `token_ids[sum(num_tokens[:i]) : sum(num_tokens[:i + 1])]`."""
    admitted: list[tuple] = field(default_factory=list)   # ("accepted", id) | ("refused", id, status, type, message)
    request_ids: list[str] = field(default_factory=list)
    num_tokens: array = field(default_factory=lambda: array("l"))
    token_ids: array = field(default_factory=lambda: array("l"))
    spec: array = field(default_factory=lambda: array("q"))   # len(SPEC_FIELDS) counters per row
    finished: dict[int, tuple[str, str | None]] = field(default_factory=dict)   # row -> (reason, error)
    failed: list[tuple[str, int, str, str]] = field(default_factory=list)       # (id, status, type, message)
    waits: list[tuple[str, float, float]] = field(default_factory=list)   # per finished request: (id, queue s, prefill s)
    state: EngineState | None = None
    closing: tuple[int, str, str] | None = None   # the loop ended: (status, type, message) for the rest

    def __bool__(self) -> bool:
        return bool(self.admitted or self.request_ids or self.failed or self.state or self.closing)

    @classmethod
    def merge(cls, batches: list["StepOutputs"]) -> "StepOutputs":
        """Several steps' outputs as one, a row per request: its tokens in order, its latest
        counters (they are running totals) and its finish. Used when the reader falls behind,
        so the API side pays per request per delivery, not per request per step; array
        operations here, so merging costs little more than copying the tokens."""
        if len(batches) == 1:
            return batches[0]
        out = cls()
        ids, finishes, num_tokens, token_ids, spec = [], {}, [], [], []
        for b in batches:
            out.admitted += b.admitted
            out.failed += b.failed
            out.waits += b.waits
            out.state = b.state or out.state
            out.closing = out.closing or b.closing
            finishes.update({len(ids) + i: f for i, f in b.finished.items()})
            ids += b.request_ids
            num_tokens.append(_ints(b.num_tokens))
            token_ids.append(_ints(b.token_ids))
            spec.append(_ints(b.spec))
        if not ids:
            return out
        first: dict[str, int] = {}                 # id -> its row in the merged output (first seen)
        row = np.fromiter((first.setdefault(r, len(first)) for r in ids), np.int64, len(ids))
        counts = np.concatenate(num_tokens)
        tokens = np.concatenate(token_ids)[np.argsort(np.repeat(row, counts), kind="stable")]
        latest = np.full(len(first), -1, np.int64)
        np.maximum.at(latest, row, np.arange(len(ids)))          # each request's last row: its counters
        out.request_ids = list(first)
        out.num_tokens.frombytes(np.bincount(row, counts, len(first)).astype(np.int64).tobytes())
        out.token_ids.frombytes(tokens.astype(np.int64).tobytes())
        out.spec.frombytes(np.concatenate(spec).reshape(len(ids), -1)[latest].astype(np.int64).tobytes())
        for i in sorted(finishes):                  # a later finish wins, as it would step by step
            out.finished[int(row[i])] = finishes[i]
        return out

    def pick(self, keep: np.ndarray) -> "StepOutputs":
        """The rows where `keep` (a bool per row) holds, as a `StepOutputs` of their own (tokens,
        counters, finishes; the lists and the state are the caller's to split)."""
        out = StepOutputs()
        rows = np.flatnonzero(keep)
        if not len(rows):
            return out
        counts = _ints(self.num_tokens)
        out.request_ids = [self.request_ids[i] for i in rows.tolist()]
        out.num_tokens.frombytes(counts[rows].astype(np.int64).tobytes())
        out.token_ids.frombytes(_ints(self.token_ids)[np.repeat(keep, counts)].astype(np.int64).tobytes())
        out.spec.frombytes(_ints(self.spec).reshape(len(counts), -1)[rows].astype(np.int64).tobytes())
        new_row = np.cumsum(keep) - 1
        out.finished = {int(new_row[i]): f for i, f in self.finished.items() if keep[i]}
        return out

    def rows(self):
        """(request id, new token ids, (reason, error) or None, spec counters) per row."""
        n = len(SPEC_FIELDS)
        start = 0
        for i, rid in enumerate(self.request_ids):
            end = start + self.num_tokens[i]
            yield rid, self.token_ids[start:end].tolist(), self.finished.get(i), tuple(self.spec[i * n:(i + 1) * n])
            start = end


def _ints(a: array) -> np.ndarray:
    """An `array` of C integers as a numpy view (no copy)."""
    return np.frombuffer(a, dtype=np.dtype(a.typecode)) if len(a) else np.zeros(0, np.int64)


class Relay:
    """`StepOutputs` from a thread to the asyncio loop, merged when the loop falls behind.

    At most one drain is pending on the loop: `post` (any thread) queues a batch and schedules a
    drain only if none is pending; the drain delivers everything queued as one `StepOutputs`.
    An event loop that keeps up gets one delivery per step; one that lags gets a few steps at
    once, so its work per step (text, chunks, writes) shrinks as the load grows, instead of its
    backlog (vLLM's output collector merges a lagging request's outputs for the same reason)."""

    def __init__(self, deliver, loop):
        self.deliver, self.loop = deliver, loop
        self._lock = threading.Lock()
        self._queued: list[StepOutputs] = []

    def post(self, batch: "StepOutputs") -> None:
        with self._lock:
            self._queued.append(batch)
            if len(self._queued) > 1:       # a drain is pending and will take this one too
                return
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:                # the event loop is closed: nobody is listening any more
            pass

    def _drain(self) -> None:
        with self._lock:
            batches, self._queued = self._queued, []
        if batches:
            self.deliver(StepOutputs.merge(batches))


@dataclass
class EngineInfo:
    """What the API side needs to know of the engine, read once before the loop starts (and the
    start-up summary)."""
    model: str
    max_model_len: int
    vocab_size: int
    max_request_tokens: int     # the longest prompt + output the KV cache can ever hold
    max_num_seqs: int
    max_waiting: int
    device: str
    dtype: str
    drafter: str | None
    gamma: int
    block_size: int
    kv_blocks: int              # per KV group
    kv_groups: list[str]
    graphs: int = 0             # CUDA graphs captured
    graph_seconds: float = 0.0
    world: int = 1              # tensor-parallel ranks
    worker_pids: list[int] = field(default_factory=list)
    load_seconds: float = 0.0

    @classmethod
    def of(cls, engine, load_seconds: float = 0.0, model: str | None = None) -> "EngineInfo":
        """`model`: the checkpoint directory, as the summary should name it."""
        cfg = engine.config
        model = model or str(engine.model_name)
        kv_blocks = min(bm.num_blocks for bm in engine.scheduler.managers.values())
        kv_tokens = kv_blocks * cfg.block_size
        graphs = getattr(getattr(engine, "executor", None), "graphs", None)
        drafter = getattr(engine, "drafter", None)
        par = getattr(engine, "parallel", None)
        return cls(
            model=model, max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            max_request_tokens=min(engine.max_model_len, kv_tokens - engine.decode_rows),
            max_num_seqs=cfg.max_num_seqs, max_waiting=cfg.max_waiting,
            device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
            drafter=None if drafter is None else (cfg.drafter_path or os.path.join(model, "drafter")),
            gamma=engine.gamma, block_size=cfg.block_size, kv_blocks=kv_blocks,
            kv_groups=list(engine.scheduler.managers),
            graphs=len(getattr(graphs, "graphs", None) or {}),
            graph_seconds=float(getattr(graphs, "capture_seconds", 0.0) or 0.0),
            world=par.world if par is not None else 1,
            worker_pids=[p.pid for p in getattr(par, "procs", None) or []],
            load_seconds=load_seconds)

    def summary(self) -> list[str]:
        """The start-up summary, a few log lines (as vLLM logs its own)."""
        kv_tokens = self.kv_blocks * self.block_size
        where = self.device if self.world == 1 else f"{self.world} {self.device.split(':')[0]} ranks (tensor parallel)"
        lines = [f"model {self.model}: dtype {self.dtype}, device {where}, context {self.max_model_len} tokens",
                 "drafter: none (speculation off)" if self.drafter is None else
                 f"drafter {self.drafter}: gamma {self.gamma} (verify windows of {self.gamma + 1} rows)",
                 f"KV cache: {self.kv_blocks} blocks of {self.block_size} tokens per group "
                 f"({', '.join(self.kv_groups)}) = {kv_tokens:,} tokens; maximum concurrency for "
                 f"{self.max_model_len}-token requests: {kv_tokens / self.max_model_len:.2f}x; "
                 f"at most {self.max_num_seqs} running, {self.max_waiting} waiting",
                 f"CUDA graphs: {self.graphs} captured in {self.graph_seconds:.1f} s" if self.graphs else
                 "CUDA graphs: none (eager steps)",
                 f"engine ready in {self.load_seconds:.1f} s"]
        return lines


def engine_params(params: SamplingParams) -> SamplingParams:
    """What the engine gets: the same sampling, without stop strings (the API side checks them)."""
    return dataclasses.replace(params, stop=[]) if params.stop else params


# ----------------------------------------------------------------------------- the loop
class EngineLoop:
    """The one loop that owns the engine: commands in, `StepOutputs` out (through `emit`)."""

    STATE_INTERVAL_S = 0.05      # the engine's gauges go out at most this often while it is busy
    STALL_WAIT_S = 0.005         # nothing could be scheduled: wait this long for a command

    def __init__(self, engine, emit=None, own_process: bool = False):
        self.engine = engine
        self.emit = emit                          # StepOutputs -> None, called on the loop's thread
        self.own_process = own_process            # report this process's memory (the engine core)
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._stopping = False
        self._live: set[str] = set()              # admitted, not finished (loop only)
        self._out = StepOutputs()
        self._state_due = 0.0
        self._dirty = True
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None   # set if the loop itself died
        self.on_fatal = None                      # called (loop thread) after it died: HTTPServer exits

    # -- any thread -----------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.send(("add", request_id, prompt_ids, engine_params(params)))

    def abort(self, request_id: str) -> None:
        self.send(("abort", request_id))

    def abort_all(self) -> None:
        self.send(("abort_all",))

    def send(self, cmd: tuple) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    def request_stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # -- in a thread of the server's process (single-process mode) -------------------------------
    def start(self, deliver=None, loop=None) -> None:
        """Run the loop in a thread; `deliver(StepOutputs)` is called on the asyncio `loop`."""
        if deliver is not None:
            self.emit = Relay(deliver, loop).post
        self._thread = threading.Thread(target=self._run_thread, name="nanodspark-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 60) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def _run_thread(self) -> None:
        try:
            self.run()
        except BaseException as e:  # noqa: BLE001 - report, then let /health say so
            log.exception("engine thread died")
            self.error = e
            self.close(500, f"engine stopped: {e}")
            if self.on_fatal is not None:
                self.on_fatal(e)      # the server stops (HTTPServer)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until `request_stop()`; raises on a fatal engine error (after which `close`)."""
        eng = self.engine
        stalled = False
        self._flush()            # the gauges, before the first request
        while True:
            with self._cond:
                if not self._inbox and not self._stopping:
                    if stalled:
                        self._cond.wait(self.STALL_WAIT_S)
                    elif not eng.has_unfinished():
                        self._cond.wait()
                if self._stopping:
                    break
                cmds = list(self._inbox)
                self._inbox.clear()
            for cmd in cmds:
                self._command(cmd)
            stalled = False
            if eng.has_unfinished():
                try:
                    outs = eng.step()
                except Exception as e:  # a bug or an OOM in one step: fail its requests, keep serving
                    if getattr(e, "fatal", False):  # the engine cannot go on (a lost tensor-parallel rank)
                        raise
                    log.exception("engine step failed")
                    outs = self._step_failed(f"engine step failed: {e}")
                for out in getattr(outs, "outputs", outs):   # finished, text, prefill: one by one
                    self._row(out)
                for rows in outs.rows() if hasattr(outs, "rows") else ():   # the quiet decode rows: arrays
                    self._rows(*rows)
                stalled = not outs and eng.has_unfinished()
                self._dirty = True
            self._flush()
        self._command(("abort_all",))    # open streams end with finish_reason "abort"
        self.close(503, "the server is shutting down")

    def close(self, status: int, message: str) -> None:
        """The loop is over: every request still open on the API side gets this error (after a
        stop, none is left: `run` aborted them first), and the engine forgets them."""
        for rid in list(self._live):
            try:
                self.engine.abort(rid)
                self.engine.release(rid)
            except Exception:  # noqa: BLE001 - the engine may be in trouble already
                log.exception("abort of %s failed", rid)
        self._live.clear()
        self._out.closing = (status, "server_error", message)
        self._flush(force_state=True)

    def _command(self, cmd: tuple) -> None:
        eng = self.engine
        self._dirty = True
        if cmd[0] == "add":
            _, rid, prompt_ids, params = cmd
            try:
                eng.add_request(prompt_ids, params, request_id=rid, stream_text=False)
            except OverflowError as e:
                return self._out.admitted.append(("refused", rid, 429, "rate_limit_error", f"server busy: {e}"))
            except ValueError as e:
                return self._out.admitted.append(("refused", rid, 400, "invalid_request_error", str(e)))
            except Exception as e:  # noqa: BLE001
                log.exception("add_request failed")
                return self._out.admitted.append(("refused", rid, 500, "server_error",
                                                  f"could not add the request: {e}"))
            self._live.add(rid)
            self._out.admitted.append(("accepted", rid))
        else:  # "abort" one request, or "abort_all"
            for rid in (cmd[1],) if cmd[0] == "abort" else list(self._live):
                out = eng.abort(rid)
                if out is not None:
                    self._row(out)

    def _row(self, out) -> None:
        """One `RequestOutput` into the outgoing arrays; a finished request is released."""
        o = self._out
        if out.finished:
            o.finished[len(o.request_ids)] = (out.finish_reason, getattr(out, "error", None))
            req = getattr(self.engine, "requests", {}).get(out.request_id)
            if getattr(req, "first_token_time", None) is not None and req.scheduled_time is not None:
                o.waits.append((out.request_id, req.scheduled_time - req.arrival,
                                req.first_token_time - req.scheduled_time))
            self.engine.release(out.request_id)
            self._live.discard(out.request_id)
        o.request_ids.append(out.request_id)
        o.num_tokens.append(len(out.new_token_ids))
        o.token_ids.extend(out.new_token_ids)
        spec = out.spec or {}
        o.spec.extend([spec.get(k, 0) for k in SPEC_FIELDS])

    def _rows(self, requests, tokens, counts, spec, num_output) -> None:
        """Quiet decode rows (no finish) into the outgoing arrays, a few array operations."""
        o = self._out
        o.request_ids.extend(r.request_id for r in requests.tolist())
        o.num_tokens.extend(counts.tolist())
        k = np.arange(tokens.shape[1])
        o.token_ids.extend(tokens[k[None, :] < counts[:, None]].tolist())
        o.spec.extend(spec.reshape(-1).tolist())

    def _step_failed(self, message: str) -> list:
        """An engine-wide fault: every request in flight fails; new ones are served."""
        outs = []
        fail_all = getattr(self.engine, "fail_all", None)
        if fail_all is not None:
            try:
                outs = fail_all(message)
            except Exception:  # noqa: BLE001 - fall back to aborting one by one
                log.exception("fail_all failed")
        named = {o.request_id for o in outs}
        for rid in list(self._live - named):      # any the engine did not name
            try:
                self.engine.abort(rid)
                self.engine.release(rid)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                log.exception("abort of %s failed", rid)
            self._live.discard(rid)
            self._out.failed.append((rid, 500, "server_error", message))
        return outs

    def _flush(self, force_state: bool = False) -> None:
        """Emit what this iteration produced, with the engine's state when it is due: every
        `STATE_INTERVAL_S` while busy, and once whenever the engine has gone idle."""
        now = time.monotonic()
        idle = force_state or not self.engine.has_unfinished()
        if force_state or (self._dirty and (idle or now >= self._state_due)):
            try:
                self._out.state = self._state()
            except Exception:  # noqa: BLE001 - gauges are not worth a request: log, and go on
                log.exception("reading the engine's state failed")
            self._state_due, self._dirty = now + self.STATE_INTERVAL_S, False
        if self._out:
            out, self._out = self._out, StepOutputs()
            if self.emit is not None:
                self.emit(out)

    def _state(self) -> EngineState:
        eng = self.engine
        s = eng.scheduler
        dev = getattr(eng, "device", None)
        memory = None
        if getattr(dev, "type", None) == "cuda":
            import torch
            memory = (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev))
        return EngineState(
            len(s.running), len(s.waiting), eng.kv_usage(),
            eng.metrics.summary() if eng.metrics is not None else None,
            eng.eplb.summary() if getattr(eng, "eplb", None) is not None else None,   # no sync
            memory, _resident_bytes() if self.own_process else None)


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
