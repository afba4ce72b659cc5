"""Tensor and expert parallelism: one engine, N processes, each holding a slice of the target.

What each rank holds, and where the collectives are: sharding.py.

One engine, N workers (`Parallel`)
    Rank 0 runs the scheduler, the cost scheduler, the server and commits; ranks 1..N-1 are
    workers. Every step, rank 0 broadcasts the step's inputs (the `StateWrites` and a request-free
    `StepPlan`) over a gloo *control* group; each rank applies them to its own device state and
    runs the same `Executor.launch` (prefill forward, then the device decode step: draft,
    windows, verify, accept). Sampling is a pure function of the logits and a (seed, position)
    key (sampling.py), and the logits every rank samples from are the same all-gathered bytes,
    so every rank draws the same tokens and advances its device state identically without the
    tokens ever being sent back. Each rank folds its step outputs into a running digest;
    `Parallel.digests()` compares them (the tests do, every run).

    Start-up: `LLMEngine` with `tensor_parallel_size=N` spawns N-1 workers
    (torch.multiprocessing, "spawn") or, under `torchrun`, joins the world it finds in the
    environment; workers build the same engine and enter `Parallel.serve` from its constructor
    (on a worker, `LLM(...)` returns only by exiting the process once rank 0 shuts down).
    Shutdown: rank 0 sends "stop" (also at interpreter exit) and joins the workers.
    Failure: gloo reports a dead peer at once ("Connection closed by peer"); every collective
    and the control group also have a timeout (`dist_timeout_s`), an idle rank 0 sends a
    heartbeat so workers can tell "idle" from "gone", and rank 0 watches its spawned workers'
    process sentinels. A lost worker raises `WorkerLost` from the engine step (the server stops
    with that message); if the step is stuck inside a device collective that never returns
    (NCCL), the watcher ends rank 0 after the timeout with the same message rather than hang.

CUDA graphs and the overlapped loop (tested over NCCL where two GPUs are)
    Each rank captures its own graphs at start-up, in the same tier order: rank 0 sends
    "capture" once the workers serve (the capture runs the step, collectives included, so all
    ranks must capture together); NCCL all-reduces are recorded
    into the graphs like any kernel. The overlapped loop only moves when rank 0 *reads* a step;
    workers launch steps in the order they receive them, so overlap needs nothing more.

Walkthrough chapter 14.
"""
from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import os
import re
import socket
import sys
import threading
import time

import torch

from .config import ModelConfig, pick_device
from .sharding import ShardLayout, TPGroup


class WorkerLost(RuntimeError):
    """A tensor-parallel rank went away; the engine cannot continue (the server stops)."""
    fatal = True


# ----------------------------------------------------------------------------- processes
def meet_watching(procs, meet, poll_s: float = 0.2):
    """Run rank 0's rendezvous `meet()` while watching the spawned workers: a worker that exits
    before the ranks have met can never arrive, so say so now rather than wait out the timeout.
    (The usual cause: the engine is built at the top level of a script, and each spawned worker,
    which imports that script, tries to build it again.)"""
    out, err = [], []

    def run():
        try:
            out.append(meet())
        except BaseException as e:      # handed to the caller's thread
            err.append(e)
    t = threading.Thread(target=run, name="nanodspark-tp-meet", daemon=True)
    t.start()
    while t.is_alive():
        t.join(poll_s)
        dead = [p for p in procs if p.exitcode is not None]
        if dead and t.is_alive():
            raise RuntimeError(
                f"worker {dead[0].name} exited (code {dead[0].exitcode}) before the ranks met; if the "
                "engine is built at the top level of a script, put it under "
                "`if __name__ == \"__main__\":` (spawned workers import the script)")
    if err:
        raise err[0]
    return out[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def wanted(cfg) -> bool:
    """Does this engine config (or the environment, under torchrun) ask for more than one rank?"""
    return cfg.tensor_parallel_size > 1 or _torchrun_world() > 1


class Parallel:
    """This process's place in the world: layout, groups, the control channel, the workers."""

    def __init__(self, rank: int, world: int, ep_size: int, backend: str, device: torch.device,
                 timeout_s: float, procs=None):
        import torch.distributed as dist
        self.rank, self.world, self.backend, self.device = rank, world, backend, device
        self.layout = ShardLayout(rank, world, ep_size)
        self.timeout_s = timeout_s
        td = datetime.timedelta(seconds=timeout_s)
        # Two groups: control messages (gloo, host objects) and the model's collectives. Kept
        # apart so a heartbeat on the control group can never interleave with an all-reduce.
        self.control = dist.new_group(backend="gloo", timeout=td)
        self.tp = TPGroup(dist.new_group(backend=backend, timeout=td), world, rank, backend)
        self.procs = list(procs or [])     # spawned workers (rank 0 only; empty under torchrun)
        self.lost: str | None = None
        self.stopped = False
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._busy_since: float | None = None
        self._digest = hashlib.blake2b(digest_size=16)
        self._unfolded = None
        self.steps = 0
        if self.procs:                     # from start-up on: a worker that dies is named
            threading.Thread(target=self._watch, name="nanodspark-tp-watch", daemon=True).start()

    # -- start-up ----------------------------------------------------------------------------
    @classmethod
    def start(cls, cfg, model_path) -> "Parallel":
        """Rank 0 of a new world (spawning its workers), or this rank of a torchrun world."""
        import torch.distributed as dist
        backend, device = _backend_and_device(cfg)
        world = _torchrun_world()
        if world > 1:                                         # torchrun: the environment says who we are
            if cfg.tensor_parallel_size not in (1, world):
                raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} but torchrun started "
                                 f"{world} processes")
            rank = int(os.environ["RANK"])
            device = _rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=cfg.dist_timeout_s))
            return cls(rank, world, cfg.expert_parallel_size, backend, device, cfg.dist_timeout_s)
        world = cfg.tensor_parallel_size
        if device.type == "cuda" and world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs; this machine has "
                             f"{torch.cuda.device_count()} (device='cpu' runs the ranks on the CPU over gloo)")
        from .loader import resolve_model_dir
        ShardLayout(0, world, cfg.expert_parallel_size).check(ModelConfig.from_json(resolve_model_dir(model_path)))
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        procs = []
        for r in range(1, world):
            p = ctx.Process(target=_spawned_worker, args=(r, world, init, model_path, cfg),
                            name=f"nanodspark-tp{r}", daemon=True)
            p.start()
            procs.append(p)
        try:
            return cls.connect(0, world, init, cfg, procs)
        except BaseException:
            for p in procs:
                p.kill()
            raise

    @classmethod
    def connect(cls, rank: int, world: int, init: str, cfg, procs=()) -> "Parallel":
        import torch.distributed as dist
        backend, device = _backend_and_device(cfg)
        device = _rank_device(device, rank)
        if device.type == "cpu":        # N processes share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        meet = functools.partial(dist.init_process_group, backend, init_method=init, rank=rank, world_size=world,
                                 timeout=datetime.timedelta(seconds=cfg.dist_timeout_s))
        meet_watching(procs, meet) if procs else meet()   # the thread count above stays this thread's
        return cls(rank, world, cfg.expert_parallel_size, backend, device, cfg.dist_timeout_s, procs)

    def min_int(self, n: int) -> int:
        """The smallest of every rank's `n` (the KV block count every rank can hold)."""
        import torch.distributed as dist
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t)

    def ready(self, worker) -> None:
        """End of start-up on every rank: rank 0 starts its heartbeat and worker watch; a worker
        rank serves steps from here on (`serve`)."""
        import torch.distributed as dist
        self.worker = worker
        dist.barrier(group=self.control)
        if self.rank == 0:
            threading.Thread(target=self._heartbeat, name="nanodspark-tp-heartbeat", daemon=True).start()
            atexit.register(self.shutdown)

    # -- rank 0: the control channel ------------------------------------------------------------
    def _send(self, msg) -> None:
        import torch.distributed as dist
        with self._lock:
            dist.broadcast_object_list([msg], src=0, group=self.control)
            self._last_send = time.monotonic()

    def _heartbeat(self) -> None:
        every = max(0.05, self.timeout_s / 4)
        while not self.stopped and self.lost is None:
            time.sleep(every / 4)
            if time.monotonic() - self._last_send >= every and not self.stopped:
                try:
                    self._send(("ping",))
                except Exception as e:  # noqa: BLE001 - a worker is gone; the next step says so
                    self._lose(f"a tensor-parallel worker stopped answering ({e})")
                    return

    def _watch(self) -> None:
        from multiprocessing.connection import wait
        alive = {p.sentinel: p for p in self.procs}
        while alive and not self.stopped:
            for s in wait(list(alive), timeout=0.5):
                p = alive.pop(s)
                if not self.stopped:
                    self._lose(f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code {p.exitcode}")
        if self.lost is not None and not self.stopped:
            # A step stuck in a device collective with a dead peer may never return (NCCL);
            # after the timeout, end the process with the message rather than hang.
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline and not self.stopped:
                time.sleep(0.1)
            busy = self._busy_since
            if busy is not None and not self.stopped:
                print(f"nanodspark: {self.lost}; the engine is stuck in a collective, exiting", file=sys.stderr,
                      flush=True)
                os._exit(70)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why

    def _raise_lost(self, cause: BaseException | None = None):
        deadline = time.monotonic() + 2
        while cause is not None and self.procs and self.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)            # let the watcher name the worker that died, if one did
        if cause is not None and self.lost is None:
            self.lost = f"a tensor-parallel step failed: {type(cause).__name__}: {cause}"
        raise WorkerLost(f"{self.lost}; the engine cannot continue") from cause

    def capture(self, **kinds) -> None:
        """Rank 0 at start-up: every rank tunes and captures the same decode graphs at once
        (`Worker.capture`), since each capture first runs the step, collectives included."""
        self._busy_since = time.monotonic()
        try:
            self._send(("capture", kinds))
            self.worker.capture(**kinds)
        except Exception as e:  # noqa: BLE001 - a rank that cannot capture leaves the others waiting
            self._raise_lost(e)
        finally:
            self._busy_since = None

    def launch(self, writes, plan):
        """Rank 0's step: send it to the workers, then run it here (engine.launch calls this)."""
        if self.lost is not None:
            self._raise_lost()
        import dataclasses
        bare = dataclasses.replace(plan, chunk_owners=[None] * len(plan.chunk_owners))   # no requests travel
        self._busy_since = time.monotonic()
        try:
            self._send(("step", writes, bare))
            handle = self._run_step(writes, plan)
        except WorkerLost:
            raise
        except Exception as e:  # noqa: BLE001 - the ranks are out of step now: nothing can go on
            self._raise_lost(e)
        finally:
            self._busy_since = None
        return _Guarded(handle, self)

    def digests(self) -> list[str]:
        """Every rank's digest of all its step outputs so far (equal when the ranks agree)."""
        import torch.distributed as dist
        with self._lock:
            dist.broadcast_object_list([("digest",)], src=0, group=self.control)
            out = [None] * self.world
            dist.all_gather_object(out, self._fold_digest(), group=self.control)
        return out

    def abort_start(self, cause: BaseException) -> None:
        """Rank 0's start-up failed: end the workers; if one of them died, raise that instead."""
        lost = self.lost
        self.abort()
        if lost is not None and not isinstance(cause, WorkerLost):
            raise WorkerLost(f"{lost} during start-up") from cause

    def abort(self) -> None:
        """Rank 0 failed to start or lost a worker: end the spawned workers without talking."""
        self._lose(self.lost or "aborted")
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers and leave the world (idempotent; also runs at interpreter exit)."""
        if self.stopped:
            return
        import torch.distributed as dist
        self.stopped = True
        if self.rank == 0 and self.lost is None:
            try:
                self._send(("stop",))
            except Exception:  # noqa: BLE001 - a worker already gone
                pass
        for p in self.procs:
            p.join(timeout=10 if self.lost is None else 0.5)
            if p.is_alive():               # stuck in a collective with a rank that is gone
                p.kill()
                p.join(timeout=5)
        try:
            if self.lost is None:
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass

    # -- every rank: running a step ------------------------------------------------------------
    def _run_step(self, writes, plan):
        self.worker.state.apply(writes)
        handle = self.worker.executor.launch(plan)
        self._fold_digest()                     # the previous step (this one is queued behind it)
        self._unfolded = handle
        self.steps += 1
        return handle

    def _fold_digest(self) -> str:
        h, self._unfolded = self._unfolded, None
        if h is not None:
            if h.event is not None:
                h.event.synchronize()
            for t in h.host:
                self._digest.update(t.numpy().tobytes())
        return self._digest.hexdigest()

    # -- ranks 1..N-1: the worker loop ---------------------------------------------------------
    def serve(self) -> int:
        """A worker rank: receive and run steps until rank 0 says stop; returns the exit code."""
        import torch.distributed as dist
        while True:
            box = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=self.control)
            except RuntimeError as e:
                print(f"nanodspark worker {self.rank}: lost rank 0 ({e}); exiting", file=sys.stderr, flush=True)
                return 1
            msg = box[0]
            kind = msg[0]
            if kind == "step":
                try:
                    self._run_step(msg[1], msg[2])
                except RuntimeError as e:
                    print(f"nanodspark worker {self.rank}: step failed ({e}); exiting", file=sys.stderr, flush=True)
                    return 1
            elif kind == "capture":
                try:
                    self.worker.capture(**msg[1])
                except RuntimeError as e:
                    print(f"nanodspark worker {self.rank}: capture failed ({e}); exiting", file=sys.stderr, flush=True)
                    return 1
            elif kind == "digest":
                dist.all_gather_object([None] * self.world, self._fold_digest(), group=self.control)
            elif kind == "stop":
                self._fold_digest()
                self.stopped = True
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    pass
                return 0
            # "ping": rank 0 is alive and idle


class _Guarded:
    """A rank-0 step handle whose `result()` turns a lost worker into `WorkerLost`."""

    def __init__(self, handle, par: Parallel):
        self._h, self._par = handle, par

    def __getattr__(self, name):
        return getattr(self._h, name)

    def result(self):
        par = self._par
        par._busy_since = time.monotonic()
        try:
            return self._h.result()
        except RuntimeError as e:
            par._raise_lost(e)
        finally:
            par._busy_since = None


def _backend_and_device(cfg) -> tuple[str, torch.device]:
    device = pick_device(cfg.device)
    backend = cfg.dist_backend if cfg.dist_backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    return backend, device


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    d = torch.device("cuda", local_rank)
    torch.cuda.set_device(d)
    return d


def _spawned_worker(rank: int, world: int, init: str, model_path, cfg) -> None:
    """Entry point of a spawned worker: join the world, build the device side, serve steps."""
    par = Parallel.connect(rank, world, init, cfg)
    serve_as_worker(par, model_path, cfg)


def serve_as_worker(par: Parallel, model_path, cfg) -> None:
    """A worker rank's whole life: build its `Worker` (worker.py), serve steps, exit with the code."""
    from .worker import Worker
    try:
        worker = Worker(model_path, cfg, par)
    except BaseException:
        par.abort()
        raise
    par.ready(worker)
    raise SystemExit(par.serve())
