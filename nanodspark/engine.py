"""The engine: schedule, launch, result, commit (the offline API, `LLM`, is in llm.py).

A step is `LLMEngine.step`'s four phases: the `Scheduler` (scheduler.py) *chooses* what each
request computes; `launch` starts the step on the device without waiting — prefill chunks in one
eager forward, every decoding request in one decode step (speculative.py: draft, choose windows,
verify, accept) replayed from a CUDA graph when a tier fits (ragged_graphs.py); `result` waits
for the device; `commit` applies the typed `StepResult`. Overlapped (on CUDA), step n+1 is
launched before step n's result is read: the host's work for one step hides behind the GPU's
work for the other (walkthrough chapter 11). The anchors and lengths a step needs from the one
before never visit the host (device_state.py), a request with a step in flight reserves KV for
it and the next (scheduler.py), and a row whose request finished meanwhile is dropped at commit.

Host-light. The running requests' counters and tokens are arrays by slot (batch.py); a commit
is a few array operations for the whole batch, and Python runs per request only when something
happens to it: it finishes, streams text or has stop strings, or crosses a KV block.

Continuous batching. A request is `prompt + output`, of which `num_computed` tokens have KV. A
step feeds each running request its next slice: a prefill chunk, or a verify window (one token
without a drafter). A chunk that reaches the end samples the next token on the device. When
blocks run out the most recently admitted request is preempted and recomputed later from its
prompt and output (exact: sampling is keyed, sampling.py); nothing is dropped, and a request
that could never fit is refused at `add_request`.

Failures. A request whose logits are not finite finishes with "error" and the batch goes on;
an exception in a step propagates to the caller, which may call `fail_all` and keep serving.

Invariants: a request's tables cover the positions reserved for it; every row a step computes
has a reserved slot; a finished or aborted request holds no blocks and no slot; `num_computed <=
num_tokens`; a row launched for a slot whose request has since left (its generation changed) is
never applied. Walkthrough chapters 01 and 11.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

from .batch import RunningBatch
from .config import EngineConfig, pick_device
from .detokenizer import commit_text
from .device_state import StateWrites
from .loader import Tokenizer
from .paged_kv import BlockManager
from .request import Request, RequestOutput, Status, StepOutputs
from .runner import Chunk
from .sampling import SamplingParams, draw_seed
from .scheduler import Drain, Schedule, Scheduler
from .step import DecodeRows, StepPlan, StepResult
from .worker import Worker


def auto_token_budget(device: torch.device) -> int:
    """`max_num_batched_tokens` when left at 0. On a GPU a prefill chunk's launches (eager, or one
    graph replay per tier) cost the same at 2k or 8k tokens (chapter 09), so a prompt wave in fewer
    chunks is cheaper; on a CPU a chunk costs its FLOPs, and a smaller one keeps running decodes moving."""
    return 8192 if device.type == "cuda" else 2048


def auto_waiting_steps(graphs: bool) -> int:
    """`max_waiting_steps` left at "auto". With CUDA graphs a decode step is one replay, but a
    step with a prefill in it also runs that prefill, and on a small model it costs several decode
    steps whatever its rows (eager: its launches; graphed: its padded tier's kernels; chapter 01);
    an arrival waiting up to 8 steps lets one prefill serve every arrival of those steps. Without
    graphs every step is eager: no wait."""
    return 8 if graphs else 0


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

    def add(self, name: str, seconds: float) -> None:
        self.total[name] = self.total.get(name, 0.0) + seconds

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
    """The host side of serving: requests, scheduling, commit. The device side (model, caches,
    device state, executor) is a `Worker` (worker.py); with `parallel` (distributed.py), the
    engine runs on rank 0 and every rank holds a `Worker` of its own."""

    def __init__(self, model_path: str | None = None, config: EngineConfig | None = None, parallel=None):
        cfg = config or EngineConfig()
        if cfg.max_num_batched_tokens == 0:
            cfg = dataclasses.replace(cfg, max_num_batched_tokens=auto_token_budget(pick_device(cfg.device)))
        self.config, self.parallel = cfg, parallel   # parallel: None in one process; else rank 0's place
        try:
            self._build(model_path, cfg)
        except BaseException as e:
            if parallel is not None:
                parallel.abort_start(e)       # names a worker that died, if one did
            raise
        if parallel is not None:
            parallel.ready(self.worker)       # the workers start serving steps
            parallel.capture(**self._graphs)  # every rank captures together: the warm-ups run collectives

    def _build(self, model_path, cfg: EngineConfig) -> None:
        self.worker = w = Worker(model_path, cfg, self.parallel)
        # the device side, named here as the engine's own (tests, benches and the server read them)
        self.device, self.dtype, self.model, self.drafter = w.device, w.dtype, w.model, w.drafter
        self.model_config, self.kv_config, self.backend, self.ops = w.model_config, w.kv_config, w.backend, w.ops
        self.kv_cache, self.state, self.runner, self.executor = w.kv_cache, w.state, w.runner, w.executor
        self.gamma, self.eplb, self.verify_mode, self.max_model_len = w.gamma, w.eplb, w.verify_mode, w.max_model_len
        mc = self.model_config
        self.tokenizer = Tokenizer(w.model_dir, mc.eos_token_id) if (w.model_dir / "tokenizer.json").exists() else None
        self.eos_ids = set(self.tokenizer.eos_token_ids if self.tokenizer else mc.eos_token_id)
        # the key of this model's cost table; random weights are named by their shape's directory
        self.model_name = f"{w.model_dir.name} (random weights)" if cfg.load_format == "dummy" \
            else str(model_path or "default")
        if self.decode_rows > cfg.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens={cfg.max_num_batched_tokens} cannot hold one verify window "
                             f"({self.decode_rows} rows = anchor + gamma drafts)")
        if cfg.max_waiting_steps == "auto":
            self.config = cfg = dataclasses.replace(cfg, max_waiting_steps=auto_waiting_steps(w.executor.graphs.use_graphs))
        managers = {g: BlockManager(w.num_blocks, cfg.block_size, cfg.enable_prefix_cache and g != "sliding")
                    for g in w.groups}
        from .swa_replay import look_back
        self.overlap = cfg.overlap and self.device.type == "cuda"    # launch step n+1 before committing n
        self.batch = RunningBatch(cfg.max_num_seqs)
        self.scheduler = Scheduler(cfg, mc, managers, look_back(self.gamma, 2 if self.overlap else 1), self.batch,
                                   w.draft_group)
        self.writes = StateWrites()
        self.windows = self._window_policy()
        from .observers import SpecMetrics
        self.metrics = SpecMetrics(self.gamma, self.verify_mode, self.batch) if self.drafter is not None else None
        self.extra_observers: list = []     # e.g. train_heads' CalibrationRecorder
        self.seed_generator = torch.Generator().manual_seed(cfg.seed)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.clock = PhaseClock()             # host time per phase of `step` (an observer of the phases)
        self.in_flight = None                 # the overlapped step launched and not yet committed
        self._graphs = dict(plain_steps=self.plain_steps, shares=self.draft_shares,
                            lapse=bool(getattr(self._cost_scheduler, "lapse_after", 0)))
        if self.parallel is None:
            w.capture(**self._graphs)

    @property
    def _cost_scheduler(self):
        return getattr(self.windows, "scheduler", None)     # None: static windows

    @property
    def plain_steps(self) -> bool:
        """May this engine run plain steps (compact with the target's own profile, cost_scheduler.py)?"""
        return getattr(self._cost_scheduler, "plain_table", None) is not None

    @property
    def draft_shares(self) -> tuple[float, ...]:
        """The shares of a batch that may draft alone (profiled in the cost file; cost_scheduler.py)."""
        return tuple(sorted(getattr(self._cost_scheduler, "share_tables", {}) or ()))

    def _window_policy(self):
        from .cost_scheduler import CostScheduler, can_trim, warn_static
        from .cost_table import CostTable, lapsed_name, share_name
        from .windows import CostWindows, StaticWindows
        cfg = self.config
        if self.drafter is None or not self.verify_mode.trims:
            return StaticWindows(self.gamma)
        table = CostTable.load(cfg.cost_table, self.model_name, str(self.dtype),
                               self.device.type, ()) if cfg.cost_table else None
        if cfg.verify_mode == "compact" and not can_trim(table):
            # nothing to trim for (no table, or a step that costs the same whatever it verifies):
            # compact is static, so its host work is static's too (the relay, the cost lookups and
            # the ceiling's bookkeeping would be paid every step for nothing)
            warn_static(cfg.verify_mode, stacklevel=4)
            return StaticWindows(self.gamma)
        # a plain step's price, if the same file holds one: then compact may run a plain step where
        # drafting does not pay at all. First the plain step that lets the drafter's context lapse
        # (`bench profile --draft-fraction 0 --lapse`), what a run of them costs, where plain steps
        # may (`verify_lapse_after`); then this engine's own plain step (`--draft-fraction 0`: it
        # keeps the drafter's context); else the target alone (`bench profile-plain`)
        plain = None
        if cfg.cost_table and cfg.verify_mode == "compact" and cfg.verify_plain_steps:
            names = [share_name(self.model_name, 0.0), f"{self.model_name} (no drafter)"]
            for name in [lapsed_name(self.model_name)] * bool(cfg.verify_lapse_after) + names:
                plain = CostTable.load(cfg.cost_table, name, str(self.dtype), self.device.type, ())
                if plain is not None and plain.measurements:
                    break
                plain = None
        # and the profiles of steps where only a share drafts (`bench profile --draft-fraction`), if measured
        shares = {f: CostTable.load(cfg.cost_table, share_name(self.model_name, f), str(self.dtype),
                                    self.device.type, ()) for f in cfg.verify_draft_fractions} if plain else {}
        return CostWindows(CostScheduler(self.gamma, cfg.max_num_seqs, mode=cfg.verify_mode, cost_table=table,
                                         lag=cfg.verify_lag, min_gain=cfg.verify_min_gain, plain_table=plain,
                                         share_tables=shares, plain_hold=cfg.verify_plain_hold,
                                         step_clock=cfg.verify_step_clock, lapse_after=cfg.verify_lapse_after))

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
        self.scheduler.add(req)
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
        self.in_flight = None
        return outs

    @property
    def eos_ids(self) -> set[int]:
        return self._eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self._eos_ids = set(ids)
        # the commit's array form: a table by token id, so any number of EOS ids is one gather
        self.is_eos = np.zeros(max([self.model_config.vocab_size, *(i + 1 for i in self._eos_ids)]), dtype=bool)
        self.is_eos[list(self._eos_ids)] = True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.in_flight)

    def kv_usage(self) -> dict:
        return {g: dict(used=bm.num_used_blocks, free=bm.num_free_blocks, total=bm.num_blocks)
                for g, bm in self.scheduler.managers.items()}

    @property
    def decode_rows(self) -> int:
        """Slots a decoding request reserves per step: 1, or anchor + gamma drafts with a drafter."""
        return 1 + self.gamma

    # -- the step: schedule -> launch -> result -> commit ----------------------------------
    def step(self) -> StepOutputs:
        """One step. Overlapped, the result read and committed is the previous call's: step n+1
        is on the device before the host commits step n (walkthrough chapter 11)."""
        out = StepOutputs()
        with self.phase("schedule"):
            plan = self.schedule(out)
        with self.phase("launch"):
            handle = self.launch(plan) if plan else None
        if self.overlap:                      # the one-step delay: read the step launched last call
            # BEGIN STUDENT overlap delay
            handle, self.in_flight = self.in_flight, handle
            # END STUDENT overlap
        with self.phase("result"):
            result = handle.result() if handle is not None else None
        with self.phase("commit"):
            if result is not None:
                self.commit(result, out)
        self.clock.steps += plan is not None and bool(plan)
        return out

    @contextmanager
    def phase(self, name: str):
        """Time a phase of `step` into the clock (and name it in a torch profile)."""
        t = time.perf_counter()
        with record_function(name) if _profiler_enabled() else nullcontext():   # a marker costs µs unprofiled
            yield
        self.clock.add(name, time.perf_counter() - t)

    def schedule(self, out: StepOutputs | None = None) -> Schedule:
        """Choose this step's work (scheduler.py). A preemption that needs the step in flight read
        first raises `Drain`: commit it, then choose again."""
        try:
            return self.scheduler.schedule(self.decode_rows)
        except Drain:
            # BEGIN STUDENT overlap drain
            handle, self.in_flight = self.in_flight, None
            if handle is not None:
                self.commit(handle.result(), out if out is not None else StepOutputs())
            # END STUDENT overlap
            return self.scheduler.schedule(self.decode_rows)

    def launch(self, sched: Schedule):
        """Start the step on the device and return its `StepHandle` without waiting. What the
        host already knows is applied here: prefill rows advance `num_computed`, the in-flight
        counters grow, new slots get their sampling parameters, new blocks reach the device."""
        b, w, dec = self.batch, self.writes, sched.decode
        plan = StepPlan(decode_slots=dec, decode_generations=b.generation[dec])
        for req in self.scheduler.changed:   # new slots and new blocks: only requests that changed
            self._sync_state(req)
        self.scheduler.changed.clear()
        if len(dec):                         # first: a policy may refuse the step before anything has changed
            plan.windows = self.windows.plan(DecodeRows(dec, plan.decode_generations, None, b.req[dec]),
                                             self.executor.steps)
            if plan.windows.order is not None:       # the rows that draft go first (speculative.py)
                dec = plan.decode_slots = dec[plan.windows.order]
                plan.decode_generations = b.generation[dec]
            if not plan.windows.upkeep:              # their drafter contexts now have holes
                b.lapsed[dec] = True
            for req in sched.joined:         # it became decoding on the host (prompt or prefix hit)
                if not req.device_anchor:
                    w.anchors.append((req.slot, req.num_computed, req.last_id))
                    req.device_anchor = True
            b.inflight[dec] += 1
            b.decode_inflight[dec] += 1
        sampled = []
        for req, rows in sched.prefill:
            start = req.num_computed
            sample = start + rows >= req.num_tokens
            plan.chunks.append(Chunk(req.slot, start, req.ids(start, start + rows), sample, req.replay_until,
                                     min(t.num_tokens for t in req.tables.values())))
            plan.chunk_owners.append(req)
            req.num_computed += rows
            req.inflight += sample
            req.device_anchor = sample
            if sample:
                sampled.append(req)
        plan.greedy_only = bool(b.greedy[dec].all()) and all(r.params.greedy for r in sampled)
        plan.truncates = bool(b.truncates[dec].any()) or any(r.params.truncates for r in sampled)
        if self.parallel is not None:         # rank 0 sends the step, every rank runs it (distributed.py)
            handle = self.parallel.launch(w, plan)
        else:
            self.state.apply(w)
            handle = self.executor.launch(plan)
        if self.eplb is not None:             # close the step's expert loads, in stream order after its forward
            self.eplb.launched()
        return handle

    def _sync_state(self, req: Request) -> None:
        """Queue what the device does not know yet about `req`: its parameters (new slot) and the
        block-table entries allocated since it was last synced."""
        w = self.writes
        if req.slot < 0:
            return
        if not req.synced:
            p = req.params
            w.params.append((req.slot, req.limit_len, req.kv_start, p.top_k if not p.greedy else 0, req.seed,
                             0.0 if p.greedy else float(p.temperature), float(p.top_p)))
        for g, t in req.tables.items():
            n = min(req.synced.get(g, 0), len(t.blocks))
            if n < len(t.blocks):
                w.tables.setdefault(g, []).extend((req.slot, i, blk) for i, blk in enumerate(t.blocks[n:], n))
            req.synced[g] = len(t.blocks)

    def commit(self, result: StepResult, out: StepOutputs) -> None:
        """Apply a step's result: the prefill chunks one by one, the decode rows all at once; then
        the observers see what was applied (not the rows of requests that had finished or whose
        numbers broke: their confidences are stale or NaN, and nothing will settle them)."""
        for r in result.prefill:
            self._commit_chunk(r, out)
        seen = result
        if result.decode is not None:
            applied = self._commit_decode(result.decode, out)
            if applied is not result.decode:
                seen = dataclasses.replace(result, decode=applied)
        for o in self.observers:
            o.observe(seen)

    def _commit_chunk(self, r, out: StepOutputs) -> None:
        req = r.request
        if r.token is None:                   # a chunk inside the prompt: publish what became full
            if req.status != Status.FINISHED:
                self.scheduler.settle(req, 0)
            return
        req.inflight -= 1
        if req.status == Status.FINISHED:     # finished (or aborted) while this step was in flight
            return
        if not r.finite:
            out.add(self._finish(req, "error", error="the model produced non-finite logits for this request"))
            return
        out.add(self._apply(req, [r.token]))

    def _commit_decode(self, d: DecodeRows, out: StepOutputs) -> DecodeRows:
        """Commit every decode row with array operations; returns the rows applied (`d` itself when
        all were: no copy). A request's object is touched only if it finishes, needs its text, or
        crosses a KV block."""
        b, s = self.batch, d.slots
        d.requests = b.req[s]                                    # (before any of them finishes below)
        live = b.live[s] & (b.generation[s] == d.generations)    # the request of the row is still here
        b.inflight[s] -= live                                    # (a step's slots are distinct)
        b.decode_inflight[s] -= live
        applied = live & (d.out.finite != 0)
        if not applied.all():
            for i in np.flatnonzero(live & ~applied).tolist():   # its numbers broke: it fails alone
                out.add(self._finish(b.req[s[i]], "error",
                                     error="the model produced non-finite logits for this request"))
            d = d.select(applied)
        s, o = d.slots, d.out
        count, toks = o.count, o.tokens
        before = b.num_computed[s]
        end = before + count
        b.num_computed[s] = end
        self._count(s, o, d.plain)
        # the new tokens up to and including the first that ends the request: an EOS ("stop"), or the
        # one that reaches max_tokens or the context limit ("length"); EOS wins a tie
        n_out = b.out_len[s]        # limit_len - prompt_len = min(max_tokens, max_model_len - prompt_len)
        room = np.maximum(1, b.limit_len[s] - b.prompt_len[s] - n_out)
        take = np.minimum(count, room)
        length = count >= room
        eos = self.is_eos[toks] & (np.arange(toks.shape[1]) < take[:, None])
        stop = eos.any(1) & ~b.ignore_eos[s]
        take = np.where(stop, eos.argmax(1) + 1, take)
        b.append_rows(s, toks, take)
        own = stop | length | b.text[s]                 # these get a RequestOutput of their own below
        quiet = ~own
        out.add_rows(d.requests[quiet], toks[quiet], take[quiet], b.spec[s[quiet]], b.out_len[s[quiet]])
        # Python only for the rows that need it
        S = self.scheduler.settle_tokens                 # runs of blocks (scheduler.py), and the window's
        W = self.scheduler.window_kept % S               # edge (a shift by whole runs crosses the same ones)
        crossed = end // S > before // S
        if W:
            crossed |= (end - W) // S > (before - W) // S
        first = n_out == 0
        for i in (own | crossed | first).nonzero()[0].tolist():
            req = d.requests[i]
            if first[i] and req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if crossed[i]:
                self.scheduler.settle(req, int(before[i]))
            if own[i]:
                new = toks[i, :take[i]].tolist()
                out.add(self._text(req, new, "stop" if stop[i] else "length" if length[i] else None))
        return d

    @property
    def observers(self) -> list:
        return [o for o in (self.windows, self.metrics, self.eplb, *self.extra_observers) if o is not None]

    def _count(self, slots: np.ndarray, o, plain: bool) -> None:
        """The rows' SpecStats, all at once (request.py names the counters, in this order)."""
        if not self.gamma:
            return
        mode, count, spec = self.verify_mode, o.count, self.batch.spec
        if plain:                                      # a plain step: one step, its tokens, no drafts
            spec[slots, 0] += 1
            spec[slots, 4] += count
            return
        add = np.empty((len(slots), self.batch.spec.shape[1]), dtype=np.int64)
        add[:, 0], add[:, 1] = 1, self.gamma * o.drafted                      # steps, drafted
        add[:, 2] = np.minimum(o.windows, o.verified) if mode.trims else o.verified
        add[:, 3], add[:, 4] = count - 1, count                               # accepted, committed
        add[:, 5] = o.ceiling + 1 if mode.reports_ceiling else 0
        spec[slots] += add

    def _apply(self, req: Request, new_ids: list[int]) -> RequestOutput:
        """Commit one request's new tokens (a prefill sample): stops, text, blocks."""
        old = req.num_computed
        accepted, reason = self._accept(req, new_ids)
        req.append_output(accepted)
        if accepted and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.scheduler.settle(req, old)
        return self._text(req, accepted, reason)

    def _text(self, req: Request, accepted: list[int], reason: str | None) -> RequestOutput:
        """The text of the tokens just appended, stop strings, and the finish if this ends it."""
        delta, stop_hit, keep = commit_text(self.tokenizer, req, accepted, final=reason is not None)
        if stop_hit:  # the stop completed at accepted[keep - 1]; commit_text dropped the rest from the output
            reason, accepted = "stop", accepted[:keep]
        if reason:
            return self._finish(req, reason, accepted, delta)
        return RequestOutput(req.request_id, accepted, delta, False, None, len(req.prompt_ids),
                             req.num_output, req.spec.as_dict())

    def _accept(self, req: Request, new_ids: list[int]) -> tuple[list[int], str | None]:
        """The new tokens up to and including the first that ends the request: an EOS ("stop"),
        or the one that reaches max_tokens or the context limit ("length"); EOS wins a tie."""
        room = max(1, min(req.params.max_tokens - req.num_output, self.max_model_len - req.num_tokens))
        accepted, reason = new_ids[:room], ("length" if len(new_ids) >= room else None)
        if not req.params.ignore_eos and not self.eos_ids.isdisjoint(accepted):
            end = next(i for i, t in enumerate(accepted) if t in self.eos_ids) + 1
            accepted, reason = accepted[:end], "stop"
        return accepted, reason

    def _finish(self, req: Request, reason: str, new_ids: list[int] = (), delta: str = "",
                error: str | None = None) -> RequestOutput:
        sched = self.scheduler
        if reason in ("stop", "length"):        # a follow-up may extend it: keep its sliding-window KV
            sched.save_snapshot(req)
        if self.metrics is not None:
            self.metrics.release(req)
        sched.finish(req)
        req.status, req.finish_reason, req.finish_time, req.error = Status.FINISHED, reason, time.monotonic(), error
        if reason in ("abort", "error"):
            if not (req.stream_text or req.params.stop) and req.detok_read < req.num_output:
                # never decoded (text decoded at the finish): decode it now, all of it goes out
                delta = commit_text(self.tokenizer, req, req.output_ids[req.detok_read:], final=True).delta
            else:                          # decoded step by step: what was held back goes out
                delta, req.emitted = req.text[req.emitted:], len(req.text)
        return RequestOutput(req.request_id, list(new_ids), delta, True, reason, len(req.prompt_ids),
                             req.num_output, req.spec.as_dict(), error)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op in one process; also runs at exit)."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def release(self, request_id: str) -> None:
        """Forget a finished request (the server calls this once it has answered)."""
        req = self.requests.get(request_id)
        if req is not None and req.status == Status.FINISHED:
            del self.requests[request_id]
