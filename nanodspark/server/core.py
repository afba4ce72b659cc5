"""The engine core: the step loop in a process of its own, fed token ids (walkthrough chapter 08).

The idea
--------
HTTP parsing, JSON, server-sent events, tokenizing and detokenizing are Python work; in one
process they share one interpreter lock with the engine's step loop, and at high concurrency
the front end eats the steps' host time. So `serve.py` runs two processes, as vLLM (`AsyncLLM`
and `EngineCore`) and SGLang (tokenizer manager, scheduler, detokenizer) do:

    API server process (app.py, outputs.py)                  engine-core process (run_core)
    handlers: parse, tokenize, chat template                 LLMEngine(model, EngineConfig)
    CoreClient.submit / abort / abort_all ── commands ──▶   reader thread → EngineLoop inbox
                                                             EngineLoop.run(): step, release
    reader thread → event loop: OutputProcessor  ◀── outputs ── sender thread ◀── StepOutputs
      (detokenize, stop strings, metrics, SSE)

A link is two one-way `multiprocessing` pipes (spawn context) carrying pickled tuples:
`("add", id, token ids, params)`, `("abort", id)`, `("abort_all",)`, `("stop",)` in; `("ready",
EngineInfo)` or `("failed", kind, message)` once, then `("out", StepOutputs)` (token ids as
arrays, never text), and last `("stopped",)` or `("fatal", message)` out. Why pipes and not ZMQ:
one peer each way, ordered, and end-of-file when the other side dies (so neither process can
outlive the other unnoticed), with no new dependency on the GPU image. The core's pipe ends are
served by threads, so the step loop never waits on a pipe; the API side never waits either.
With several API processes (api_servers.py) the core serves a link each (`Fanout`: requests
noted by link, each step's outputs split by link); the first link's `stop` stops the core.

The core does no text work (no stop strings, no tokenizer): the API side sees a stop string,
answers and sends an abort; tokens made meanwhile are dropped. Lifecycle: `CoreClient(...)` spawns the process and `wait_ready()` returns the `EngineInfo` (or
raises `CoreStartError` with the core's reason); `start()` begins reading outputs; `stop()`
sends `stop`, waits for the core to abort what it holds and exit, and kills it if it does not
within the timeout. The core ignores SIGINT (Ctrl-C reaches the whole process group; the API
process decides) and stops on end-of-file: an API process that dies leaves no orphan.

Invariants
----------
* The API process never touches the engine, and the core never touches text or HTTP.
* Commands and outputs keep their order (one pipe each way); every admitted request ends in the
  API process with exactly one finish, error, or the `closing` of a core that stopped or died.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback

import numpy as np

from .engine_loop import EngineInfo, EngineLoop, Relay, StepOutputs, engine_params

log = logging.getLogger("nanodspark.server")


class CoreStartError(RuntimeError):
    """The engine core could not start; `kind` is "load" (the model or a setting was refused:
    a user error) or "error" (anything else, with the core's traceback on its stderr)."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


class CoreDied(RuntimeError):
    """The engine core stopped while serving."""


# ----------------------------------------------------------------------------- the API side
class CoreLink:
    """An API process's end of one link to the engine core: the same methods as `EngineLoop`
    (`submit`, `abort`, `abort_all`, `start`, `stop`, `alive`, `error`, `on_fatal`), over a pair
    of pipes. `CoreClient` is the link of the process that started the core; the extra API
    processes of `serve.py --api-server-count N` get a bare link each (api_servers.py)."""

    def __init__(self, model_path, commands, outputs):
        self.model_path = model_path
        self._cmd, self._out = commands, outputs
        self.info: EngineInfo | None = None
        self.tokenizer = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.on_fatal = None

    def _core_alive(self) -> bool:
        return True          # a bare link learns of a dead core from its pipe's end-of-file

    def wait_ready(self) -> EngineInfo:
        """Block until the core has built its engine; load the tokenizer meanwhile."""
        from ..loader import Tokenizer, resolve_model_dir
        model_dir = resolve_model_dir(self.model_path)
        if (model_dir / "tokenizer.json").exists():
            self.tokenizer = Tokenizer(model_dir)
            self.tokenizer.longest_token_chars   # computed now, not on the first request
        t0 = next_note = time.monotonic()
        try:
            while not self._out.poll(0.2):
                if not self._core_alive():
                    raise EOFError
                if time.monotonic() >= next_note + 15:     # a line now and then while a big model loads
                    next_note = time.monotonic()
                    log.info("the engine core is still loading (%.0f s)", next_note - t0)
            msg = self._out.recv()
        except (EOFError, OSError):
            raise CoreStartError(self._gone("before it was ready; its error is above")) from None
        if msg[0] == "failed":
            raise CoreStartError(msg[2], msg[1])
        self.info = msg[1]
        return self.info

    def _gone(self, when: str) -> str:
        return f"the engine-core process exited {when}"

    # -- the event loop's side ---------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params) -> None:
        self._send(("add", request_id, prompt_ids, engine_params(params)))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        self._send(("abort_all",))

    def _send(self, msg: tuple) -> None:
        with self._lock:
            try:
                self._cmd.send(msg)
            except (BrokenPipeError, OSError):   # the core is gone; the reader reports it
                pass

    def start(self, deliver, loop) -> None:
        """Read the core's outputs in a thread; `deliver(StepOutputs)` runs on the asyncio `loop`."""
        self._reader = threading.Thread(target=self._read, args=(Relay(deliver, loop).post,),
                                        name="nanodspark-core-reader", daemon=True)
        self._reader.start()

    def _read(self, post) -> None:
        try:
            while True:
                kind, payload = self._out.recv()
                if kind == "out":
                    post(payload)
                elif kind == "fatal":
                    self.error = CoreDied(payload)
                    break
                else:   # "stopped": asked for by this link, or the core was stopped by another
                    if not self._stopping:
                        self.error = CoreDied("the engine core stopped")
                        post(StepOutputs(closing=(503, "server_error", "the server is shutting down")))
                    break
        except (EOFError, OSError):
            if not self._stopping:
                self.error = CoreDied(self._gone("while serving"))
                post(StepOutputs(closing=(500, "server_error", f"engine stopped: {self.error}")))
        if self.error is not None:
            log.error("the engine core stopped: %s", self.error)
            if self.on_fatal is not None:
                self.on_fatal(self.error)

    def stop(self, timeout: float | None = 60) -> None:
        """Leave: the core aborts this link's requests and says `stopped` (the first link's
        `stop` stops the core itself)."""
        self._stopping = True
        self._send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout)
        for conn in (self._cmd, self._out):
            conn.close()

    @property
    def alive(self) -> bool:
        return not self._stopping and self.error is None


class CoreClient(CoreLink):
    """The link of the process that starts the engine core (and owns it: its `stop` stops the
    core). `links=N` opens N-1 more links for other API processes (`extra_links`)."""

    def __init__(self, model_path, config, log_level: str = "info", links: int = 1):
        ctx = mp.get_context("spawn")
        pipes = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(links)]
        # per link: (the core's command end, the core's output end), (the API's command end, its output end)
        core_ends = [(cmd_r, out_w) for (cmd_r, _), (_, out_w) in pipes]
        api_ends = [(cmd_w, out_r) for (_, cmd_w), (out_r, _) in pipes]
        self.process = ctx.Process(target=run_core, args=(model_path, config, core_ends, log_level),
                                   name="nanodspark-core")   # not a daemon: it may spawn tensor-parallel workers
        with _child_env(OMP_WAIT_POLICY="PASSIVE"):
            self.process.start()
        for conn in (c for pair in core_ends for c in pair):
            conn.close()     # only the core holds these ends now, so each side sees the other's end-of-file
        super().__init__(model_path, *api_ends[0])
        self.extra_links = api_ends[1:]    # for the other API processes; close them here once handed over

    def _core_alive(self) -> bool:
        return self.process.is_alive()

    def _gone(self, when: str) -> str:
        self.process.join(5)
        return f"the engine-core process exited (status {self.process.exitcode}) {when}"

    def wait_ready(self) -> EngineInfo:
        try:
            return super().wait_ready()
        except CoreStartError:
            self.process.join(30)
            raise

    def stop(self, timeout: float | None = 60) -> None:
        """Ask the core to stop (it aborts what it holds and says so), then wait for it to exit."""
        self._stopping = True
        self._send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine core did not stop within %s s; terminating it", timeout)
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        for conn in (self._cmd, self._out, *(c for pair in self.extra_links for c in pair)):
            conn.close()

    def kill(self) -> None:
        """Stop the core at once (start-up interrupted)."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and super().alive


@contextlib.contextmanager
def _child_env(**defaults):
    """Environment defaults for a process spawned inside (the caller's own settings win).

    OMP_WAIT_POLICY=PASSIVE: torch's CPU threads otherwise spin for a while after every parallel
    region, holding the cores the API process needs; on 2 CPU cores that made the two-process
    server several times slower than one process (measured: 100 requests at 16 in 30 s instead of
    1.5 s), and a GPU step barely uses those threads."""
    saved = {k: os.environ.get(k) for k in defaults}
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


# ----------------------------------------------------------------------------- the core process
def run_core(model_path, config, links, log_level: str = "info") -> None:
    """The engine-core process: build the engine, then serve the links (pairs of pipes: commands
    in, outputs out) until the first link says `stop` or closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     (engine core) %(message)s")
    from ..llm import build_engine
    t0 = time.monotonic()
    try:
        engine = build_engine(model_path, config)
    except BaseException as e:  # noqa: BLE001 - said to the API processes, which exit
        kind = "load" if isinstance(e, (FileNotFoundError, ValueError)) else "error"
        if kind == "error":
            traceback.print_exc()
        for _, outputs in links:
            with contextlib.suppress(OSError):
                outputs.send(("failed", kind, f"{e}"))
            outputs.close()
        return
    from ..loader import resolve_model_dir
    info = EngineInfo.of(engine, load_seconds=time.monotonic() - t0, model=str(resolve_model_dir(model_path)))
    engine.tokenizer = None      # the API processes do all text work: the core never decodes
    fan = Fanout(len(links))
    fan.start()
    loop = EngineLoop(engine, emit=fan.emit, own_process=True)
    senders = [threading.Thread(target=_send_all, args=(q, outputs), name=f"nanodspark-core-sender-{i}")
               for i, (q, (_, outputs)) in enumerate(zip(fan.sends, links))]
    for t in senders:
        t.start()
    fan.put_all(("ready", info))
    for i, (commands, _) in enumerate(links):
        threading.Thread(target=_read_commands, args=(commands, loop, fan, i), name=f"nanodspark-core-commands-{i}",
                         daemon=True).start()
    try:
        loop.run()
        fan.put_all(("stopped", None))
    except BaseException as e:  # noqa: BLE001 - a fatal engine error: every request learns it
        log.exception("the engine stopped")
        loop.close(500, f"engine stopped: {e}")
        fan.put_all(("fatal", str(e)))
    finally:
        fan.put_all(None)
        for t in senders:
            t.join(30)
        engine.shutdown()


class Fanout:
    """One engine loop serving several links: each request is noted with the link it came from,
    each step's `StepOutputs` is split back by link, and a link's `abort_all` or departure aborts
    only its own requests. With one link nothing is noted or split. Once `start`ed, the split
    runs in a router thread of its own, not on the step loop's thread."""

    def __init__(self, n: int):
        self.sends = [queue.SimpleQueue() for _ in range(n)]   # per link, for its sender thread
        self.open = [True] * n
        self._owner: dict[str, int] = {}       # request id -> link (n > 1 only)
        self._lock = threading.Lock()          # readers add owners, the router removes them
        self._routed: queue.SimpleQueue | None = None
        self._router: threading.Thread | None = None

    def start(self) -> None:
        if len(self.sends) > 1:
            self._routed = queue.SimpleQueue()
            self._router = threading.Thread(target=self._route_all, name="nanodspark-core-router", daemon=True)
            self._router.start()

    def _route_all(self) -> None:
        while True:
            msg = self._routed.get()
            self._route(msg)
            if msg == ("all", None):
                return

    def _route(self, msg: tuple) -> None:
        kind, payload = msg
        if kind == "all":
            for q, is_open in zip(self.sends, self.open):
                if is_open:
                    q.put(payload)
        else:
            for link, part in enumerate(self.split(payload)):
                if part and self.open[link]:
                    self.sends[link].put(("out", part))

    def put_all(self, msg) -> None:
        """`msg` to every open link, after every batch emitted before it (None ends the senders)."""
        if self._routed is not None:
            self._routed.put(("all", msg))
            if msg is None:
                self._router.join(30)
        else:
            self._route(("all", msg))

    def command(self, link: int, cmd: tuple, loop: EngineLoop) -> None:
        if len(self.sends) > 1:
            if cmd[0] == "add":
                with self._lock:
                    self._owner[cmd[1]] = link
            elif cmd[0] == "abort_all":
                for rid in self._ids_of(link):
                    loop.send(("abort", rid))
                return
        loop.send(cmd)

    def leave(self, link: int, loop: EngineLoop) -> None:
        """An API process other than the first left (its `stop`, or its pipe closed): abort its
        requests, say `stopped`, and send it nothing more; the core serves the others."""
        for rid in self._ids_of(link):
            loop.send(("abort", rid))
        self.open[link] = False
        self.sends[link].put(("stopped", None))
        self.sends[link].put(None)

    def _ids_of(self, link: int) -> list[str]:
        with self._lock:
            return [rid for rid, owner in self._owner.items() if owner == link]

    def emit(self, batch: StepOutputs) -> None:
        """The loop's `emit`: the batch to its link(s)."""
        if len(self.sends) == 1:
            self.sends[0].put(("out", batch))
        elif self._routed is not None:
            self._routed.put(("out", batch))
        else:
            self._route(("out", batch))

    def split(self, batch: StepOutputs) -> list[StepOutputs]:
        """A `StepOutputs` per link: its requests' rows, admissions, failures and waits; the
        engine's state and a `closing` go to every link. Ended requests are forgotten."""
        ended = [e[1] for e in batch.admitted if e[0] == "refused"] + [e[0] for e in batch.failed] + \
            [batch.request_ids[i] for i in batch.finished]
        with self._lock:                 # the lookups under the lock; the arrays' work outside it
            get = self._owner.get
            rows = np.fromiter((get(r, -1) for r in batch.request_ids), np.int64, len(batch.request_ids))
            admitted, failed, waits = ([get(e[k], 0) for e in entries] for entries, k in
                                       ((batch.admitted, 1), (batch.failed, 0), (batch.waits, 0)))
            for rid in ended:
                self._owner.pop(rid, None)
        parts = [batch.pick(rows == link) for link in range(len(self.sends))]
        for part in parts:
            part.state, part.closing = batch.state, batch.closing
        for entry, link in zip(batch.admitted, admitted):
            parts[link].admitted.append(entry)
        for entry, link in zip(batch.failed, failed):
            parts[link].failed.append(entry)
        for entry, link in zip(batch.waits, waits):
            parts[link].waits.append(entry)
        return parts


def _send_all(sends: queue.SimpleQueue, outputs) -> None:
    """A link's sender thread: pickle and write, so the step loop never waits on the pipe."""
    broken = False
    while (msg := sends.get()) is not None:
        if broken:
            continue
        try:
            outputs.send(msg)
        except (BrokenPipeError, OSError):   # the API process is gone: drain, and let the core stop
            broken = True
    outputs.close()


def _read_commands(commands, loop: EngineLoop, fan: Fanout, link: int) -> None:
    """A link's reader thread: commands from the pipe into the loop's inbox. `stop` or end-of-file
    on the first link (the process that started the core is gone) stops the loop; on another
    link, that API process leaves."""
    try:
        while True:
            cmd = commands.recv()
            if cmd[0] == "stop":
                break
            fan.command(link, cmd, loop)
    except (EOFError, OSError):
        pass
    if link == 0:
        loop.request_stop()
    else:
        fan.leave(link, loop)
