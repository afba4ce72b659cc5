"""The engine: the step, the commit, and the offline API (`LLM`).

One step is four lines (`LLMEngine.step`): the `Scheduler` (scheduler.py) chooses what each
request feeds this step, the `ModelRunner` runs one forward (or, with a drafter, the
`SpecDecoder` drafts and verifies), and the engine applies the typed result: commit tokens,
stop, free. Requests and the records the engine answers with are in request.py; this file also
picks the device and dtype and keeps `PhaseClock`, the host time of each phase of a step.

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
from contextlib import contextmanager

import torch

from .config import EngineConfig
from .detokenizer import commit_text
from .loader import Tokenizer, load_model, resolve_model_dir
from .model import KVCache
from .paged_kv import BlockManager
from .request import GenerationOutput, Request, RequestOutput, SpecStats, Status
from .runner import Chunk, ModelRunner
from .sampling import SamplingParams, make_generator, sample_tokens, target_probs
from .scheduler import Scheduler

# The request records and the scheduler live in request.py and scheduler.py; they are named here
# too, so `from nanodspark.engine import Request` (or `Status`, `Scheduler`, ...) keeps working.
__all__ = ["GenerationOutput", "LLM", "LLMEngine", "PhaseClock", "Request", "RequestOutput", "Scheduler",
           "SpecStats", "Status", "pick_device", "pick_dtype"]


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
        mc.check_max_model_len(self.max_model_len)      # dynamic RoPE: exact only up to max_position_embeddings
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
        delta, stop_hit, keep = commit_text(self.tokenizer, req, accepted, final=reason is not None)
        if stop_hit:  # the stop completed at accepted[keep - 1]; commit_text dropped the rest from output_ids
            reason, accepted = "stop", accepted[:keep]
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
