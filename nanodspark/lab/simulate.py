"""Predict serving throughput from a step-cost table and acceptance traces (`bench simulate`).

The idea
    A serving run is a sequence of engine steps, and each step is three decisions and a price.
    The scheduler picks the rows in its three passes: decoding requests by slot, 1 + gamma rows
    of the token budget each; running requests still prefilling, their next chunk, in admission
    order; then new admissions while slots and budget last. The window policy picks each decoding request's
    window: full blocks (static), or the cost scheduler's budget from confidences `lag` steps
    old and the top-K rule over the fresh ones (compact). The step costs
        T(R, K) + host_s + [prefill rows > 0] prefill_s + prefill_token_s * prefill rows
    seconds (`StepCost`: R decoding requests, K the draft budget, T from the profiled table).
    A decoding request then commits min(window, A, room) + 1 tokens, where A is what a
    full-block verify accepted at that step of its recorded trace (lab/traces.py) and room what
    its max_tokens leaves. This file runs that loop in virtual time for C closed-loop clients
    and reports what `bench serve` reports, through the same `summarize`.

    The window policy is the engine's own code, fed the recorded confidences: `StaticWindows`,
    `CostWindows(CostScheduler(...))` (the relay and `budget_from_lagged`) and
    `topk_windows` (the top-K rule). So compact is simulated with what the engine runs.

Approximations (what makes it a model, and its output a prediction)
    * Acceptance is replayed by step: request i replays, in order, the verify steps of a recorded
      request with the same prompt (cycling if it needs more). A trimmed window shortens what a
      step commits, not the trace, so compact is replayed from a static trace approximately;
      a system replayed from its own traces follows the engine step for step (a test holds it).
    * Cost: the table, plus a per-step host term and a prefill cost (`calibrate` fits both from
      a measured run). No KV limit: preemption is not simulated (the accounting of a measured
      run says whether there was any). One step after another: with a table profiled in the
      overlapped loop (`--loop overlap`, the default on CUDA) a step's T is that loop's period,
      host and GPU overlapped; with a synchronous table, their sum.
    * `scale_traces` makes traces of another τ (and gamma): each step's conditional confidences
      c_k become c_k ** beta (beta by bisection so that the mean of 1 + Σ_k Π_{i<=k} c_i**beta is
      the target) and A is drawn from them (calibrated by construction). Output from scaled
      traces is labelled a prediction at that τ everywhere.

Invariants: the same request i (prompt, output length) as `bench serve`; every result says
`"kind": "prediction"`; nothing here reads a clock.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..scheduler import admission_due
from ..config import EngineConfig
from ..cost_scheduler import DEFAULT_LAG, DEFAULT_MIN_GAIN, CostScheduler, topk_windows
from ..step import DecodeRows
from ..windows import CostWindows, StaticWindows
from ..cost_table import CostTable, share_of
from .bench_serve import Run, RequestRecord, ServeWorkload, median_rows, paired_ratios, summarize
from .traces import LAPSED, PLAIN, RequestTrace, Traces

DEFAULT_LAPSE_AFTER = EngineConfig().verify_lapse_after   # the engine's: plain steps before the context lapses


# ----------------------------------------------------------------------------- the price of a step
@dataclass
class StepCost:
    """Seconds of one engine step. `table`: T(R, K) of speculative steps (`bench profile`);
    `plain`: T(R, 0) of steps without a drafter (`bench profile-plain`); without it, no
    speculation is priced at T(R, 0) of `table`, which still holds the drafter's pass."""
    table: CostTable | None
    plain: CostTable | None = None
    host_s: float = 0.0
    prefill_s: float = 0.0
    prefill_token_s: float = 0.0
    shares: dict | None = None        # fraction -> T(R, K) with that share drafting (`profile --draft-fraction`)
    lapsed: CostTable | None = None   # the plain step letting the drafter's context lapse (`profile --lapse`)

    def decode_seconds(self, R: int, K: int, spec: bool = True, drafting: int | None = None) -> float:
        """K < 0: a plain step of a speculative engine (the ledger's mark), priced by its own
        profile (share 0, `profile --draft-fraction 0`) if given, else as no speculation; K =
        LAPSED, one that lets the drafter's context lapse, by its profile (`--lapse`) if given.
        `drafting` < R rows running the drafter's pass: the profile of the share f with
        ceil(f * R) = drafting rows (as the engine drafts), else `table`'s price (an upper bound)."""
        if spec and K == LAPSED and self.lapsed is not None:
            return self.lapsed.predict(R, 0)
        if spec and K < 0 and 0.0 in (self.shares or {}):
            return self.shares[0.0].predict(R, 0)
        spec = spec and K >= 0
        if spec and drafting is not None and drafting < R:
            f = next((f for f in sorted(self.shares or {}) if math.ceil(f * R) == drafting), None)
            if f is not None:
                return self.shares[f].predict(R, K)
        t = self.table if spec or self.plain is None else self.plain
        return t.predict(R, K if spec else 0)

    def plain_step(self, lapse: bool = False) -> CostTable | None:
        """The price of a speculative engine's plain step, as the engine picks it (engine.py):
        with `lapse` (plain steps may let the drafter's context lapse) the lapsed one's first."""
        return (self.lapsed if lapse else None) or (self.shares or {}).get(0.0) or self.plain

    def partial_shares(self) -> dict | None:
        """The shares 0 < f < 1 (the cost scheduler's partial steps)."""
        return {f: t for f, t in self.shares.items() if 0.0 < f < 1.0} if self.shares else self.shares

    def step_seconds(self, R: int, K: int, prefill_rows: int, spec: bool = True, drafting: int | None = None) -> float:
        s = self.host_s + (self.decode_seconds(R, K, spec, drafting) if R else 0.0)
        return s + (self.prefill_s + self.prefill_token_s * prefill_rows if prefill_rows else 0.0)


def load_table(path, key: str | None = None, plain: bool = False) -> CostTable:
    """The cost table in a JSON file (`CostTable.save`'s layout): the one under `key`, or the
    only one of its kind (`plain`: the target's own, keyed "... (no drafter)"; a file may hold
    both, as the engine reads them, and the profiles of partial steps, keyed "... (draft F)")."""
    tables = json.loads(Path(path).read_text())
    if key is None:
        kind = [k for k in tables if k.split("|")[0].endswith("(no drafter)") == plain
                and share_of(k.split("|")[0]) is None and not k.split("|")[0].endswith("(lapsed)")] or list(tables)
        if len(kind) != 1:
            raise SystemExit(f"{path} holds {len(tables)} tables; name one with --table-key: {list(tables)}")
        key = kind[0]
    return CostTable.from_json(tables[key])


def load_lapsed(path) -> CostTable | None:
    """The lapsed plain step's profile in a cost file (`bench profile --draft-fraction 0 --lapse`), if any."""
    tables = [CostTable.from_json(v) for v in json.loads(Path(path).read_text()).values()]
    return next((t for t in tables if t.model_name.endswith("(lapsed)")), None)


def load_shares(path) -> dict[float, CostTable]:
    """The partial steps' profiles in a cost file (`bench profile --draft-fraction F`), by F."""
    tables = [CostTable.from_json(v) for v in json.loads(Path(path).read_text()).values()]
    return {share_of(t.model_name): t for t in tables if share_of(t.model_name) is not None}


# ----------------------------------------------------------------------------- the simulated engine
@dataclass(eq=False)
class _Request:
    index: int
    prompt_len: int
    max_tokens: int
    trace: RequestTrace | None
    rec: RequestRecord
    slot: int = -1
    generation: int = 0
    computed: int = 0          # prompt rows with KV
    out: int = 0               # output tokens committed
    pos: int = 0               # the next step of its trace
    verified: int = 0          # drafts verified (its SpecStats, for the by-workload figures)

    @property
    def decoding(self) -> bool:
        return self.out > 0


def trace_picker(traces: Traces | None, n_prompts: int):
    """Request i -> the trace it replays: request i's own if it was recorded (`bench serve` names
    requests "r<i>"), else the longest recorded request with the same prompt (j = i mod
    n_prompts), else the traces in turn."""
    if traces is None or not traces.requests:
        return lambda i: None
    by_id = {t.request_id: t for t in traces.requests}
    by_prompt: dict[int, RequestTrace] = {}
    for t in traces.requests:
        if t.request_id[1:].isdigit() and n_prompts:
            k = int(t.request_id[1:]) % n_prompts
            if k not in by_prompt or len(t.full) > len(by_prompt[k].full):
                by_prompt[k] = t
    reqs = traces.requests
    return lambda i: by_id.get(f"r{i}") or by_prompt.get(i % n_prompts) or reqs[i % len(reqs)]


def simulate_closed_loop(system: str, work: ServeWorkload, traces: Traces | None, cost: StepCost, concurrency: int,
                         warmup_s: float, duration_s: float, num_requests: int = 0, gamma: int | None = None,
                         max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, lag: int = DEFAULT_LAG,
                         min_gain: float = DEFAULT_MIN_GAIN, max_waiting_steps: int = 0,
                         waiting_served_ratio: float = 0.25, lapse_after: int = DEFAULT_LAPSE_AFTER) -> Run:
    """One closed-loop run of `system` ("no-spec", "static", "compact", or a static/compact
    variant) in virtual time; the same loop, window and figures as bench_serve.engine_closed_loop."""
    spec = system != "no-spec"
    g = (gamma if gamma is not None else traces.gamma) if spec else 0
    if spec and (traces is None or traces.gamma != g):
        raise ValueError(f"{system} needs traces of gamma {g}")
    compact = system.startswith("compact")
    # plain steps, and steps where only some requests draft, where drafting all does not pay;
    # deep in a run of plain steps the drafter's context lapses (not in compact-keep)
    lapse_after = 0 if system == "compact-keep" else lapse_after
    plain = (cost.plain_step(lapse_after > 0) if system in ("compact", "compact-no-partial", "compact-keep")
             else None)
    policy = (CostWindows(CostScheduler(g, max_num_seqs, mode="compact", cost_table=cost.table, lag=lag,
                                        min_gain=1e9 if system == "compact-no-trim" else min_gain, plain_table=plain,
                                        share_tables=None if system == "compact-no-partial" else cost.partial_shares(),
                                        lapse_after=lapse_after))
              if compact else StaticWindows(g))
    pick = trace_picker(traces if spec else None, len(work.prompts))
    free = list(range(max_num_seqs))[::-1]
    generation = [0] * max_num_seqs
    running: list[_Request] = []
    waiting: deque[_Request] = deque()
    records, t, step, i, n_measured, in_window, waited = [], 0.0, 0, 0, 0, 0, 0
    t0 = warmup_s
    t1 = t0 + duration_s if not num_requests else math.inf
    while True:
        live = running + list(waiting)
        over = t >= t1 or bool(num_requests and n_measured >= num_requests)
        if over and not any(r.rec.measured for r in live):
            if num_requests:
                t1 = t
            break
        measuring = t >= t0 and not over
        for _ in range(concurrency - len(live)):            # the closed loop: top up to C
            ids, wl, max_tokens = work.request(i)
            rec = RequestRecord(i, wl, t, measuring)
            records.append(rec)
            n_measured += measuring
            waiting.append(_Request(i, len(ids), max_tokens, pick(i), rec))
            i += 1
        # choose (scheduler.py's three passes): decoding requests by slot, a window each; running
        # requests still prefilling, in order, the next chunk; then admissions
        budget, chunks = max_num_batched_tokens, []
        decoding = sorted((r for r in running if r.decoding), key=lambda r: r.slot)
        decode = [(r, 1 + g) for r in decoding[:max(budget, 0) // (1 + g)]]
        budget -= (1 + g) * len(decode)
        for r in running:
            if budget <= 0:
                break
            if not r.decoding:
                chunks.append((r, min(r.prompt_len - r.computed, budget)))
                budget -= chunks[-1][1]
        due = admission_due(len(waiting), len(decode), bool(chunks), waited, max_waiting_steps, waiting_served_ratio)
        waited = 0 if due or not waiting else waited + 1
        while due and waiting and budget > 0 and len(running) < max_num_seqs:
            r = waiting.popleft()
            r.slot = free.pop()
            generation[r.slot] += 1
            r.generation = generation[r.slot]
            running.append(r)
            chunks.append((r, min(r.prompt_len, budget)))
            budget -= chunks[-1][1]
        # windows (the engine's policy, the recorded confidences) and the price
        D = [r for r, _ in decode]
        K, windows, conf = 0, np.zeros(len(D), dtype=np.int64), np.zeros((len(D), g), dtype=np.float32)
        drafting = len(D)                                   # rows that run the drafter's pass
        if D and g:
            slots = np.array([r.slot for r in D], dtype=np.int64)
            gens = np.array([r.generation for r in D], dtype=np.int64)
            wp = policy.plan(DecodeRows(slots, gens, None, np.array(D, dtype=object)), step)
            if wp.order is not None:                        # the drafting rows first, as the engine launches
                D, slots, gens = [D[i] for i in wp.order], slots[wp.order], gens[wp.order]
            drafting = min(len(D), math.ceil(wp.draft * len(D)))
            conf = np.stack([r.trace.conf[r.pos % len(r.trace.full)] for r in D])
            conf[drafting:] = 0.0                           # no draft, no confidence
            windows = (topk_windows(torch.from_numpy(conf), wp.budget).numpy() if wp.trim
                       else np.full(len(D), g))
            if wp.window_cap is not None:
                windows = np.minimum(windows, wp.window_cap)
            windows[drafting:] = 0
            K = wp.budget if wp.trim or wp.window_cap is None else int(sum(wp.window_cap))   # as the ledger prices it
            if not drafting:                                # a plain step: the ledger's mark
                K = PLAIN if wp.upkeep else LAPSED
        t += cost.step_seconds(len(D), K, sum(n for _, n in chunks), spec, drafting)
        # commit
        finished = []
        for r, rows in chunks:
            r.computed += rows
            if r.computed >= r.prompt_len:                  # the last prefill row samples the first token
                r.out = 1
                r.rec.chunks.append((t, 1))
        for row, (r, w) in enumerate(zip(D, windows)):
            a = 0
            if g and row < drafting:
                full = int(r.trace.full[r.pos % len(r.trace.full)])
                room = max(0, r.max_tokens - r.out - 1)          # drafts that fit before max_tokens
                r.verified += min(int(w), room)
                a = min(int(w), full if full >= 0 else -1 - full, room)
                r.pos += 1
            r.out += a + 1
            r.rec.chunks.append((t, a + 1))
        for r, _ in decode + chunks:
            if r.out >= r.max_tokens and r not in finished:
                finished.append(r)
        if D and g:                                         # the relay sees the step, as CostWindows.observe
            policy.observe(SimpleNamespace(step=step, decode=SimpleNamespace(slots=slots, generations=gens, plain=not drafting,
                out=SimpleNamespace(conf=conf, drafted=(np.arange(len(D)) < drafting).astype(np.int64)))))
        for r in finished:
            r.rec.end, r.rec.tokens = t, r.out
            steps = len(r.rec.chunks) - 1                      # verify steps: every chunk after the first token
            r.rec.spec = {"steps": steps, "verified": r.verified, "committed": r.out - 1} if g else None
            running.remove(r)
            free.append(r.slot)
        step += 1
        in_window += t0 <= t < t1
    return Run(records, t0, t1, {"engine_steps": in_window})


# ----------------------------------------------------------------------------- traces at another tau
def expected_tau(conf: np.ndarray) -> float:
    """Mean over steps of 1 + Σ_k Π_{i<=k} c_i: τ if the confidences are calibrated."""
    return float(1.0 + np.cumprod(conf, axis=1).sum(1).mean()) if len(conf) else float("nan")


def scale_traces(traces: Traces, target_tau: float, gamma: int | None = None, seed: int = 0) -> Traces:
    """Traces whose full-block τ is `target_tau` (see the module docstring); `gamma` extends or
    cuts the block (positions past the recorded gamma repeat its last confidence)."""
    g = gamma or traces.gamma
    if not 1.0 < target_tau < g + 1:
        raise ValueError(f"a target tau must lie in (1, gamma + 1) = (1, {g + 1}), got {target_tau}")

    def widen(c: np.ndarray) -> np.ndarray:
        c = np.clip(np.nan_to_num(c.astype(np.float64), nan=0.0), 1e-6, 1.0 - 1e-6)
        return c[:, :g] if c.shape[1] >= g else np.concatenate([c, np.repeat(c[:, -1:], g - c.shape[1], 1)], 1)
    confs = [widen(r.conf) for r in traces.requests]
    allc = np.concatenate(confs)
    lo, hi = 1e-3, 1e3                                   # tau falls as beta grows
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if expected_tau(allc ** mid) > target_tau else (lo, mid)
    beta = math.sqrt(lo * hi)
    rng = np.random.default_rng(seed)
    out = []
    for r, c in zip(traces.requests, confs):
        cb = c ** beta
        ok = rng.random(cb.shape) < cb                      # Bernoulli(c_k) per position
        full = np.where(ok.all(1), g, np.argmin(ok, axis=1)).astype(np.int64)   # leading successes
        out.append(RequestTrace(r.request_id, cb.astype(np.float32), full, r.workload, r.prompt_len))
    meta = {**traces.meta, "scaled": {"target_tau": target_tau, "gamma": g, "beta": beta, "seed": seed,
                                      "recorded_tau": traces.tau()}}
    return Traces(g, out, meta)


# ----------------------------------------------------------------------------- overheads from a measured run
def calibrate(serve_result: dict, cost: StepCost, by: str = "kind") -> dict:
    """host_s, prefill_s and prefill_token_s that make the table explain measured `bench serve`
    runs (engine front end). `by="kind"`: per run, two equations, one per kind of step: the
    seconds of its decode-only steps = Σ T(R, K) + host_s * steps, and of its steps with prefill
    = Σ T(R, K) + (host_s + prefill_s) * steps + prefill_token_s * prefill rows. `by="run"`: one
    equation per run, all its steps together; right for the overlapped loop, where a prefill's
    GPU time is waited for in the decode steps after it, not in its own. Each with its share of
    the client's time between steps; least squares over every run, no term negative; fitted apart
    for speculative systems and no speculation (their host work differs)."""
    if by not in ("kind", "run"):
        raise ValueError(f"by must be 'kind' or 'run', not {by!r}")
    groups = ((0,), (1,)) if by == "kind" else ((0, 1),)
    fits = {}
    for spec in (True, False):
        A, y = [], []
        for r in serve_result["runs"]:
            acc = r.get("accounting") or {}
            if (r["mode"] != "no-spec") != spec or "decode_rk" not in acc or not acc["steps"]:
                continue
            client_per_step = acc["client_s"] / acc["steps"]
            for group in groups:
                kinds = [k for p in group for k in (("prefill_only", "mixed") if p else ("decode_only",))]
                n = sum(acc[f"{k}_steps"] for k in kinds)
                if not n:
                    continue
                table_s = sum(c * cost.decode_seconds(R, K, spec, *d[:1]) for R, K, c, p, *d in acc["decode_rk"]
                              if p in group)
                n_prefill = sum(acc[f"{k}_steps"] for k in ("prefill_only", "mixed") if k in kinds)
                A.append([n, n_prefill, sum(acc[f"{k}_prefill_rows"] for k in kinds)])
                y.append(sum(acc[f"{k}_s"] for k in kinds) + client_per_step * n - table_s)
        if A:
            fits["spec" if spec else "plain"] = dict(zip(("host_s", "prefill_s", "prefill_token_s"),
                                                         _nonnegative_lstsq(np.array(A, float), np.array(y))))
    return fits


def _nonnegative_lstsq(A: np.ndarray, y: np.ndarray) -> list[float]:
    """min |A x - y| with x >= 0, by trying every subset of free columns (3 columns: 8 fits)."""
    best, best_x = math.inf, [0.0] * A.shape[1]
    for mask in range(1 << A.shape[1]):
        cols = [j for j in range(A.shape[1]) if mask >> j & 1]
        x = np.zeros(A.shape[1])
        if cols:
            x[cols] = np.linalg.lstsq(A[:, cols], y, rcond=None)[0]
        if (x >= 0).all() and (err := float(np.sum((A @ x - y) ** 2))) < best:
            best, best_x = err, x.tolist()
    return best_x


# ----------------------------------------------------------------------------- the sweep and the command
def simulate_sweep(systems, concurrencies, work: ServeWorkload, traces: Traces | None, costs: dict, warmup_s: float,
                   duration_s: float, num_requests: int = 0, workload: str = "mix", **kw) -> list[dict]:
    """`bench serve`'s rows, predicted: one run per (system, concurrency); costs: system -> StepCost."""
    rows = []
    for c in concurrencies:
        for s in systems:
            run = simulate_closed_loop(s, work, traces, costs[s], c, warmup_s, duration_s, num_requests, **kw)
            rows.append({"mode": s, "workload": workload, "concurrency": c, "repeat": 0, **summarize(run)})
    return rows


def compare(predicted: list[dict], measured: dict) -> list[dict]:
    """Predicted against measured total and per-user tok/s, per (system, concurrency)."""
    meas = {(r["mode"], r["workload"], r["concurrency"]): r for r in measured["sweep"]}
    out = []
    for p in predicted:
        m = meas.get((p["mode"], p["workload"], p["concurrency"]))
        if m and m["total_tok_s"] > 0:
            out.append({"mode": p["mode"], "workload": p["workload"], "concurrency": p["concurrency"],
                        "measured_total": m["total_tok_s"], "predicted_total": p["total_tok_s"],
                        "total_error": round(p["total_tok_s"] / m["total_tok_s"] - 1, 4),
                        "measured_per_user": m["per_user_tok_s"], "predicted_per_user": p["per_user_tok_s"],
                        "per_user_error": round(p["per_user_tok_s"] / m["per_user_tok_s"] - 1, 4)
                        if m["per_user_tok_s"] else None})
    return out


def simulate(args) -> dict:
    from ..loader import Tokenizer, resolve_model_dir
    from .bench_engine import environment
    from .bench_serve import make_workload
    table = load_table(args.cost_table, args.table_key)
    plain = load_table(args.plain_table, args.plain_key, plain=True) if args.plain_table else None
    shares = load_shares(args.cost_table) if plain is not None else None
    lapsed = load_lapsed(args.cost_table) if plain is not None else None
    if not args.traces and any(s != "no-spec" for s in args.systems):
        raise SystemExit("speculative systems replay acceptance traces: give --traces "
                         "(`bench serve --record-traces DIR`, a static run's)")
    traces = Traces.load(args.traces) if args.traces else None
    label = "prediction"
    if args.scale_tau:
        traces = scale_traces(traces, args.scale_tau, args.gamma, args.seed)
        label = f"prediction at tau {args.scale_tau:g} (scaled acceptance, gamma {traces.gamma})"
    base = dict(host_s=1e-3 * args.host_ms, prefill_s=1e-3 * args.prefill_ms, prefill_token_s=1e-6 * args.prefill_token_us)
    fits = {}
    if args.calibrate_from:
        measured = json.loads(Path(args.calibrate_from).read_text())
        if args.calibrate_concurrency:       # fit on these runs only (hold the predicted ones out)
            measured["runs"] = [r for r in measured["runs"] if r["concurrency"] in args.calibrate_concurrency]
        if args.calibrate_systems:           # ... or on these systems' runs only
            measured["runs"] = [r for r in measured["runs"] if r["mode"] in args.calibrate_systems]
        fits = calibrate(measured, StepCost(table, plain, shares=shares, lapsed=lapsed), by=args.calibrate_by)
    costs = {s: StepCost(table, plain, **fits.get("plain" if s == "no-spec" else "spec", base), shares=shares,
                         lapsed=lapsed) for s in args.systems}
    tok = Tokenizer(resolve_model_dir(args.model))
    work = make_workload(tok, args.workload, args.prompts, args.prompt_tokens, args.output_len, args.output_spread,
                         args.seed, args.data_dir)
    gamma = traces.gamma if traces is not None else 0
    rows = simulate_sweep(args.systems, args.concurrency, work, traces, costs, args.warmup_s, args.duration,
                          args.num_requests, args.workload, gamma=gamma,
                          max_num_seqs=args.max_num_seqs or max(args.concurrency),
                          max_num_batched_tokens=args.max_num_batched_tokens, lag=args.lag, min_gain=args.min_gain,
                          max_waiting_steps=args.max_waiting_steps, waiting_served_ratio=args.waiting_served_ratio)
    result = {"kind": "prediction", "label": label, **environment(cuda=False),
              "command": "python -m nanodspark.bench " + " ".join(sys.argv[1:]),
              "inputs": {"cost_table": args.cost_table, "table_key": args.table_key, "plain_table": args.plain_table,
                         "traces": args.traces, "traces_tau": traces.tau() if traces else None,
                         "censored_steps": traces.censored() if traces else 0, "traces_meta": traces.meta if traces else {}},
              "step_cost": {s: {k: v for k, v in vars(c).items() if k not in ("table", "plain", "shares", "lapsed")}
                            for s, c in costs.items()},
              "calibrated_from": args.calibrate_from, "calibrated_by": args.calibrate_by if args.calibrate_from else None,
              "calibrated_on": args.calibrate_concurrency, "runs": rows, "sweep": median_rows(rows)}
    result["paired"] = paired_ratios(rows)
    if args.compare:
        result["compare"] = compare(result["sweep"], json.loads(Path(args.compare).read_text()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"\n{label.upper()}  ({args.cost_table}; traces {args.traces})")
    base_tok = {r["concurrency"]: r["total_tok_s"] for r in rows if r["mode"] == "no-spec"}
    print(f"{'system':>16} {'conc':>5} {'total tok/s':>12} {'user tok/s':>11} {'x no-spec':>10}")
    for r in rows:
        b = base_tok.get(r["concurrency"])
        print(f"{r['mode']:>16} {r['concurrency']:>5} {r['total_tok_s']:>12,.1f} {r['per_user_tok_s']:>11,.1f} "
              f"{(r['total_tok_s'] / b if b else float('nan')):>10.3f}")
    for c in result.get("compare", []):
        print(f"  {c['mode']:>14} c={c['concurrency']:<4} measured {c['measured_total']:>10,.1f} predicted "
              f"{c['predicted_total']:>10,.1f} ({100 * c['total_error']:+.1f} %)")
    return result


def add_simulate_args(p) -> None:
    from .workloads import WORKLOADS
    p.add_argument("--cost-table", required=True, help="T(R, K) of speculative steps (`bench profile`)")
    p.add_argument("--table-key", default=None, help="which table of the file (default: its only one)")
    p.add_argument("--plain-table", default=None, help="T(R, 0) without a drafter (`bench profile-plain`)")
    p.add_argument("--plain-key", default=None,
                   help="the plain table's entry when its file holds several (default: the one keyed "
                        "'... (no drafter)')")
    p.add_argument("--traces", default=None, help="acceptance traces (`bench serve --record-traces`), .npz or .json")
    p.add_argument("--scale-tau", type=float, default=None,
                   help="replay synthetic traces of this full-block tau instead (a prediction at that tau)")
    p.add_argument("--gamma", type=int, default=None, help="with --scale-tau: the block size to predict for")
    p.add_argument("--systems", nargs="+", default=["no-spec", "static", "compact"], help="systems predicted")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256],
                   help="concurrencies predicted (closed-loop clients)")
    p.add_argument("--host-ms", type=float, default=0.0, help="host milliseconds per step not in the table")
    p.add_argument("--prefill-ms", type=float, default=0.0, help="fixed milliseconds of a step with prefill rows")
    p.add_argument("--prefill-token-us", type=float, default=0.0, help="microseconds per prefill row")
    p.add_argument("--calibrate-from", default=None,
                   help="fit the three terms above from a `bench serve` JSON (engine front end)")
    p.add_argument("--calibrate-by", default="kind", choices=("kind", "run"),
                   help="fit per kind of step (decode-only, with prefill) or per whole run (the overlapped "
                        "loop, where a prefill's GPU time lands in the steps after it)")
    p.add_argument("--calibrate-concurrency", type=int, nargs="+", default=None,
                   help="fit on the runs of these concurrencies only (default: all), to predict the others")
    p.add_argument("--calibrate-systems", nargs="+", default=None,
                   help="fit on these systems' runs only (default: all), e.g. no-spec static to predict compact")
    p.add_argument("--compare", default=None, help="a `bench serve` JSON to print the prediction against")
    p.add_argument("--model", default=None, help="whose tokenizer measures the prompts (as bench serve did)")
    p.add_argument("--workload", default="mix", choices=WORKLOADS, help="prompt set the requests are drawn from")
    p.add_argument("--prompts", type=int, default=400, help="distinct prompts cycled through")
    p.add_argument("--prompt-tokens", type=int, default=256,
                   help="prompt tokens per request (prompts cut to their last N)")
    p.add_argument("--output-len", type=int, default=128, help="mean new tokens per request")
    p.add_argument("--output-spread", type=float, default=0.25,
                   help="relative spread of output lengths (uniform, +-)")
    p.add_argument("--data-dir", default=None, help="workload data; none: $NANODSPARK_DATA, else ../shared/data")
    p.add_argument("--warmup-s", type=float, default=3.0, help="virtual seconds of load before the window")
    p.add_argument("--duration", type=float, default=20.0, help="virtual seconds of the measured window")
    p.add_argument("--num-requests", type=int, default=0,
                   help="measure this many requests instead of a window (0: the window)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="engine slots (0: the largest concurrency)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the engine's (8192 on CUDA, 2048 on CPU)")
    p.add_argument("--max-waiting-steps", type=int, default=8,
                   help="the engine's admission waves (8: its default on CUDA with graphs; 0: admit at once)")
    p.add_argument("--waiting-served-ratio", type=float, default=0.25, help="the engine's (admit when the queue "
                   "holds this share of the decoding requests)")
    p.add_argument("--lag", type=int, default=DEFAULT_LAG,
                   help="steps between the confidences that size the budget and now")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN,
                   help="the cost scheduler's guard: trim only for a predicted gain above this")
    p.add_argument("--seed", type=int, default=0, help="seed of the output lengths")
    p.add_argument("--out", default="", help="JSON of the prediction (none: print only)")


# ----------------------------------------------------------------------------- T(R, 0) without a drafter
def profile_plain(args) -> dict:
    """T(R, 0) of the target alone: real `engine.step()` calls of R decoding requests, timed
    with `profile_stats.profile_step_cost` (rounds, K = 0 only), saved as a CostTable whose
    model name ends in " (no drafter)"."""
    from ..sampling import SamplingParams
    from .bench_profile import build_profiled_llm, drain, finish_notes, print_plan, profiled_loop
    from .profile_stats import profile_step_cost
    t_start = time.perf_counter()
    llm, source = build_profiled_llm(args, drafter=False)   # --shape: random weights (bench_profile.py)
    eng = llm.engine
    print_plan(args, {b: [0] for b in args.batch_sizes})
    loop = getattr(args, "loop", "auto")
    eng.overlap = profiled_loop(eng, loop)   # as `bench profile`: a step alone, or a pipeline's period
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not eng.overlap else (lambda: None)
    params = SamplingParams(temperature=0, max_tokens=max(1, eng.max_model_len - args.context - 1), ignore_eos=True)
    state = {"bs": None, "reqs": []}
    rng = np.random.default_rng(0)

    def prepare(bs: int, k: int) -> None:
        if state["bs"] == bs and max(r.num_output for r in state["reqs"]) <= 16:
            return
        for r in state["reqs"]:
            eng.abort(r.request_id)
        drain(eng)                           # before the blocks go back
        for r in state["reqs"]:
            eng.release(r.request_id)
        state["reqs"] = [eng.add_request(rng.integers(0, eng.model_config.vocab_size, args.context).tolist(), params,
                                         queue_limit=False, stream_text=False) for _ in range(bs)]
        while any(not r.is_decoding for r in state["reqs"]):
            eng.step()
        state["bs"] = bs

    def run_step(bs: int, k: int) -> None:
        if state["bs"] != bs:
            prepare(bs, k)
        eng.step()
        sync()
    run_step.prepare = prepare
    table = profile_step_cost(run_step, args.batch_sizes, [0], repeats=args.repeats, trend_z_min=None,
                              model_name=f"{source['model_name']} (no drafter)", dtype=str(eng.dtype),
                              device=eng.device.type)
    for r in state["reqs"]:
        eng.abort(r.request_id)
    drain(eng)
    table.notes = {"command": "python -m nanodspark.bench " + " ".join(sys.argv[1:]), "context": args.context, "scope": "whole step, no drafter", "repeats": args.repeats,
                   "loop": "overlap" if eng.overlap else "sync",
                   **source["notes"], **finish_notes(llm, t_start)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.save(args.out)
    print(f"saved {args.out}{source['banner']}")
    return table.to_json()


def add_profile_plain_args(p) -> None:
    from .bench_profile import add_loop_arg, add_source_args
    add_source_args(p, "the shipped default")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256],
                   help="batch sizes profiled")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request (random ids)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per batch size (median)")
    add_loop_arg(p)
    p.add_argument("--kv-gb", type=float, default=0.0,
                   help="KV cache memory (GiB); 0 = sized for the largest batch at the context")
    p.add_argument("--out", default="plain_table.json", help="the plain cost table (JSON) to write")
