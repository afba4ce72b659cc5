"""The engine: requests, continuous batching, the KV budget, and the step.

One step is four lines (`LLMEngine.step`): the `Scheduler` chooses what each request feeds this
step, the `ModelRunner` runs one forward (or, with a drafter, the `SpecDecoder` drafts and
verifies), and the engine applies the typed result: commit tokens, stop, free.

Continuous batching. Every request is a token list `prompt + output` of which the first
`num_computed` have KV in the cache. A step feeds each running request the next slice of that
list: a prefill chunk, or the single last token (decode). When a slice reaches the end of the
list, its last row's logits sample one new token. Prefill and decode of different requests mix
freely in one forward under a token budget (`max_num_batched_tokens`), so a long prompt is
prefilled in chunks while others keep decoding.

KV budget. A request is admitted when its prompt's blocks fit. When a running request cannot
grow, the most recently admitted request is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed from its prompt *and* its output so far (recompute is
exact under greedy decoding, and seeded sampling keeps its generator). No request is dropped;
one that could never fit in the whole cache is refused at `add_request` with a `ValueError`.

Invariants: a request's block tables cover exactly its reserved tokens; every row a step
computes has a reserved slot (a decoding request reserves its whole verify window, also when it
is admitted decoding after a full prefix hit); a finished or aborted request holds no blocks;
`num_computed <= len(prompt) + len(output)`. Walkthrough chapter 01.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

import torch

from .config import EngineConfig, ModelConfig
from .detokenizer import detokenize
from .loader import Tokenizer, load_model, resolve_model_dir
from .model import KVCache
from .paged_kv import BlockManager, BlockTable, NoFreeBlocks
from .runner import Chunk, ModelRunner
from .sampling import SamplingParams, make_generator, sample_tokens, target_probs
from .swa_replay import plan_replay


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculative counters of one request (paper names: tau = committed per verify step)."""
    steps: int = 0          # verify steps
    drafted: int = 0        # draft tokens produced (gamma per step)
    verified: int = 0       # draft tokens the target verified (the windows)
    accepted: int = 0       # draft tokens accepted
    committed: int = 0      # tokens committed by verify steps (accepted + 1 each)
    ceiling: int = 0        # cap-accept: tokens a full-block verify would have committed

    def as_dict(self) -> dict:
        tau = self.committed / self.steps if self.steps else 0.0
        d = dict(steps=self.steps, drafted=self.drafted, verified=self.verified,
                 accepted=self.accepted, committed=self.committed, tau=round(tau, 4))
        if self.ceiling:
            d["ceiling"] = self.ceiling
        return d


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    tables: dict[str, BlockTable] = field(default_factory=dict)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    replay_until: int = 0                 # SWA replay rows (see swa_replay.py)
    kv_start: int = 0
    text: str = ""                        # decoded output so far (= decode(output_ids[:detok_read]))
    emitted: int = 0                      # characters of `text` already streamed
    detok_prefix: int = 0                 # incremental detokenizer (detokenizer.py): the decode window starts here
    detok_read: int = 0                   # ... and `text` covers output_ids[:detok_read]
    spec: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None  # when the first output token was committed (TTFT)
    finish_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt + output as a new list: O(length), so not for per-step paths (`ids`, `last_id`)."""
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (per-step paths: cost ~ the slice)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return self.prompt_ids[start:stop] + (self.output_ids[:stop - n] if stop > n else [])

    @property
    def last_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_decoding(self) -> bool:
        return self.num_computed == self.num_tokens - 1


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    spec: dict


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    spec: dict


def _triton_interpreting() -> bool:
    import os
    import kernels  # noqa: F401  (sets TRITON_INTERPRET on CPU while it still can)
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ----------------------------------------------------------------------------- scheduling
class Scheduler:
    """Admission, chunked prefill, preemption. Owns the queues and the block managers."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, managers: dict[str, BlockManager]):
        self.cfg, self.model_cfg, self.managers = cfg, model_cfg, managers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.n_sliding = model_cfg.layer_types.count("sliding_attention")

    # -- block bookkeeping, over all KV groups ----------------------------------------------
    def _allocate(self, req: Request) -> None:
        """Tables for all of the request's tokens; prefix hit on the full group (atomic)."""
        ids = req.all_ids
        cached = [bm for g, bm in self.managers.items() if g != "sliding"]
        cap = min((bm.match_prefix(ids) for bm in cached), default=0)  # a hit must hold in every group
        tables = {}
        try:
            for g, bm in self.managers.items():
                tables[g] = _fresh(bm, len(ids)) if g == "sliding" else bm.allocate_prompt(ids, cap)
        except NoFreeBlocks:
            for g, t in tables.items():
                self.managers[g].free(t)
            raise
        hit = tables["full"].num_cached_tokens if "full" in tables else 0
        plan = plan_replay(hit, self.model_cfg.sliding_window, self.n_sliding, self.cfg.swa_replay_tokens)
        req.tables, req.num_computed = tables, plan.start
        req.replay_until, req.kv_start = plan.replay_until, plan.start

    def _grow(self, req: Request, num_tokens: int) -> None:
        done = []
        try:
            for g, bm in self.managers.items():
                before = req.tables[g].num_tokens
                bm.ensure_capacity(req.tables[g], num_tokens)
                done.append((g, before))
        except NoFreeBlocks:
            for g, before in done:
                self.managers[g].truncate(req.tables[g], before)
            raise

    def free(self, req: Request) -> None:
        for g, t in req.tables.items():
            self.managers[g].free(t)
        req.tables = {}

    def preempt(self, req: Request) -> None:
        self.free(req)
        self.running.remove(req)
        req.status, req.num_computed = Status.WAITING, 0
        self.waiting.appendleft(req)

    # -- one step ---------------------------------------------------------------------------
    @staticmethod
    def _rows(req: Request, decode_rows: int, budget: int) -> int:
        """Rows a request computes this step: a whole verify window when it is decoding (only its
        last token lacks KV), else the next prefill chunk that fits the token budget."""
        return decode_rows if req.is_decoding else min(req.num_tokens - req.num_computed, budget)

    def schedule(self, decode_rows: int = 1) -> list[tuple[Request, int]]:
        """(request, rows) pairs for this step. A decoding request reserves `decode_rows` slots
        (1, or 1 + gamma when the step verifies drafts)."""
        budget = self.cfg.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []
        for req in list(self.running):
            if req not in self.running or budget <= 0:
                continue
            rows = self._rows(req, decode_rows, budget)
            if rows > budget:  # a verify window does not fit the token budget: wait a step
                continue
            while True:
                try:
                    self._grow(req, req.num_computed + rows)
                    break
                except NoFreeBlocks:
                    victim = self.running[-1]
                    self.preempt(victim)
                    plan = [(r, n) for r, n in plan if r is not victim]
                    if victim is req:
                        break
            if req in self.running:
                plan.append((req, rows))
                budget -= rows
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            try:
                self._allocate(req)
            except NoFreeBlocks:
                break
            # A prefix hit can leave only the last token to compute: then the request decodes in
            # this very step and needs slots for a whole verify window, not only for its tokens.
            rows = self._rows(req, decode_rows, budget)
            fits = rows <= budget
            if fits:
                try:
                    self._grow(req, req.num_computed + rows)
                except NoFreeBlocks:
                    fits = False
            if not fits:              # stays first in the queue, as if never allocated
                self.free(req)
                req.num_computed = 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.append((req, rows))
            budget -= rows
        return plan


def _fresh(bm: BlockManager, n: int) -> BlockTable:
    t = BlockTable()
    bm.ensure_capacity(t, n)
    return t


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
    def __init__(self, model_path: str | None = None, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        model_dir = resolve_model_dir(model_path)
        self.model = load_model(model_dir, dtype=self.dtype, device=self.device)
        self.model_config = mc = self.model.config
        self.tokenizer = Tokenizer(model_dir, mc.eos_token_id) if (model_dir / "tokenizer.json").exists() else None
        self.eos_ids = set(self.tokenizer.eos_token_ids if self.tokenizer else mc.eos_token_id)
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        self.backend = cfg.attention_backend
        if self.backend == "auto":
            self.backend = "triton" if self.device.type == "cuda" else "torch"
        if self.backend == "triton" and self.device.type != "cuda" and not _triton_interpreting():
            raise ValueError("attention_backend='triton' needs CUDA (or, for tests, TRITON_INTERPRET=1 "
                             "set before Triton is imported); use 'torch' on CPU")
        self.model_name = str(model_path or "default")  # the key of this model's cost table
        drafter = self._load_drafter(model_dir)
        num_blocks = self._num_kv_blocks(drafter)
        self.kv_cache = KVCache(mc, {g: num_blocks for g in ("full", "sliding")}, cfg.block_size, self.dtype, self.device)
        managers = {g: BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_cache and g == "full")
                    for g in self.kv_cache.layout}
        self.spec = None
        self.clock = PhaseClock()
        if drafter is not None:
            managers["draft"] = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_cache)
            self.spec = self._make_spec(drafter, managers["draft"], num_blocks)
        if self.decode_rows > cfg.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens={cfg.max_num_batched_tokens} cannot hold one verify window "
                             f"({self.decode_rows} rows = anchor + gamma drafts)")
        self.scheduler = Scheduler(cfg, mc, managers)
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend, self.device)
        self.default_generator = make_generator(cfg.seed, self.device, None)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

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

    def _make_spec(self, drafter, manager, num_blocks):
        from .cost_scheduler import CostScheduler
        from .cost_table import CostTable
        from .speculative import SpecDecoder
        dc, cfg = drafter.config, self.config
        cache = torch.zeros(dc.num_layers, 2, num_blocks, cfg.block_size, dc.num_key_value_heads, dc.head_dim,
                            dtype=self.dtype, device=self.device)
        table = CostTable.load(cfg.cost_table, self.model_name, str(self.dtype),
                               self.device.type, ()) if cfg.cost_table else None
        sched = CostScheduler(dc.gamma, cfg.max_num_seqs + cfg.max_waiting + 1, mode=cfg.verify_mode, cost_table=table,
                              lag=cfg.verify_lag, min_gain=cfg.verify_min_gain)
        return SpecDecoder(drafter, manager, cache, cfg.verify_mode, sched, cfg.max_num_seqs + cfg.max_waiting + 1)

    def _num_kv_blocks(self, drafter=None) -> int:
        cfg, mc = self.config, self.model_config
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
                    request_id: str | None = None, queue_limit: bool = True) -> Request:
        """Validate and queue a request. `queue_limit=False` (offline `generate`) ignores `max_waiting`."""
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
        worst = min(len(ids) + params.max_tokens, self.max_model_len) + self.decode_rows
        for bm in self.scheduler.managers.values():
            if bm.blocks_for(worst) > bm.num_blocks:
                raise ValueError(f"request needs up to {bm.blocks_for(worst)} KV blocks, the cache has "
                                 f"{bm.num_blocks}; lower max_tokens or enlarge the KV cache")
        if queue_limit and len(self.scheduler.waiting) >= self.config.max_waiting:
            raise OverflowError(f"{len(self.scheduler.waiting)} requests are already waiting")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, ids, params, make_generator(params.seed, self.device, self.default_generator))
        self.requests[request_id] = req
        self.scheduler.waiting.append(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        if req in self.scheduler.running:
            self.scheduler.running.remove(req)
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        self.scheduler.free(req)
        return self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def kv_usage(self) -> dict:
        return {g: dict(used=bm.num_used_blocks, free=bm.num_free_blocks, total=bm.num_blocks)
                for g, bm in self.scheduler.managers.items()}

    @property
    def decode_rows(self) -> int:
        """Slots a decoding request reserves per step: 1, or anchor + gamma drafts with a drafter."""
        return 1 + (self.spec.gamma if self.spec else 0)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.clock.start()                                   # host time per phase (bench dspark)
        plan = self.scheduler.schedule(self.decode_rows)     # choose
        if not plan:
            return []
        self.clock.lap("schedule")
        commits = self.spec.step(self, plan) if self.spec else self.forward_and_sample(plan)  # draft -> verify
        outs = [self._apply(req, toks) for req, toks in commits]  # commit
        self.clock.lap("apply")
        self.clock.steps += 1
        return outs

    def forward_and_sample(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, list[int]]]:
        chunks = [self.chunk_of(req, rows) for req, rows in plan]
        result = self.runner.forward(chunks)
        commits = self.sample_commits(plan, chunks, result.logits, result.logit_offsets)
        self.clock.lap("forward")
        return commits

    def chunk_of(self, req: Request, rows: int, extra: list[int] = (), logit_rows: str | None = None) -> Chunk:
        start = req.num_computed
        ids = req.ids(start, start + rows - len(extra)) + list(extra)
        sampling = start + rows - len(extra) >= req.num_tokens
        return Chunk(req.tables, start, ids, logit_rows or ("last" if sampling else "none"),
                     req.replay_until, req.kv_start)

    def sample_commits(self, plan, chunks, logits, offsets):
        """Advance `num_computed` and sample one token for every chunk that reached the end."""
        commits, rows, reqs = [], [], []
        for i, ((req, n), c) in enumerate(zip(plan, chunks)):
            req.num_computed += len(c.token_ids)
            if c.logit_rows == "last":
                rows.append(offsets[i])
                reqs.append(req)
            else:
                commits.append((req, []))
        if reqs:
            params = [r.params for r in reqs]
            toks = sample_tokens(target_probs(logits[rows], params), params, [r.generator for r in reqs]).tolist()
            commits += [(r, [t]) for r, t in zip(reqs, toks)]
        return commits

    def _apply(self, req: Request, new_ids: list[int]) -> RequestOutput:
        """Commit new tokens, publish full blocks, release window-expired blocks, check stops."""
        sched = self.scheduler
        accepted = []
        reason = None
        for t in new_ids:
            accepted.append(t)
            if t in self.eos_ids and not req.params.ignore_eos:
                reason = "stop"
                break
            if len(req.output_ids) + len(accepted) >= req.params.max_tokens or \
                    req.num_tokens + len(accepted) >= self.max_model_len:
                reason = "length"
                break
        if accepted and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids += accepted
        for g, t in req.tables.items():
            bm = sched.managers[g]
            bm.truncate(t, min(t.num_tokens, req.num_tokens))  # drop rejected speculative slots
            if g == "sliding":
                bm.release_outside_window(t, self.model_config.sliding_window, req.num_computed)
            elif bm.enable_prefix_cache:                # the unpublished tail only: O(new), not O(length)
                start = bm.published_tokens(t)
                bm.commit(t, req.ids(start, req.num_computed), start)
        delta, stop_hit = detokenize(self.tokenizer, req, accepted, final=reason is not None)
        if stop_hit:
            reason = "stop"
        if reason:
            sched.running.remove(req)
            sched.free(req)
            return self._finish(req, reason, accepted, delta)
        return RequestOutput(req.request_id, accepted, delta, False, None, len(req.prompt_ids),
                             len(req.output_ids), req.spec.as_dict())

    def _finish(self, req: Request, reason: str, new_ids: list[int] = (), delta: str = "") -> RequestOutput:
        req.status, req.finish_reason, req.finish_time = Status.FINISHED, reason, time.monotonic()
        if self.spec is not None:
            self.spec.release(req)
        if reason == "abort" and req.text:
            delta, req.emitted = req.text[req.emitted:], len(req.text)
        return RequestOutput(req.request_id, list(new_ids), delta, True, reason, len(req.prompt_ids),
                             len(req.output_ids), req.spec.as_dict())

    def release(self, request_id: str) -> None:
        """Forget a finished request (the server calls this once it has answered)."""
        req = self.requests.get(request_id)
        if req is not None and req.status == Status.FINISHED:
            del self.requests[request_id]


# ----------------------------------------------------------------------------- offline API
class LLM:
    """`LLM(model_path, **engine_kwargs).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model_path: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(model_path, EngineConfig.from_kwargs(**engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield the `RequestOutput`s of one request as its tokens are committed (a verify step
        can commit several at once). Closing the iterator early aborts the request."""
        eng = self.engine
        req = eng.add_request(prompt, params, queue_limit=False)
        try:
            while req.status != Status.FINISHED:
                for out in eng.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            if req.status != Status.FINISHED:
                eng.abort(req.request_id)
            eng.release(req.request_id)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[GenerationOutput]:
        from tqdm.auto import tqdm
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        eng = self.engine
        reqs = [eng.add_request(p, sp, queue_limit=False) for p, sp in zip(prompts, plist)]
        show = self.engine.config.use_tqdm if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(reqs), desc="generate", disable=not show)
        while any(r.status != Status.FINISHED for r in reqs):
            for out in eng.step():
                if out.finished:
                    bar.update(1)
        bar.close()
        results = [GenerationOutput(r.request_id, r.prompt_ids, r.output_ids, r.text, r.finish_reason,
                                    r.spec.as_dict()) for r in reqs]
        for r in reqs:
            eng.release(r.request_id)
        return results
