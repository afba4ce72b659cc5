"""Tensor and expert parallelism: one engine, N processes, each holding a slice of the target.

What is split (rank r of N tensor-parallel ranks; `Layout` computes every range)
    * **Attention**: the query heads, H/N per rank; q/k/v_proj are column-parallel (each rank
      holds the rows of its heads), o_proj is row-parallel (the columns of its heads). KV heads
      split the same way, or, when there are fewer KV heads than ranks, each rank keeps the one
      KV head its query heads read (replicated across the ranks that share it). Each rank's
      paged KV cache therefore holds only its own KV heads (`local_config`).
    * **Dense MLP**: gate/up column-parallel, down row-parallel (I/N of the intermediate each).
    * **MoE**: the router is replicated. The N ranks form `ep` expert groups of N/ep ranks:
      expert group g owns experts [g E/ep, (g+1) E/ep) ("EP"), and inside a group each expert's
      intermediate dimension is split N/ep ways (TP within the expert). ep = 1 is pure TP of
      every expert, ep = N pure EP (whole experts per rank). `ExpertShard.localize` points the
      (token, expert) pairs of other ranks' experts at local expert 0 with weight 0.
    * **Embedding and LM head**: vocab-parallel, ceil(V/N) rows each (the last rank's padded with
      zeros; tied embeddings stay tied). The embedding zeroes the ids outside its rows and
      all-reduces; the LM head computes its logit columns and all-gathers them.
    * **Replicated**: the norms, the router, the drafter (small; its own layers never
      communicate, its embedding and LM head are the target's vocab-parallel ones), the device
      state and the sampling.

Where the collectives are (per forward of the target, L layers)
    * 1 all-reduce after the embedding; 1 after o_proj and 1 after down_proj (or after the MoE
      output) in every layer: `model.tp_reduce`, called with the group that the forward's
      attention context carries (`PagedAttentionContext.tp`); 1 all-gather of the logits.
      So 2L + 1 all-reduces and one all-gather; the drafter adds one all-reduce (its block's
      embedding) and one all-gather (its logits).
    * MoE tokens are *not* dispatched with an all-to-all: under tensor parallelism every rank
      already holds every token (the attention output was all-reduced), so each rank runs its
      experts on the pairs routed to them and the MoE's partial sums join the same single
      all-reduce as a dense MLP. An all-to-all only pays when ranks hold different tokens
      (data-parallel attention), which this engine does not do.

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

CUDA graphs and the overlapped loop (designed for, not testable here: no GPU)
    Each rank captures its own graphs at start-up, in the same tier order (the capture runs the
    step, collectives included, so all ranks capture together); NCCL all-reduces are recorded
    into the graphs like any kernel. The overlapped loop only moves when rank 0 *reads* a step;
    workers launch steps in the order they receive them, so overlap needs nothing more.

Walkthrough chapter 14.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import hashlib
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class WorkerLost(RuntimeError):
    """A tensor-parallel rank went away; the engine cannot continue (the server stops)."""
    fatal = True


# ----------------------------------------------------------------------------- what each rank holds
@dataclass(frozen=True)
class Layout:
    """Which slice of the target rank `rank` of `size` holds; pure arithmetic, no process group
    (the loader shards with it, and the loader test uses it in one process)."""
    rank: int = 0
    size: int = 1            # tensor-parallel ranks (the world)
    ep_size: int = 1         # expert groups among them (divides size)

    @property
    def moe_tp(self) -> int:           # ranks sharing one expert group
        return self.size // self.ep_size

    def check(self, cfg: ModelConfig) -> None:
        n = self.size
        problems = []
        if cfg.num_attention_heads % n:
            problems.append(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of {n}")
        kv = cfg.num_key_value_heads
        if kv % n and n % kv:
            problems.append(f"num_key_value_heads={kv} neither divides nor is a multiple of {n}")
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) and cfg.intermediate_size % n:
            problems.append(f"intermediate_size={cfg.intermediate_size} is not a multiple of {n}")
        if self.ep_size < 1 or n % self.ep_size:
            problems.append(f"expert_parallel_size={self.ep_size} does not divide tensor_parallel_size={n}")
        elif cfg.num_experts:
            if cfg.num_experts % self.ep_size:
                problems.append(f"num_experts={cfg.num_experts} is not a multiple of "
                                f"expert_parallel_size={self.ep_size}")
            if cfg.moe_intermediate_size % self.moe_tp:
                problems.append(f"moe_intermediate_size={cfg.moe_intermediate_size} is not a multiple of "
                                f"{self.moe_tp} (tensor_parallel_size / expert_parallel_size)")
        elif self.ep_size > 1:
            problems.append("expert_parallel_size > 1 needs a mixture-of-experts model")
        if problems:
            raise ValueError(f"cannot split this {cfg.architecture} model over {n} ranks: " + "; ".join(problems))

    def heads(self, cfg: ModelConfig) -> tuple[int, int, int, int]:
        """(first q head, q heads, first kv head, kv heads) of this rank."""
        nq = cfg.num_attention_heads // self.size
        kv = cfg.num_key_value_heads
        if kv >= self.size:
            nkv = kv // self.size
            return self.rank * nq, nq, self.rank * nkv, nkv
        return self.rank * nq, nq, self.rank * kv // self.size, 1   # replicated KV head

    def split(self, n: int) -> tuple[int, int]:
        """(start, count) of an evenly split dimension."""
        c = n // self.size
        return self.rank * c, c

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of the vocab shard; rows = ceil(V / N) on every rank (padded)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, per

    def experts(self, cfg: ModelConfig) -> tuple[int, int, int, int]:
        """(first expert, experts, first intermediate column, columns) of this rank's MoE slice."""
        ne = cfg.num_experts // self.ep_size
        ni = cfg.moe_intermediate_size // self.moe_tp
        return (self.rank // self.moe_tp) * ne, ne, (self.rank % self.moe_tp) * ni, ni


def local_config(cfg: ModelConfig, layout: Layout) -> ModelConfig:
    """The config as one rank's attention sees it (its q and kv heads): what sizes its KV cache."""
    _, nq, _, nkv = layout.heads(cfg)
    return dataclasses.replace(cfg, num_attention_heads=nq, num_key_value_heads=nkv)


# ----------------------------------------------------------------------------- the group
class TPGroup:
    """The tensor-parallel process group and the two collectives the model uses. Counts calls;
    with `timing` on it also sums the host time spent in them (synchronising on CUDA)."""

    def __init__(self, group, size: int, rank: int, backend: str):
        self.group, self.size, self.rank, self.backend = group, size, rank, backend
        self.calls = 0
        self.timing = False
        self.seconds = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        x = x.contiguous()
        self.calls += 1
        if not self.timing:
            dist.all_reduce(x, group=self.group)
            return x
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.seconds += time.perf_counter() - t0
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank order."""
        import torch.distributed as dist
        x = x.contiguous()
        self.calls += 1
        if self.backend == "nccl":
            out = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------- parallel layers
class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the embedding; the others' ids contribute zeros, and one
    all-reduce sums the ranks' parts into the full embedding."""

    def __init__(self, rows: int, dim: int, first: int, vocab_size: int, tp: TPGroup | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.first, self.rows, self.vocab_size, self.tp = first, rows, vocab_size, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(x) if self.tp is not None else x


class VocabParallelLMHead(nn.Module):
    """The logit columns [first, first + rows) of the LM head; one all-gather joins them (and
    drops the padding columns past the vocabulary)."""

    def __init__(self, rows: int, dim: int, first: int, vocab_size: int, tp: TPGroup | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.first, self.rows, self.vocab_size, self.tp = first, rows, vocab_size, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = F.linear(h, self.weight)
        if self.tp is not None:
            y = self.tp.all_gather_last(y)
        return y[..., :self.vocab_size]


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts [first, first + count) of an MoE layer (the trivial placement: one
    replica per expert; EPLB's physical slots would replace the contiguous range)."""
    first: int
    count: int

    def localize(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids -> local ones; pairs of other ranks' experts go to local expert 0
        with weight 0, so they add nothing. They are still computed: the grouped kernels take
        ids in [0, E) only, and dropping pairs would change the shapes a CUDA graph holds
        (a "skip" id in kernels/moe.py's align_pairs is the follow-up that saves this work)."""
        mine = (ids >= self.first) & (ids < self.first + self.count)
        return torch.where(mine, ids - self.first, 0), torch.where(mine, weights, torch.zeros_like(weights))


# ----------------------------------------------------------------------------- sharding a model
@dataclass(frozen=True)
class Read:
    """How one checkpoint tensor becomes (part of) one local parameter: rows or columns
    [start, stop) of it (`dim` None: all of it), stored at `index` of a stacked parameter."""
    param: str
    dim: int | None = None
    start: int = 0
    stop: int = 0
    index: int | None = None       # the local expert slot of a stacked experts parameter


def _linear(inp: int, out: int, bias: bool) -> nn.Linear:
    return nn.Linear(inp, out, bias=bias)


def shard_model(model: nn.Module, layout: Layout, tp: TPGroup | None = None) -> None:
    """Give a freshly built `CausalLM` (on the meta device) this rank's local shapes: smaller
    Linear and Experts modules, local head counts, vocab-parallel embedding and LM head, the
    expert shard of each MoE layer. Weights are filled afterwards (`plan_reads`, loader.py)."""
    from .model import MLP, Experts, MoE
    cfg = model.config
    layout.check(cfg)
    H, D = cfg.hidden_size, cfg.head_dim
    q0, nq, kv0, nkv = layout.heads(cfg)
    for layer in model.model.layers:
        a = layer.self_attn
        bias = a.q_proj.bias is not None
        a.q_proj, a.k_proj, a.v_proj = _linear(H, nq * D, bias), _linear(H, nkv * D, bias), _linear(H, nkv * D, bias)
        a.o_proj = _linear(nq * D, H, bias and layout.rank == 0)       # a row-parallel bias is added once
        a.n_heads, a.n_kv = nq, nkv
        if isinstance(layer.mlp, MLP):
            _, ni = layout.split(cfg.intermediate_size)
            m = layer.mlp
            m.gate_proj, m.up_proj, m.down_proj = _linear(H, ni, False), _linear(H, ni, False), _linear(ni, H, False)
        elif isinstance(layer.mlp, MoE):
            e0, ne, _, ni = layout.experts(cfg)
            layer.mlp.experts = Experts(ne, H, ni)
            layer.mlp.ep = ExpertShard(e0, ne) if layout.ep_size > 1 else None
    v0, rows = layout.vocab(cfg.vocab_size)
    model.model.embed_tokens = VocabParallelEmbedding(rows, H, v0, cfg.vocab_size, tp)
    model.lm_head = VocabParallelLMHead(rows, H, v0, cfg.vocab_size, tp)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


_LAYER = r"^model\.layers\.(\d+)\."
_EXPERT = re.compile(_LAYER + r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def plan_reads(cfg: ModelConfig, layout: Layout, keys: list[str], local: set[str]) -> dict[str, Read | None]:
    """For each checkpoint key: what this rank reads of it (None: another rank's, skipped).
    `local` are the names of the local model's parameters; a key that no rule knows and that the
    local model does not have is left out (the loader reports it as unexpected)."""
    D = cfg.head_dim
    q0, nq, kv0, nkv = layout.heads(cfg)
    i0, ni = layout.split(cfg.intermediate_size) if cfg.intermediate_size else (0, 0)
    v0, rows = layout.vocab(cfg.vocab_size)
    q_rows, kv_rows = (0, q0 * D, (q0 + nq) * D), (0, kv0 * D, (kv0 + nkv) * D)
    rules = {   # suffix -> (dim, start, stop); a Linear's weight is [out, in]
        "self_attn.q_proj.weight": q_rows, "self_attn.q_proj.bias": q_rows,
        "self_attn.k_proj.weight": kv_rows, "self_attn.k_proj.bias": kv_rows,
        "self_attn.v_proj.weight": kv_rows, "self_attn.v_proj.bias": kv_rows,
        "self_attn.o_proj.weight": (1, q0 * D, (q0 + nq) * D),
        "mlp.gate_proj.weight": (0, i0, i0 + ni), "mlp.up_proj.weight": (0, i0, i0 + ni),
        "mlp.down_proj.weight": (1, i0, i0 + ni),
    }
    plan: dict[str, Read | None] = {}
    for k in keys:
        m = _EXPERT.match(k)
        if m:
            e0, ne, j0, nj = layout.experts(cfg)
            layer, e, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            if not e0 <= e < e0 + ne:
                plan[k] = None
            else:
                plan[k] = Read(f"model.layers.{layer}.mlp.experts.{proj}", 1 if proj == "down_proj" else 0,
                               j0, j0 + nj, e - e0)
            continue
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            plan[k] = Read(k, 0, v0, min(v0 + rows, cfg.vocab_size)) if k in local else None
            continue
        suffix = re.sub(_LAYER, "", k)
        if suffix == "self_attn.o_proj.bias":
            plan[k] = Read(k) if k in local else None          # rank 0 only
        elif suffix in rules and k in local:
            plan[k] = Read(k, *rules[suffix])
        elif k in local:
            plan[k] = Read(k)                                   # replicated (norms, router)
    return plan


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
        self.layout = Layout(rank, world, ep_size)
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
        Layout(0, world, cfg.expert_parallel_size).check(ModelConfig.from_json(resolve_model_dir(model_path)))
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

    def ready(self, engine) -> None:
        """End of the engine's start-up on every rank: workers serve forwards from here on (and
        exit when rank 0 stops them); rank 0 starts its heartbeat and worker watch."""
        import torch.distributed as dist
        dist.barrier(group=self.control)
        if self.rank != 0:
            code = self.serve(engine)
            raise SystemExit(code)
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

    def launch(self, engine, writes, plan):
        """Rank 0's step: send it to the workers, then run it here (engine.launch calls this)."""
        if self.lost is not None:
            self._raise_lost()
        from .step import StepPlan
        bare = StepPlan(chunks=plan.chunks, decode=[None] * len(plan.decode), decode_slots=plan.decode_slots,
                        windows=plan.windows, greedy_only=plan.greedy_only, truncates=plan.truncates)
        self._busy_since = time.monotonic()
        try:
            self._send(("step", writes, bare))
            handle = self._run_step(engine, writes, plan)
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
    def _run_step(self, engine, writes, plan):
        engine.state.apply(writes)
        handle = engine.executor.launch(plan)
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
    def serve(self, engine) -> int:
        """Receive and run steps until rank 0 says stop; returns the process exit code."""
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
                    self._run_step(engine, msg[1], msg[2])
                except RuntimeError as e:
                    print(f"nanodspark worker {self.rank}: step failed ({e}); exiting", file=sys.stderr, flush=True)
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
    from .engine import pick_device
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
    """Entry point of a spawned worker: join the world, build the same engine, serve forwards
    (`LLMEngine.__init__` ends in `Parallel.ready`, which on a worker never returns)."""
    from .engine import LLMEngine
    par = Parallel.connect(rank, world, init, cfg)
    LLMEngine(model_path, cfg, parallel=par)
