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
tokens (a fixed context). With the overlapped loop a timed step is the time between two steps'
results, which is what the cost scheduler trades against.

Invariants: a profile leaves the engine as it found it (no request, no KV block, no forced
window, its own verify mode); prefills and rebuilds are never timed; each K is what the target verifies.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .bench_engine import bench_prompts


DEFAULT_CONTEXT_SLACK = 16   # tokens a profiled request may grow past its prompt before the batch is rebuilt


def whole_step_runner(llm, context_len: int, prompts: list[list[int]] | None = None,
                      context_slack: int = DEFAULT_CONTEXT_SLACK, commit_drafts: bool = False):
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
    not count (speculative.py says why; on the H200 it was most of bs 256's rise with K)."""
    import random
    from ..sampling import SamplingParams
    from ..verify import VerifyMode
    from ..windows import ForcedWindows
    eng = llm.engine
    if eng.drafter is None or eng.verify_mode is not VerifyMode.COMPACT:
        raise ValueError("the whole-step profile needs a drafter and an engine in the compact verify mode")
    if eng.has_unfinished():
        raise ValueError("the whole-step profile needs an idle engine")
    # Synchronous steps: each timed call is one step with its own K, committed before it returns.
    # (The runner waits for the GPU after every step, so an overlapped step would hide nothing; it
    # would only commit each K one call late.) `close` gives the engine its own setting back.
    gamma, policy, overlap, mode = eng.gamma, eng.windows, eng.overlap, eng.executor.spec.mode
    eng.overlap = False
    if not commit_drafts:
        use_mode(eng, VerifyOnly())
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
        if bs > eng.config.max_num_seqs:
            raise ValueError(f"batch size {bs} > max_num_seqs {eng.config.max_num_seqs}")
        reqs = [eng.add_request(prompt(i), params, queue_limit=False) for i in range(bs)]
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
        eng.windows = ForcedWindows(gamma, lambda rs: [k // len(rs) + (1 if r < k % len(rs) else 0)
                                                      for r in range(len(rs))])
        eng.step()
        sync()

    def close() -> None:
        if state["bs"] is not None:
            phases[state["bs"]] = eng.clock.per_step_ms()
        for rid in state["ids"]:
            eng.abort(rid)
        eng.windows, eng.overlap = policy, overlap
        if eng.executor.spec.mode is not mode:
            use_mode(eng, mode)
    run_step.close = close
    run_step.phases = phases
    run_step.prepare = prepare
    run_step.state = state
    return run_step


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
    from .. import LLM
    from .profile_stats import DEFAULT_TREND_Z, profile_step_cost
    # prefix caching off, as in `bench dspark`: its block hashing is host time per step
    # compact: a forced window below gamma is verified as given
    llm = LLM(args.model, use_tqdm=False, max_num_seqs=max(args.batch_sizes), kv_cache_memory_gb=args.kv_gb,
              enable_prefix_cache=False, verify_mode="compact")
    if llm.engine.drafter is None:
        raise SystemExit("profiling needs a drafter (the target alone has no verify step)")
    g = llm.engine.gamma
    prompts = None
    if getattr(args, "prompts", "random") == "mix":
        ps = bench_prompts("mix", max(args.batch_sizes), getattr(args, "data_dir", None))
        prompts = [llm.tokenizer.encode(p.render()) for p in ps]
    runner = whole_step_runner(llm, args.context, prompts,
                               commit_drafts=getattr(args, "acceptance", "none") == "traffic")
    try:
        table = profile_step_cost(runner, args.batch_sizes,
                                  lambda bs: k_grid(bs, g, getattr(args, "k_points", DEFAULT_K_POINTS)),
                                  repeats=args.repeats, monotone=getattr(args, "monotone", "isotonic"),
                                  estimator=getattr(args, "estimator", "rounds"),
                                  trend_z_min=None if getattr(args, "no_trend_gate", False)
                                  else getattr(args, "trend_z", DEFAULT_TREND_Z),
                                  model_name=str(args.model or "default"), dtype=str(llm.engine.dtype),
                                  device=llm.engine.device.type)
    finally:
        getattr(runner, "close", lambda: None)()
    table.notes = {**table.notes, "context": args.context, "scope": "whole", "repeats": args.repeats,
                   "cuda_graphs": bool(llm.engine.executor.graphs.use_graphs), "overlap": llm.engine.config.overlap,
                   "prefix_cache": False, "acceptance": getattr(args, "acceptance", "none"),
                   "prompts": getattr(args, "prompts", "random"),
                   "monotone": getattr(args, "monotone", "isotonic"),
                   "estimator": getattr(args, "estimator", "rounds"),
                   "context_slack": DEFAULT_CONTEXT_SLACK,
                   "rebuilds": getattr(runner, "state", {}).get("rebuilds", 0),
                   "phases_ms_by_bs": getattr(runner, "phases", {})}
    for b, ph in table.notes["phases_ms_by_bs"].items():
        print(f"bs {b}: host ms per step by phase (all K; warm-up round and kernel compiles included) "
              + " ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)     # CostTable.save writes into an existing folder
    table.save(args.out)
    print(f"saved {args.out}; flat={table.is_flat()}")
    return table.to_json()


def add_profile_args(p) -> None:
    p.add_argument("--model", default=None, help="target checkpoint directory; none: the shipped default pair")
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
    p.add_argument("--kv-gb", type=float, default=4.0, help="KV cache memory (GB)")
    p.add_argument("--out", default="cost_table.json", help="the cost table (JSON) to write")
