"""The engine: choose, launch, commit (the offline API, `LLM`, is in llm.py).

One step is four lines (`LLMEngine.step` through the loop of overlap_loop.py): the `Scheduler`
(scheduler.py) *chooses* what each request feeds this step, the `Executor` (step.py) *drafts
and verifies* on the device — the prefill chunks in one eager forward, the decoding requests in
one decode step (speculative.py) replayed from a CUDA graph when a tier fits (ragged_graphs.py)
— and the engine *commits* the typed `StepResult`: new tokens, stops, rollback of rejected
slots, published blocks, frees. Requests and the records the engine answers with are in
request.py; this file also picks the device and dtype and keeps `PhaseClock`.

Continuous batching. Every request is a token list `prompt + output` of which the first
`num_computed` have KV in the cache. A step feeds each running request the next slice of that
list: a prefill chunk, or a verify window (a single token without a drafter). When a prefill
slice reaches the end of the list, its last row samples one new token on the device, where the
next decode step finds it.

KV budget. A request is admitted when its prompt's blocks fit. When a running request cannot
grow, the most recently admitted request is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed from its prompt *and* its output so far (recompute is
exact: sampling is keyed by seed and position, sampling.py). No request is dropped; one that
could never fit in the whole cache is refused at `add_request` with a `ValueError`.

Failures. A request whose logits are not finite is finished with reason "error" and the batch
goes on; an exception in a step (out of memory, a kernel error) propagates to the caller, which
may call `fail_all` and keep serving new requests.

Invariants: a request's block tables cover exactly its reserved tokens; every row a step
computes has a reserved slot; a finished or aborted request holds no blocks and no slot;
`num_computed <= len(prompt) + len(output)`; a commit for a request that finished while the
step was in flight is dropped. Walkthrough chapter 01.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import contextmanager

import torch

from .config import EngineConfig
from .detokenizer import commit_text
from .device_state import DeviceState, StateWrites
from .loader import Tokenizer, load_model, resolve_model_dir
from .model import KVCache, ops_for
from .paged_kv import BlockManager
from .request import GenerationOutput, Request, RequestOutput, SpecStats, Status
from .runner import Chunk, ModelRunner
from .sampling import SamplingParams, draw_seed
from .scheduler import Drain, Scheduler
from .step import Executor, StepPlan, StepResult
from .verify import VerifyMode

# The request records and the scheduler live in request.py and scheduler.py; they are named here
# too, so `from nanodspark.engine import Request` (or `Status`, `Scheduler`, ...) keeps working.
__all__ = ["GenerationOutput", "LLMEngine", "PhaseClock", "Request", "RequestOutput", "Scheduler",
           "SpecStats", "Status", "pick_device", "pick_dtype"]


def _triton_interpreting() -> bool:
    import os
    import kernels  # noqa: F401  (sets TRITON_INTERPRET on CPU while it still can)
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def auto_token_budget(device: torch.device) -> int:
    """`max_num_batched_tokens` when left at 0. On a GPU a prefill chunk runs eagerly and its
    host launches cost the same at 2k or 8k tokens (09 §8c), so a prompt wave in fewer chunks is
    cheaper; on a CPU a chunk costs its FLOPs, and a smaller one keeps running decodes moving."""
    return 8192 if device.type == "cuda" else 2048


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ----------------------------------------------------------------------------- the engine
class PhaseClock:
    """Host milliseconds per phase of an engine step, summed over steps (`LLMEngine.clock`).

    The engine is host-bound on small models, so where the host spends a step is the first thing
    to read when one verify mode is slower than the cost model says. A lap that ends in a
    device->host copy also holds the wait for the GPU work queued before it: the drafter's in
    `copy` (draft tokens and confidences), the target's in `argmax`. Compare sums of phases
    across modes, not one phase.
    """

    def __init__(self):
        self.total: dict[str, float] = {}
        self.steps = 0
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        t = time.perf_counter()
        self.total[name] = self.total.get(name, 0.0) + t - self._t
        self._t = t

    def reset(self) -> None:
        self.total, self.steps = {}, 0

    @contextmanager
    def paused(self):
        """Steps run inside leave the totals as they were (a benchmark's untimed set-up)."""
        saved = (dict(self.total), self.steps)
        try:
            yield
        finally:
            self.total, self.steps = saved

    def per_step_ms(self) -> dict[str, float]:
        return {k: round(1e3 * v / max(1, self.steps), 3) for k, v in self.total.items()}


class LLMEngine:
    def __init__(self, model_path: str | None = None, config: EngineConfig | None = None, parallel=None):
        self.config = cfg = config or EngineConfig()
        from . import distributed
        if parallel is None and distributed.wanted(cfg):
            parallel = distributed.Parallel.start(cfg, model_path)   # spawns the workers (or joins torchrun's)
        self.parallel = parallel          # None in one process; else this rank's place (distributed.py)
        try:
            self._build(model_path, cfg, parallel)
        except BaseException as e:
            if parallel is not None and parallel.rank == 0:
                lost = parallel.lost
                parallel.abort()
                if lost is not None and not isinstance(e, distributed.WorkerLost):
                    raise distributed.WorkerLost(f"{lost} during start-up") from e
            raise
        if parallel is not None:
            parallel.ready(self)          # a worker serves forwards from here and never returns

    def _build(self, model_path, cfg: EngineConfig, parallel) -> None:
        from .distributed import local_config
        self.device = parallel.device if parallel is not None else pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        if cfg.max_num_batched_tokens == 0:
            cfg = self.config = dataclasses.replace(cfg, max_num_batched_tokens=auto_token_budget(self.device))
        model_dir = resolve_model_dir(model_path)
        shard = {} if parallel is None else dict(layout=parallel.layout, tp=parallel.tp)
        self.model = load_model(model_dir, dtype=self.dtype, device=self.device, **shard)
        self.model_config = mc = self.model.config
        # the attention of this rank (its own heads): what its KV cache holds
        self.kv_config = mc if parallel is None else local_config(mc, parallel.layout)
        self.tokenizer = Tokenizer(model_dir, mc.eos_token_id) if (model_dir / "tokenizer.json").exists() else None
        self.eos_ids = set(self.tokenizer.eos_token_ids if self.tokenizer else mc.eos_token_id)
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        mc.check_max_model_len(self.max_model_len)      # dynamic RoPE: exact only up to max_position_embeddings
        self.backend = cfg.attention_backend
        if self.backend == "auto":
            self.backend = "triton" if self.device.type == "cuda" else "torch"
        if self.backend == "triton" and self.device.type != "cuda" and not _triton_interpreting():
            raise ValueError("attention_backend='triton' needs CUDA (or, for tests, TRITON_INTERPRET=1 "
                             "set before Triton is imported); use 'torch' on CPU")
        self.model_name = str(model_path or "default")  # the key of this model's cost table
        self.ops = ops_for(self.backend, cfg.batch_invariant)
        self.drafter = drafter = self._load_drafter(model_dir)
        self.gamma = drafter.config.gamma if drafter is not None else 0
        if self.backend == "triton" or cfg.batch_invariant:    # one GEMM for q/k/v and for gate/up
            self.model.fuse()
            if drafter is not None:
                drafter.fuse()
        self.eplb = None                      # expert load balancing (eplb.py): widens the MoE layers
        if cfg.eplb:                          # before anything captures them
            from .eplb import ExpertBalancer
            self.eplb = ExpertBalancer(self.model, cfg, self.device)
        num_blocks = self._num_kv_blocks(drafter)
        if parallel is not None:              # rank 0 allocates blocks every rank must have
            num_blocks = parallel.min_int(num_blocks)
        self.kv_cache = KVCache(self.kv_config, {g: num_blocks for g in ("full", "sliding")}, cfg.block_size,
                                self.dtype, self.device)
        managers = {g: BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_cache and g == "full")
                    for g in self.kv_cache.layout}
        draft_cache = None
        if drafter is not None:
            managers["draft"] = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_cache)
            dc = drafter.config
            draft_cache = torch.zeros(dc.num_layers, 2, num_blocks, cfg.block_size, dc.num_key_value_heads,
                                      dc.head_dim, dtype=self.dtype, device=self.device)
        if self.decode_rows > cfg.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens={cfg.max_num_batched_tokens} cannot hold one verify window "
                             f"({self.decode_rows} rows = anchor + gamma drafts)")
        from .swa_replay import look_back
        overlapped = cfg.overlap and self.device.type == "cuda"      # the loop chosen below
        self.scheduler = Scheduler(cfg, mc, managers, look_back(self.gamma, 2 if overlapped else 1))
        max_blocks = -(-(self.max_model_len + 2 * self.decode_rows) // cfg.block_size)
        self.state = DeviceState(cfg.max_num_seqs, list(managers), max_blocks, self.device)
        self.writes = StateWrites()
        self.verify_mode = VerifyMode.parse(cfg.verify_mode)
        from .speculative import SpecStep
        tp = parallel.tp if parallel is not None else None
        self.runner = ModelRunner(self.model, self.kv_cache, self.state, self.ops, cfg.block_size, drafter, draft_cache,
                                  tp=tp)
        spec = SpecStep(self.model, self.kv_cache, self.state, self.ops, cfg.block_size, self.verify_mode,
                        drafter, draft_cache, tp=tp)
        spec.coupled = cfg.coupled_sampling
        use_graphs = cfg.cuda_graphs and self.device.type == "cuda" and self.backend == "triton"
        self.executor = Executor(self.runner, spec, cfg.max_num_seqs, self.state.scratch, self.device, use_graphs,
                                 cfg.graph_batch_sizes, cfg.graph_token_fractions)
        self.windows = self._window_policy()
        from .observers import SpecMetrics
        self.metrics = SpecMetrics(self.gamma, self.verify_mode) if drafter is not None else None
        self.extra_observers: list = []     # e.g. train_heads' CalibrationRecorder
        self.seed_generator = torch.Generator().manual_seed(cfg.seed)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.clock = PhaseClock()
        from .overlap_loop import OverlapLoop, SyncLoop
        self.loop = OverlapLoop(self) if overlapped else SyncLoop(self)
        if self.device.type == "cuda" and self.backend == "triton":
            self._tune_gemms()
        if use_graphs:
            self.executor.graphs.capture([(True, False), (False, False)], progress=cfg.use_tqdm)

    def _tune_gemms(self) -> None:
        """Record the GEMM shapes of every decode tier and let the skinny kernel take those it
        runs faster (kernels/linear.py); before capture, so the graphs hold the choice."""
        lin = self.ops.linear
        if not self.config.tune_gemm or not hasattr(lin, "tune"):
            return
        lin.recording = set()
        self.executor.graphs.warm([(True, False)])
        shapes, lin.recording = lin.recording, None
        lin.tune(shapes, self.device)

    def _load_drafter(self, model_dir):
        from .drafter import Drafter
        path = self.config.drafter_path
        if path is None:
            path = model_dir / "drafter"
            if not (path / "config.json").exists():
                return None
        elif str(path).lower() == "none":
            return None
        d = Drafter.load(path, self.model, self.device, self.dtype)
        if self.config.gamma and self.config.gamma != d.config.gamma:
            raise ValueError(f"gamma={self.config.gamma} but the drafter was trained with block size "
                             f"{d.config.gamma}; serve with its own gamma (trim with verify_mode instead)")
        return d

    def _window_policy(self):
        from .cost_scheduler import CostScheduler, CostWindows, StaticWindows
        from .cost_table import CostTable
        cfg = self.config
        if self.drafter is None or not self.verify_mode.trims:
            return StaticWindows(self.gamma)
        table = CostTable.load(cfg.cost_table, self.model_name, str(self.dtype),
                               self.device.type, ()) if cfg.cost_table else None
        return CostWindows(CostScheduler(self.gamma, cfg.max_num_seqs, mode=cfg.verify_mode, cost_table=table,
                                         lag=cfg.verify_lag, min_gain=cfg.verify_min_gain))

    def _num_kv_blocks(self, drafter=None) -> int:
        cfg, mc = self.config, self.kv_config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        n_layers = mc.num_hidden_layers + (drafter.config.num_layers if drafter is not None else 0)
        per_block = KVCache.bytes_per_block(mc, n_layers, cfg.block_size, self.dtype)
        if cfg.kv_cache_memory_gb:
            return max(1, int(cfg.kv_cache_memory_gb * 2**30 // per_block))
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * cfg.kv_memory_fraction // per_block))
        return cfg.cpu_kv_blocks

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, queue_limit: bool = True, stream_text: bool = True) -> Request:
        """Validate and queue a request. `queue_limit=False` (offline `generate`) ignores `max_waiting`;
        `stream_text=False` (also `generate`) decodes its text once, when it finishes, not every step."""
        params = (params or SamplingParams()).validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is {self.max_model_len} "
                             "(prompt plus at least one new token)")
        limit = min(len(ids) + params.max_tokens, self.max_model_len)
        worst = limit + self.decode_rows
        for bm in self.scheduler.managers.values():
            if bm.blocks_for(worst) > bm.num_blocks:
                raise ValueError(f"request needs up to {bm.blocks_for(worst)} KV blocks, the cache has "
                                 f"{bm.num_blocks}; lower max_tokens or enlarge the KV cache")
        if queue_limit and len(self.scheduler.waiting) >= self.config.max_waiting:
            raise OverflowError(f"{len(self.scheduler.waiting)} requests are already waiting")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = draw_seed(self.seed_generator) if params.seed is None else (params.seed + 2**63) % 2**64 - 2**63
        req = Request(request_id, ids, params, seed, limit, stream_text=stream_text)
        self.requests[request_id] = req
        self.scheduler.waiting.append(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        return self._finish(req, "abort")

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After an engine-wide fault: finish every request with an error; the engine (its device
        state rebuilt as requests are admitted again) keeps serving new ones."""
        outs = [self._finish(r, "error", error=message) for r in list(self.scheduler.running) +
                list(self.scheduler.waiting)]
        self.loop.forget()
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.loop.pending)

    def kv_usage(self) -> dict:
        return {g: dict(used=bm.num_used_blocks, free=bm.num_free_blocks, total=bm.num_blocks)
                for g, bm in self.scheduler.managers.items()}

    @property
    def decode_rows(self) -> int:
        """Slots a decoding request reserves per step: 1, or anchor + gamma drafts with a drafter."""
        return 1 + self.gamma

    # -- the step: choose -> launch (draft, verify) -> commit -------------------------------
    def step(self) -> list[RequestOutput]:
        return self.loop.step()

    def schedule(self) -> list[tuple[Request, int]]:
        """Choose: (request, rows) for the next step. Raises `Drain` when it must preempt a
        request whose step is in flight."""
        return self.scheduler.schedule(self.decode_rows)

    def launch(self, plan: list[tuple[Request, int]]):
        """Start the step on the device and return its `StepHandle` without waiting. What the
        host already knows is applied here: prefill rows advance `num_computed`, the in-flight
        counters grow, new slots get their sampling parameters, new blocks reach the device."""
        w, sp = self.writes, StepPlan()
        decoding = [req for req, _ in plan if req.is_decoding]
        if decoding:        # first: a policy may refuse the step before anything has changed
            sp.windows = self.windows.plan(decoding, self.executor.steps)
        for req, rows in plan:
            self._sync_state(req)
            if req.is_decoding:
                if not req.device_anchor:      # it became decoding on the host (prompt or prefix hit)
                    w.anchors.append((req.slot, req.num_computed, req.last_id))
                    req.device_anchor = True
                sp.decode.append(req)
                sp.decode_slots.append(req.slot)
                req.inflight += 1
                req.decode_inflight += 1
            else:
                start = req.num_computed
                sample = start + rows >= req.num_tokens
                sp.chunks.append(Chunk(req.slot, start, req.ids(start, start + rows), sample, req.replay_until,
                                       min(t.num_tokens for t in req.tables.values())))
                sp.chunk_owners.append(req)
                req.num_computed += rows
                req.inflight += sample
                req.device_anchor = sample
        reqs = sp.decode + [r for r, c in zip(sp.chunk_owners, sp.chunks) if c.sample]
        sp.greedy_only = all(r.params.greedy for r in reqs)
        sp.truncates = any(r.params.truncates for r in reqs)
        if self.parallel is not None:         # rank 0 sends the step, every rank runs it (distributed.py)
            handle = self.parallel.launch(self, w, sp)
        else:
            self.state.apply(w)
            handle = self.executor.launch(sp)
        if self.eplb is not None:             # close the step's expert loads, in stream order after its forward
            self.eplb.launched()
        return handle

    def _sync_state(self, req: Request) -> None:
        """Queue what the device does not know yet about `req`: its parameters (new slot) and the
        block-table entries allocated since the last step."""
        w = self.writes
        if not req.synced:
            p = req.params
            w.params.append((req.slot, req.limit_len, req.kv_start, p.top_k if not p.greedy else 0, req.seed,
                             0.0 if p.greedy else float(p.temperature), float(p.top_p)))
        for g, t in req.tables.items():
            n = min(req.synced.get(g, 0), len(t.blocks))
            if n < len(t.blocks):
                w.tables.setdefault(g, []).extend((req.slot, i, b) for i, b in enumerate(t.blocks[n:], n))
            req.synced[g] = len(t.blocks)

    def commit(self, result: StepResult) -> list[RequestOutput]:
        """Apply a step's result to its requests; observers see afterwards what was applied (not
        the rows of requests that had finished or whose numbers broke: their confidences are
        stale or NaN, and nothing will settle their statistics)."""
        outs, applied = [], []
        for c in result.commits:
            req = c.request
            if c.verify is not None or c.tokens:
                req.inflight -= 1
            if c.verify is not None:
                req.decode_inflight -= 1
            if req.status == Status.FINISHED:
                continue                      # finished (or aborted) while this step was in flight
            if not c.finite:                  # this request's numbers broke: it fails, the batch goes on
                outs.append(self._finish(req, "error", error="the model produced non-finite logits for this request"))
                continue
            if c.verify is not None:
                req.num_computed += c.advanced
                self._count(req, c.verify)
            outs.append(self._apply(req, c.tokens))
            applied.append(c)
        seen = result if len(applied) == len(result.commits) else dataclasses.replace(result, commits=applied)
        for o in self.observers:
            o.observe(seen)
        return outs

    @property
    def observers(self) -> list:
        return [o for o in (self.windows, self.metrics, self.eplb, *self.extra_observers) if o is not None]

    def _count(self, req: Request, v) -> None:
        s = req.spec
        s.steps += 1
        s.drafted += self.gamma
        s.verified += self.verify_mode.reported_window(v.window, v.verified)
        s.accepted += v.accepted
        s.committed += v.accepted + 1
        if self.verify_mode.reports_ceiling:
            s.ceiling += v.ceiling + 1

    def _apply(self, req: Request, new_ids: list[int]) -> RequestOutput:
        """Commit new tokens, publish full blocks, release window-expired blocks, check stops."""
        accepted, reason = self._accept(req, new_ids)
        if accepted and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids += accepted
        self._settle_blocks(req)
        delta, stop_hit, keep = commit_text(self.tokenizer, req, accepted, final=reason is not None)
        if stop_hit:  # the stop completed at accepted[keep - 1]; commit_text dropped the rest from output_ids
            reason, accepted = "stop", accepted[:keep]
        if reason:
            return self._finish(req, reason, accepted, delta)
        return RequestOutput(req.request_id, accepted, delta, False, None, len(req.prompt_ids),
                             len(req.output_ids), req.spec.as_dict())

    def _accept(self, req: Request, new_ids: list[int]) -> tuple[list[int], str | None]:
        """The new tokens up to and including the first that ends the request: an EOS ("stop"),
        or the one that reaches max_tokens or the context limit ("length"); EOS wins a tie."""
        room = max(1, min(req.params.max_tokens - len(req.output_ids), self.max_model_len - req.num_tokens))
        accepted, reason = new_ids[:room], ("length" if len(new_ids) >= room else None)
        if not req.params.ignore_eos and not self.eos_ids.isdisjoint(accepted):
            end = next(i for i, t in enumerate(accepted) if t in self.eos_ids) + 1
            accepted, reason = accepted[:end], "stop"
        return accepted, reason

    def _settle_blocks(self, req: Request) -> None:
        """After a commit: give back the slots of rejected drafts (not those an in-flight step
        holds), release sliding blocks the window has left, publish blocks that became full."""
        sched = self.scheduler
        keep = max(req.num_tokens, sched.reservation(req, self.decode_rows) if req.decode_inflight else 0)
        for g, t in req.tables.items():
            bm = sched.managers[g]
            if t.num_tokens > keep:
                bm.truncate(t, keep)
            # a block freed here and a new one taken later sit in the same column: re-sync from it
            req.synced[g] = min(req.synced.get(g, 0), len(t.blocks))
            if g == "sliding":      # (a verify window cut short by a stop computed past the last token)
                bm.release_outside_window(t, sched.window_kept, min(req.num_computed, req.num_tokens))
            elif bm.enable_prefix_cache:                # the unpublished tail only: O(new), not O(length)
                start = bm.published_tokens(t)
                if req.num_computed - start >= bm.block_size:     # a block became full
                    bm.commit(t, req.ids(start, req.num_computed), start)

    def _finish(self, req: Request, reason: str, new_ids: list[int] = (), delta: str = "",
                error: str | None = None) -> RequestOutput:
        sched = self.scheduler
        if req in sched.running:
            sched.running.remove(req)
        if req in sched.waiting:
            sched.waiting.remove(req)
        if reason in ("stop", "length"):        # a follow-up may extend it: keep its sliding-window KV
            sched.save_snapshot(req)
        sched.free(req)
        req.status, req.finish_reason, req.finish_time, req.error = Status.FINISHED, reason, time.monotonic(), error
        if self.metrics is not None:
            self.metrics.release(req)
        if reason in ("abort", "error"):
            if not (req.stream_text or req.params.stop) and req.detok_read < len(req.output_ids):
                # never decoded (text decoded at the finish): decode it now, all of it goes out
                delta = commit_text(self.tokenizer, req, req.output_ids[req.detok_read:], final=True).delta
            else:                          # decoded step by step: what was held back goes out
                delta, req.emitted = req.text[req.emitted:], len(req.text)
        return RequestOutput(req.request_id, list(new_ids), delta, True, reason, len(req.prompt_ids),
                             len(req.output_ids), req.spec.as_dict(), error)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op in one process; also runs at exit)."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def release(self, request_id: str) -> None:
        """Forget a finished request (the server calls this once it has answered)."""
        req = self.requests.get(request_id)
        if req is not None and req.status == Status.FINISHED:
            del self.requests[request_id]
