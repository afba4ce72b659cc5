"""The step-cost profile of the loaded pair (`python -m nanodspark.bench profile`, on the GPU).

The cost scheduler (cost_scheduler.py) needs T(bs, K), the seconds of one verify step with bs
requests and K extra (draft) verify tokens, measured on this device; `cost_table.py` holds the
table (isotonic forcing, lookup) and `profile_stats.py` its statistics (rounds, round-adjusted
estimate, trend gate). This file supplies what is timed. Walkthrough: chapter 07 §4 and §9; figures: chapter 09 §5a.

`whole_step_runner` times whole `engine.step()` calls of bs decoding requests built from mixed
workload prompts, with the windows forced to add up to K (`windows.ForcedWindows`, on an
engine built in the compact verify mode, so a window below gamma is verified as given) and no
draft committed (`VerifyOnly`, swapped into the decode step: every K commits the same tokens,
so the table prices verifying, not committing), the batch rebuilt untimed whenever a request has grown `DEFAULT_CONTEXT_SLACK`
tokens (a fixed context). `--loop` picks the loop the steps run in: `sync` waits for the GPU
after each step (a step's host and GPU time, added); `overlap` times a step of a running
overlapped pipeline (the untimed settle step of the same shape is in flight when it starts), so
a timed step is the time between two results, max(host, GPU) -- what a step costs the engine
that serves. The default, `auto`, is the engine's own loop (overlapped on CUDA).

Paper-scale shapes without their checkpoints: `--shape qwen3-8b` (or `qwen3-30b-a3b`) instead
of `--model` builds the pair from a temporary directory holding only config.json, the default
tokenizer and DSpark's default drafter config (lab/shapes.py), with random weights
(`load_format="dummy"`): a step's cost does not depend on the weight values. The table's notes
say `random_weights` and the shape, and so does the output. (What random weights change: the
router of a MoE shape spreads tokens over the experts about evenly, and drafts are almost never
accepted, which the default `--acceptance none` does not read anyway.)

KV memory: `--kv-gb 0` (the default) sizes the cache for the largest batch at the profiled
context (`kv_blocks_needed`); an explicit `--kv-gb` too small for it is refused before anything
is timed, since a batch that does not fit would be preempted and rebuilt, never profiled.

Invariants: a profile leaves the engine as it found it (no request, no KV block, no forced
window, its own verify mode); prefills and rebuilds are never timed; each K is what the target verifies.
"""
from __future__ import annotations

import sys

import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..cost_table import lapsed_name, share_name
from .bench_engine import bench_prompts


DEFAULT_CONTEXT_SLACK = 16   # tokens a profiled request may grow past its prompt before the batch is rebuilt
LOOPS = ("auto", "sync", "overlap")
SHAPE_HEADROOM = 1024        # --shape: max_model_len = context + this (a profiled request never nears it)
KV_MARGIN = 1.1              # automatic KV sizing: blocks for the largest batch, plus this share


def drain(eng) -> None:
    """Let the overlapped step in flight land (untimed, outside the phase clock). Called once the
    batch is aborted, so the engine's own step schedules nothing and only commits that step: a
    rebuild, or the end of a profile, leaves no step of the old batch on the device."""
    with eng.clock.paused():
        while eng.in_flight is not None:
            eng.step()


def profiled_loop(eng, loop: str) -> bool:
    """True if the profile runs overlapped (`loop`: auto = the engine's own loop)."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, not {loop!r}")
    return eng.config.overlap if loop == "auto" else loop == "overlap"


def whole_step_runner(llm, context_len: int, prompts: list[list[int]] | None = None,
                      context_slack: int = DEFAULT_CONTEXT_SLACK, commit_drafts: bool = False,
                      loop: str = "sync", draft_fraction: float = 1.0, upkeep: bool = True):
    """run_step(bs, K): one real `engine.step()` of bs decoding requests whose windows add up to
    K (`ForcedWindows` forces them): draft, verify, acceptance, sampling, KV injection and
    bookkeeping, everything the cost scheduler actually trades against. Requests are created
    (prefilled untimed) when bs changes, from `prompts` (cycled; each cut to its last
    `context_len` tokens) or, without them, `context_len` random tokens. Every step commits
    tokens, so `run_step.prepare(bs, k)` (untimed; `profile_step_cost` calls it before each
    point) rebuilds the batch from the same prompts once a request has grown by more than
    `context_slack` tokens: the table is measured at a fixed context, as the scheduler reads it.
    (Without that, the context grew by ~600 tokens over bs 256's grid and the step time with it,
    round after round: 46 ms in the first round, 110 ms in the last, on the H200.)

    Real prompts make the steps look like traffic: requests have different lengths (random
    prompts all cross a KV block boundary on the same step) and the drafter sees real text.
    Unless `commit_drafts`, no draft is committed (accept cap 0): every step
    then commits one token per request at every K, so the table holds the cost of *verifying*
    K tokens and not the per-token work of committing more of them, which the scheduler must
    not count (speculative.py says why; on the H200 it was most of bs 256's rise with K).

    `draft_fraction` < 1: only the first ceil(fraction * bs) requests run the drafter's pass and
    the K drafts are theirs (`ForcedShare`): the cost of the cost scheduler's partial steps;
    with fraction 0 and `upkeep=False`, the plain step that lets the drafter's context lapse."""
    import random
    from ..sampling import SamplingParams
    from ..verify import VerifyMode
    from ..windows import ForcedWindows
    eng = llm.engine
    if eng.drafter is None or eng.verify_mode is not VerifyMode.COMPACT:
        raise ValueError("the whole-step profile needs a drafter and an engine in the compact verify mode")
    if eng.has_unfinished():
        raise ValueError("the whole-step profile needs an idle engine")
    # sync: each timed call is one step with its own K, committed before it returns. overlap: a
    # call launches a step with K and commits the one before it (the settle step, of the same K),
    # without waiting for its own: its time is the pipeline's period. `close` restores the engine.
    gamma, policy, overlap, mode = eng.gamma, eng.windows, eng.overlap, eng.executor.spec.mode
    eng.overlap = profiled_loop(eng, loop)
    if not commit_drafts:
        use_mode(eng, VerifyOnly())
    if not upkeep and draft_fraction != 0.0:
        raise ValueError("only a plain step (draft fraction 0) lets the drafter's context lapse")
    if draft_fraction < 1.0:
        tiers = eng.executor.draft_tiers.get(draft_fraction)
        if tiers is None:
            raise ValueError(f"draft fraction {draft_fraction} is not one of the engine's "
                             f"verify_draft_fractions {eng.config.verify_draft_fractions}")
        if eng.executor.graphs.graphs:        # the partial step's graphs, with the profile's verify mode
            eng.executor.graphs.capture([(True, False, draft_fraction) + (() if upkeep else (False,))],
                                        progress=False, tiers=tiers)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    state = {"bs": None, "ids": [], "reqs": []}
    phases: dict[int, dict] = {}         # host ms per phase of the timed steps, per batch size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max(1, eng.max_model_len - context_len - 1),
                            ignore_eos=True)
    vocab = eng.model_config.vocab_size

    def prompt(i: int) -> list[int]:
        if prompts:
            return list(prompts[i % len(prompts)][-context_len:])
        return [rng.randrange(vocab) for _ in range(context_len)]

    def rebuild(bs: int) -> None:
        """Abort the batch and prefill bs fresh requests (untimed, kept out of the phase clock)."""
        for rid in state["ids"]:
            eng.abort(rid)
        drain(eng)
        if bs > eng.config.max_num_seqs:
            raise ValueError(f"batch size {bs} > max_num_seqs {eng.config.max_num_seqs}")
        # no text in the step, as serve.py's engine core and LLM.generate add requests: decoding
        # text every step is host work serving never does (7 us a row on the H200's host)
        reqs = [eng.add_request(prompt(i), params, queue_limit=False, stream_text=False) for i in range(bs)]
        state["ids"], state["reqs"] = [r.request_id for r in reqs], reqs
        eng.windows = ForcedWindows(gamma, lambda rs: [gamma] * len(rs))
        sched = eng.scheduler
        with eng.clock.paused():
            while any(not r.is_decoding for r in sched.running) or sched.waiting:
                eng.step()
                if all(r.is_decoding for r in sched.running) and not sched.waiting:
                    break

    def prepare(bs: int, k: int) -> None:
        if state["bs"] != bs:                # a new batch size: close the previous one's phases
            if state["bs"] is not None:
                phases[state["bs"]] = eng.clock.per_step_ms()
            eng.clock.reset()
            rebuild(bs)
            state["bs"] = bs
        elif max(r.num_output for r in state["reqs"]) > context_slack:
            rebuild(bs)
            state["rebuilds"] = state.get("rebuilds", 0) + 1

    def run_step(bs: int, k: int) -> None:
        if state["bs"] != bs:
            prepare(bs, k)
        if draft_fraction < 1.0:
            eng.windows = ForcedShare(gamma, k, draft_fraction, upkeep)
        else:
            eng.windows = ForcedWindows(gamma, lambda rs: [k // len(rs) + (1 if r < k % len(rs) else 0)
                                                          for r in range(len(rs))])
        eng.step()
        if not eng.overlap:
            sync()

    def close() -> None:
        if state["bs"] is not None:
            phases[state["bs"]] = eng.clock.per_step_ms()
        for rid in state["ids"]:
            eng.abort(rid)
        drain(eng)
        eng.windows, eng.overlap = policy, overlap
        if eng.executor.spec.mode is not mode:
            use_mode(eng, mode)
    run_step.close = close
    run_step.phases = phases
    run_step.prepare = prepare
    run_step.state = state
    return run_step


class ForcedShare:
    """The profile's window policy for a partial step: the first ceil(fraction * R) requests
    draft, and K drafts are spread over them as evenly as it goes."""

    def __init__(self, gamma: int, k: int, fraction: float, upkeep: bool = True):
        self.gamma, self.k, self.fraction, self.upkeep = gamma, k, fraction, upkeep

    def plan(self, rows, step):
        from ..step import WindowPlan
        R = len(rows.slots)
        D = min(R, math.ceil(self.fraction * R))
        caps = np.zeros(R, dtype=np.int64)
        if D:
            caps[:D] = np.minimum(self.gamma, self.k // D + (np.arange(D) < self.k % D))
        return WindowPlan(int(caps.sum()), False, caps, draft=self.fraction, upkeep=self.upkeep)

    def observe(self, result) -> None:
        pass


class VerifyOnly:
    """The profile's verify mode: the target verifies each forced window, as in compact, and no
    draft is committed (each step commits the target's own token), so the context grows by one
    token per step at every K. A lab object with `VerifyMode`'s interface: the engine never
    builds it, it is swapped into the decode step for the profile and out again after."""
    trims, reports_ceiling, verifies_window = True, False, True

    def verified(self, window, gamma):
        return window

    def cap(self, window, gamma):
        return window * 0

    def reported_window(self, window, verified):
        return min(window, verified)


def use_mode(eng, mode) -> None:
    """Put `mode` in the engine's decode step; captured graphs hold the old one: capture again."""
    ex = eng.executor
    ex.spec.mode = mode
    if ex.graphs.graphs:
        ex.graphs.drop()
        ex.graphs.capture([(True, False), (False, False)], progress=False)


DEFAULT_K_POINTS = 8   # extra-verify-token points per batch size besides K = 0


def k_grid(bs: int, gamma: int, points: int = DEFAULT_K_POINTS) -> list[int]:
    """K values profiled at batch size bs: 0 and `points` evenly spaced up to bs * gamma. The
    step cost is a staircase in the verify rows (GEMM tiles, kernel variants), so a coarse grid
    lets the fitted model interpolate across a step that the scheduler then trims into."""
    full = bs * gamma
    return sorted({0, full} | {round(full * i / points) for i in range(1, points + 1)})


def profile(args) -> dict:
    from .profile_stats import DEFAULT_TREND_Z, profile_step_cost
    t_start = time.perf_counter()
    # prefix caching off, as in `bench dspark`: its block hashing is host time per step
    # compact: a forced window below gamma is verified as given
    llm, source = build_profiled_llm(args, drafter=True, verify_mode="compact")
    if llm.engine.drafter is None:
        raise SystemExit("profiling needs a drafter (the target alone has no verify step)")
    g = llm.engine.gamma
    f = getattr(args, "draft_fraction", 1.0)
    if not 0.0 <= f <= 1.0:
        raise SystemExit(f"--draft-fraction must lie in [0, 1], not {f}")
    # a partial step (f < 1) verifies the drafts of its ceil(f * bs) drafting requests only
    ks = lambda bs: k_grid(math.ceil(f * bs), g, getattr(args, "k_points", DEFAULT_K_POINTS))   # noqa: E731
    print_plan(args, {b: ks(b) for b in args.batch_sizes})
    prompts = None
    if getattr(args, "prompts", "random") == "mix":
        ps = bench_prompts("mix", max(args.batch_sizes), getattr(args, "data_dir", None))
        prompts = [llm.tokenizer.encode(p.render()) for p in ps]
    loop = getattr(args, "loop", "auto")
    lapse = getattr(args, "lapse", False)
    if lapse and f != 0.0:
        raise SystemExit("--lapse profiles a plain step: it needs --draft-fraction 0")
    runner = whole_step_runner(llm, args.context, prompts,
                               commit_drafts=getattr(args, "acceptance", "none") == "traffic", loop=loop,
                               draft_fraction=f, upkeep=not lapse)
    try:
        table = profile_step_cost(runner, args.batch_sizes, ks,
                                  repeats=args.repeats, monotone=getattr(args, "monotone", "isotonic"),
                                  estimator=getattr(args, "estimator", "rounds"),
                                  trend_z_min=None if getattr(args, "no_trend_gate", False)
                                  else getattr(args, "trend_z", DEFAULT_TREND_Z),
                                  model_name=lapsed_name(source["model_name"]) if lapse else
                                  share_name(source["model_name"], f) if f < 1 else source["model_name"],
                                  dtype=str(llm.engine.dtype),
                                  device=llm.engine.device.type)
    finally:
        getattr(runner, "close", lambda: None)()
    table.notes = {**table.notes, "command": "python -m nanodspark.bench " + " ".join(sys.argv[1:]), "context": args.context, "scope": "whole", "repeats": args.repeats,
                   "cuda_graphs": bool(llm.engine.executor.graphs.use_graphs), "overlap": llm.engine.config.overlap,
                   "loop": "overlap" if profiled_loop(llm.engine, loop) else "sync",
                   "prefix_cache": False, "acceptance": getattr(args, "acceptance", "none"),
                   "prompts": getattr(args, "prompts", "random"),
                   "monotone": getattr(args, "monotone", "isotonic"),
                   "estimator": getattr(args, "estimator", "rounds"),
                   "context_slack": DEFAULT_CONTEXT_SLACK,
                   "rebuilds": getattr(runner, "state", {}).get("rebuilds", 0),
                   "phases_ms_by_bs": getattr(runner, "phases", {}),
                   **source["notes"], **finish_notes(llm, t_start)}
    for b, ph in table.notes["phases_ms_by_bs"].items():
        print(f"bs {b}: host ms per step by phase (all K; warm-up round and kernel compiles included) "
              + " ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)     # CostTable.save writes into an existing folder
    table.save(args.out)
    print(f"saved {args.out}; flat={table.is_flat()}{source['banner']}")
    return table.to_json()


# ----------------------------------------------------------------------------- what is profiled
def kv_blocks_needed(batch: int, context: int, gamma: int, block_size: int,
                     slack: int = DEFAULT_CONTEXT_SLACK) -> int:
    """KV blocks per group that `batch` profiled requests hold at most: the context, the slack it
    may grow before a rebuild, a verify window in flight and the next (anchor + gamma rows
    each), rounded up to a block, plus the run of blocks a decoding request reserves ahead
    (scheduler.SETTLE_BLOCKS)."""
    from ..scheduler import SETTLE_BLOCKS
    tokens = context + slack + 2 * (1 + gamma) + 1
    return batch * (-(-tokens // block_size) + SETTLE_BLOCKS)


def build_profiled_llm(args, drafter: bool, **engine_kwargs):
    """(LLM, source) for a profile: the checkpoint of `--model` (or the default pair), or, with
    `--shape`, the shape's model directory (lab/shapes.py) in a temporary folder and random
    weights (`load_format="dummy"`). The KV cache holds the largest batch at the profiled
    context: sized for it when `--kv-gb` is 0, refused if an explicit `--kv-gb` is smaller.
    `source`: model_name (the table's key), notes (random_weights, shape, kv), banner (printed)."""
    from .. import LLM
    from ..config import EngineConfig, ModelConfig
    from ..drafter import DSPARK_GAMMA
    from ..loader import resolve_model_dir
    from .shapes import describe, materialize
    shape = getattr(args, "shape", None)
    bs_max, context = max(args.batch_sizes), args.context
    block_size = EngineConfig().block_size
    kv_gb = getattr(args, "kv_gb", 0.0) or 0.0
    kw = dict(use_tqdm=False, max_num_seqs=bs_max, enable_prefix_cache=False, **engine_kwargs)
    if not drafter:
        kw["drafter_path"] = "none"
    with tempfile.TemporaryDirectory(prefix="nanodspark-shape-") as tmp:
        if shape is not None:
            model_dir = materialize(shape, Path(tmp) / shape, drafter=drafter)
            gamma = json.loads((model_dir / "drafter" / "config.json").read_text())["gamma"] if drafter else 0
            max_model_len = context + SHAPE_HEADROOM
            # graph tiers at the profiled batch sizes only: each bs replays the tier it would
            # replay among the default ones (they are default tiers), with far fewer captures
            kw.update(load_format="dummy", max_model_len=max_model_len,
                      graph_batch_sizes=tuple(sorted(set(args.batch_sizes))))
            banner = f"; RANDOM WEIGHTS ({shape})"
            print(f"RANDOM WEIGHTS, shape {describe(shape)}" if drafter else
                  f"RANDOM WEIGHTS, shape {describe(shape).split('; drafter')[0]} (no drafter)")
        else:
            model_dir = resolve_model_dir(args.model)
            dfile = model_dir / "drafter" / "config.json"
            gamma = (json.loads(dfile.read_text()).get("gamma", DSPARK_GAMMA) if dfile.exists() else DSPARK_GAMMA) \
                if drafter else 0
            max_model_len = ModelConfig.from_json(model_dir).max_position_embeddings
            banner = ""
        need = kv_blocks_needed(bs_max, context, gamma, block_size)
        one = -(-(max_model_len + 1 + gamma) // block_size) + 1      # one request at the context limit
        if kv_gb:
            kw["kv_cache_memory_gb"] = kv_gb
        else:
            kw["num_kv_blocks"] = max(int(need * KV_MARGIN) + 1, one)
        llm = LLM(str(model_dir) if shape is not None else args.model, **kw)
    eng = llm.engine
    model_name = eng.model_name               # the key the engine looks its cost table up by
    have = eng.worker.num_blocks
    if have < need:
        per_block = kv_bytes(eng) / have
        raise SystemExit(f"--kv-gb {kv_gb} holds {have} KV blocks per group; batch {bs_max} at context {context} "
                         f"needs {need} ({need * per_block / 2**30:.2f} GiB): raise --kv-gb, or pass 0 to size it "
                         "automatically")
    mem = memory_report(eng)
    print(f"memory: target weights {mem['target_weights_gib']:.2f} GiB, drafter {mem['drafter_weights_gib']:.2f} GiB, "
          f"KV {mem['kv_gib']:.2f} GiB = {have} blocks x {block_size} tokens per group (batch {bs_max} at context "
          f"{context} needs {need}); CUDA graphs and activations come on top")
    notes = {"random_weights": shape is not None, "shape": shape, "kv_blocks": have, "kv_blocks_needed": need,
             **mem}
    return llm, {"model_name": model_name, "notes": notes, "banner": banner}


def kv_bytes(eng) -> int:
    """Bytes of the engine's KV caches: the target's groups and the drafter's context cache."""
    w = eng.worker
    caches = list(w.kv_cache.tensors.values()) + ([w.draft_cache] if w.draft_cache is not None else [])
    return sum(t.numel() * t.element_size() for t in caches)


def memory_report(eng) -> dict:
    """GiB of the target's weights, the drafter's (the shared embedding and head counted once,
    with the target) and the KV caches, as allocated."""
    def size(m):
        return sum(p.numel() * p.element_size() for p in m.parameters()) if m is not None else 0
    return {"target_weights_gib": round(size(eng.model) / 2**30, 3),
            "drafter_weights_gib": round(size(eng.drafter) / 2**30, 3),
            "kv_gib": round(kv_bytes(eng) / 2**30, 3)}


def print_plan(args, ks: dict[int, list[int]]) -> None:
    """How many engine steps the profile runs (its warm-up round and settle steps included; the
    untimed prefills of each rebuild are not), before it starts."""
    from .profile_stats import DEFAULT_SETTLE, DEFAULT_WARMUP
    points = sum(len(v) for v in ks.values())
    steps = points * (DEFAULT_WARMUP + args.repeats * (1 + DEFAULT_SETTLE))
    print(f"plan: {points} (bs, K) points, {steps} engine steps ({args.repeats} timed rounds)")


def finish_notes(llm, t_start: float) -> dict:
    """What the run cost: its wall seconds (start-up, capture and rebuilds included) and, on
    CUDA, the peak memory allocated."""
    out = {"wall_s": round(time.perf_counter() - t_start, 1)}
    dev = llm.engine.device
    if dev.type == "cuda":
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    print("run: " + ", ".join(f"{k} {v}" for k, v in out.items()))
    return out


def add_source_args(p, default_help: str) -> None:
    """--model DIR or --shape NAME (random weights), not both."""
    from .shapes import SHAPES
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, help=f"target checkpoint directory; none: {default_help}")
    g.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a model shape with random weights, no checkpoint (lab/shapes.py): step costs at paper "
                        "scale")


def add_profile_args(p) -> None:
    add_source_args(p, "the shipped default pair")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256], help="batch sizes profiled")
    p.add_argument("--context", type=int, default=256,
                   help="prompt tokens per request (mix prompts are cut to their last --context tokens)")
    p.add_argument("--prompts", choices=("mix", "random"), default="mix",
                   help="mixed workload prompts (acceptance and lengths like traffic) or random tokens")
    p.add_argument("--data-dir", default=None,
                   help="workload data; none: $NANODSPARK_DATA, else ../shared/data, else .carry/data")
    p.add_argument("--estimator", choices=("rounds", "median"), default="rounds",
                   help="cost per point: median over rounds with each round's level removed "
                        "(robust to slow stretches of the machine) or the plain median")
    p.add_argument("--trend-z", type=float, default=1.645,
                   help="flatten a batch size whose step time does not rise with K at this Mann-Kendall z "
                        "(1.645: one-sided 5 %%)")
    p.add_argument("--no-trend-gate", action="store_true", help="keep every batch size's slope, significant or not")
    p.add_argument("--acceptance", choices=("none", "traffic"), default="none",
                   help="commit no draft while profiling, so every K commits one token per "
                        "request (none), or commit what the target accepts (traffic; counts per-token work as "
                        "verify cost)")
    p.add_argument("--monotone", choices=("isotonic", "max"), default="isotonic",
                   help="how noisy medians are made non-decreasing in K: least-squares isotonic fit "
                        "(a stalled point becomes a small step) or running maximum (a cliff)")
    p.add_argument("--k-points", type=int, default=DEFAULT_K_POINTS,
                   help="extra-verify-token values per batch size (evenly spaced up to bs * gamma)")
    p.add_argument("--repeats", type=int, default=5, help="rounds per point; the estimator combines them")
    p.add_argument("--draft-fraction", type=float, default=1.0,
                   help="profile the cost scheduler's partial step: only this share of the batch drafts "
                        "(one of the engine's verify_draft_fractions); the table is keyed '<model> (draft F)'")
    p.add_argument("--lapse", action="store_true",
                   help="with --draft-fraction 0: the plain step that lets the drafter's context lapse "
                        "(deep in a run of plain steps); the table is keyed '<model> (lapsed)'")
    add_loop_arg(p)
    p.add_argument("--kv-gb", type=float, default=0.0,
                   help="KV cache memory (GiB); 0 = sized for the largest batch at the context")
    p.add_argument("--out", default="cost_table.json", help="the cost table (JSON) to write")


def add_loop_arg(p) -> None:
    p.add_argument("--loop", choices=LOOPS, default="auto",
                   help="time steps of the synchronous loop (host + GPU) or of a running overlapped pipeline "
                        "(max(host, GPU): what the serving loop pays); auto: the engine's own loop")
