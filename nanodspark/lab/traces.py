"""What a run did, step by step: acceptance traces for the simulator, a ledger for the accounting.

The idea
    Two observers of the engine's step results (`engine.extra_observers`), both reading a step
    through one adapter, `step_arrays(result)`, which turns a `StepResult` into plain arrays
    (the decoding rows' confidences, windows, verified and accepted drafts; the prefill rows).
    When the engine's result changes shape (per-request `Commit` objects today, arrays
    tomorrow), only the adapter changes.

    * `TraceRecorder` keeps, per request, every verify step's calibrated conditional
      confidences `conf[gamma]` and the drafts a *full-block* verify would have accepted,
      `full` (the acceptance trace). `Traces` saves and loads them (JSON or NPZ);
      `nanodspark/lab/simulate.py` replays them.
    * `StepLedger` keeps one row per step (batch, verify rows, budget, prefill and recompute
      rows, seconds) and counts preemptions; `account` turns the rows of a time window into
      where the wall time went.

Invariants
    * `full` is exact when the step verified the whole block (static), when it saw a rejection
      (accepted < verified: the first rejected draft is known) or under cap-accept (the ceiling);
      otherwise (a trimmed window fully accepted) it is censored and stored as -1 - accepted.
      Record traces under static (or cap-accept) to have no censored step.
    * Observers never change a request or the engine; the ledger's two wrappers (the scheduler's
      `preempt`, the window policy's `plan`) call the real method and only count.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


# ----------------------------------------------------------------------------- the adapter
@dataclass
class StepArrays:
    """One committed step as arrays (what both observers read)."""
    step: int
    seconds: float                       # launch to result, host clock
    request_ids: list[str]               # the decoding rows, in order
    conf: np.ndarray                     # float32 [n, gamma]: calibrated conditional confidences
    window: np.ndarray                   # int64 [n]: the window chosen
    verified: np.ndarray                 # int64 [n]: drafts the target scored
    accepted: np.ndarray                 # int64 [n]
    ceiling: np.ndarray                  # int64 [n]: cap-accept's full-block acceptance, -1 if none
    prefill_rows: int = 0                # rows of prefill chunks
    recompute_rows: int = 0              # ... of requests that had output already (preempted ones)
    prefill_chunks: int = 0
    drafted: np.ndarray | None = None    # bool [n]: the drafter's pass ran for the row (None: every row)


def step_arrays(result, gamma: int) -> StepArrays:
    """The adapter: a `StepResult` (step.py: prefill chunks, and the decode rows as arrays) as
    `StepArrays`. Re-point this one function when the step's result changes shape."""
    d, chunks = result.decode, result.prefill
    rows = 0 if d is None else len(d.slots)
    if rows:
        o = d.out
        ids = [r.request_id for r in d.requests.tolist()]
        conf = o.conf.astype(np.float32).reshape(rows, -1) if o.conf.shape[1] else np.zeros((rows, gamma), np.float32)
        win, ver, acc = o.windows.astype(np.int64), o.verified.astype(np.int64), d.accepted.astype(np.int64)
        # the leading run of accepted drafts is the full block's acceptance where the whole block was scored
        # (static, cap-accept); a trimmed compact row has none (-1)
        ceiling = np.where(ver >= gamma, o.ceiling, -1).astype(np.int64)
        drafted = o.drafted != 0
    else:
        ids, conf = [], np.zeros((0, gamma), np.float32)
        win = ver = acc = ceiling = np.zeros(0, np.int64)
        drafted = np.zeros(0, bool)
    advanced = sum(len(c.chunk.token_ids) for c in chunks)
    recompute = sum(len(c.chunk.token_ids) for c in chunks if c.request is not None and c.request.num_output >
                    (1 if c.token is not None else 0))
    return StepArrays(result.step, float(result.seconds), ids, conf, win, ver, acc, ceiling, advanced, recompute,
                      len(chunks), drafted)


def full_block_accepted(s: StepArrays, gamma: int) -> np.ndarray:
    """Drafts a full-block verify would have accepted, per row; -1 - accepted where censored."""
    exact = (s.verified == gamma) | (s.accepted < s.verified)
    full = np.where(exact, s.accepted, -1 - s.accepted)
    return np.where(s.ceiling >= 0, s.ceiling, full)


# ----------------------------------------------------------------------------- traces
@dataclass
class RequestTrace:
    """The verify steps of one request: conf [steps, gamma], full [steps] (see the docstring)."""
    request_id: str
    conf: np.ndarray
    full: np.ndarray
    workload: str = ""
    prompt_len: int = 0


@dataclass
class Traces:
    gamma: int
    requests: list[RequestTrace]
    meta: dict = field(default_factory=dict)

    def tau(self) -> float:
        """Mean committed tokens per step of a full-block verify (1 + accepted), censored steps left out."""
        full = np.concatenate([r.full for r in self.requests]) if self.requests else np.zeros(0)
        ok = full[full >= 0]
        return float(1 + ok.mean()) if len(ok) else float("nan")

    def censored(self) -> int:
        return int(sum((r.full < 0).sum() for r in self.requests))

    def save(self, path) -> Path:
        """JSON (readable) or NPZ (compact), by the file's suffix."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".npz":
            lens = np.array([len(r.full) for r in self.requests], dtype=np.int64)
            np.savez_compressed(
                path, gamma=self.gamma, steps=lens,
                conf=np.concatenate([r.conf for r in self.requests]) if self.requests else np.zeros((0, self.gamma)),
                full=np.concatenate([r.full for r in self.requests]) if self.requests else np.zeros(0, np.int64),
                prompt_len=np.array([r.prompt_len for r in self.requests], dtype=np.int64),
                ids=json.dumps([r.request_id for r in self.requests]),
                workloads=json.dumps([r.workload for r in self.requests]), meta=json.dumps(self.meta))
        else:
            path.write_text(json.dumps({
                "gamma": self.gamma, "meta": self.meta,
                "requests": [{"id": r.request_id, "workload": r.workload, "prompt_len": r.prompt_len,
                              "conf": np.round(r.conf, 5).tolist(), "full": r.full.tolist()}
                             for r in self.requests]}))
        return path

    @classmethod
    def load(cls, path) -> "Traces":
        path = Path(path)
        if path.suffix == ".npz":
            z = np.load(path)
            ends = np.cumsum(z["steps"])
            starts = ends - z["steps"]
            ids, wls = json.loads(str(z["ids"])), json.loads(str(z["workloads"]))
            conf, full = z["conf"].astype(np.float32), z["full"].astype(np.int64)   # z[key] unpacks on every read
            reqs = [RequestTrace(i, conf[a:b], full[a:b], w, int(p))
                    for i, w, p, a, b in zip(ids, wls, z["prompt_len"], starts, ends)]
            return cls(int(z["gamma"]), reqs, json.loads(str(z["meta"])))
        d = json.loads(path.read_text())
        g = int(d["gamma"])
        return cls(g, [RequestTrace(r["id"], np.array(r["conf"], dtype=np.float32).reshape(-1, g),
                                    np.array(r["full"], dtype=np.int64), r.get("workload", ""),
                                    int(r.get("prompt_len", 0))) for r in d["requests"]], d.get("meta", {}))


class TraceRecorder:
    """An engine observer that records acceptance traces: `engine.extra_observers.append(rec)`."""

    def __init__(self, gamma: int, labels: dict[str, tuple[str, int]] | None = None):
        self.gamma = gamma
        self.labels = labels if labels is not None else {}    # request id -> (workload, prompt_len)
        self.conf: dict[str, list[np.ndarray]] = {}
        self.full: dict[str, list[np.ndarray]] = {}

    def observe(self, result) -> None:
        if not self.gamma:
            return
        s = step_arrays(result, self.gamma)
        full = full_block_accepted(s, self.gamma)
        for i, rid in enumerate(s.request_ids):
            if s.drafted is not None and not s.drafted[i]:     # no draft this step: nothing to record
                continue
            self.conf.setdefault(rid, []).append(s.conf[i])
            self.full.setdefault(rid, []).append(full[i:i + 1])

    def traces(self, meta: dict | None = None) -> Traces:
        reqs = []
        for rid in self.conf:
            wl, plen = self.labels.get(rid, ("", 0))
            reqs.append(RequestTrace(rid, np.stack(self.conf[rid]), np.concatenate(self.full[rid]), wl, plen))
        return Traces(self.gamma, reqs, dict(meta or {}))


# ----------------------------------------------------------------------------- the ledger
LEDGER_FIELDS = ("t", "step", "seconds", "decode", "verified", "accepted", "budget", "prefill_rows",
                 "recompute_rows", "prefill_chunks", "kv_used", "drafting")
PLAIN, LAPSED = -1, -2       # the budget column's marks of plain steps (keeping, or letting lapse, the drafter's context)


class StepLedger:
    """One row per committed step; attach with `StepLedger.attach(engine, clock)`.

    Columns (LEDGER_FIELDS): the clock when the step was committed, the step index, its seconds
    (launch to result), decoding requests, drafts verified and accepted, the budget K the
    window policy planned (R * gamma for full blocks, 0 without a drafter, `PLAIN` for a plain step,
    `LAPSED` for one that lets the drafter's context lapse), prefill rows, of
    which recomputed (preempted requests), prefill chunks, and the share of KV blocks in use
    after the commit (reserved ahead for verify windows included), and the decoding requests that
    ran the drafter's pass (fewer than all when the cost scheduler drafted for some only).
    `preemptions` counts the scheduler's.
    """

    def __init__(self, gamma: int, clock):
        self.gamma, self.clock = gamma, clock
        self.rows: list[tuple] = []
        self.preemptions: list[float] = []          # the clock at each preemption
        self._budgets: dict[int, int] = {}          # step index -> the policy's budget
        self._engine = None

    @classmethod
    def attach(cls, engine, clock) -> "StepLedger":
        led = cls(engine.gamma, clock)
        sched, policy = engine.scheduler, engine.windows
        preempt, plan = sched.preempt, policy.plan

        def counting_preempt(req):
            preempt(req)                            # raises Drain before anything changed: not counted
            led.preemptions.append(clock())

        def recording_plan(requests, step):
            wp = plan(requests, step)
            led._budgets[step] = ((PLAIN if wp.upkeep else LAPSED) if not wp.draft   # no drafter pass
                                  else wp.budget if wp.trim or wp.window_cap is None else int(sum(wp.window_cap)))
            return wp
        sched.preempt, policy.plan = counting_preempt, recording_plan
        led._detach = lambda: (sched.__dict__.pop("preempt", None), policy.__dict__.pop("plan", None))
        engine.extra_observers.append(led)
        led._engine = engine
        return led

    def detach(self) -> None:
        self._detach()
        self._engine.extra_observers.remove(self)

    def observe(self, result) -> None:
        s = step_arrays(result, self.gamma)
        n = len(s.request_ids)
        kv = getattr(self._engine, "kv_usage", lambda: {})()
        used = sum(g["used"] for g in kv.values()) / max(1, sum(g["total"] for g in kv.values()))
        self.rows.append((self.clock(), s.step, s.seconds, n, int(s.verified.sum()), int(s.accepted.sum()),
                          self._budgets.pop(s.step, n * self.gamma) if n else 0, s.prefill_rows,
                          s.recompute_rows, s.prefill_chunks, used,
                          int(s.drafted.sum()) if s.drafted is not None else n))

    def table(self, t0: float = -np.inf, t1: float = np.inf) -> dict[str, np.ndarray]:
        """The rows committed in [t0, t1) as columns."""
        rows = [r for r in self.rows if t0 <= r[0] < t1]
        cols = np.array(rows, dtype=np.float64).reshape(len(rows), len(LEDGER_FIELDS))
        return {name: cols[:, i] for i, name in enumerate(LEDGER_FIELDS)}


def account(ledger: StepLedger, t0: float, t1: float, step_calls: list[tuple[float, float]],
            phases_s: dict[str, float] | None = None, cost=None) -> dict:
    """Where the wall time of [t0, t1) went, from what the engine exposes today.

    step_calls: (start, end) of every `engine.step()` call of the run (the harness times them);
    the time outside them is the client's (adding requests, bookkeeping). Each committed step
    belongs to the call it was committed in, and a call's seconds are charged to the kind of
    its step: decode only, prefill only, or both in one step ("mixed"). `decode_rk` lists
    (R, K, steps, with prefill 0/1, drafting rows) of the decode steps: what the step-cost table prices
    (`simulate.calibrate` fits the rest). With `cost` (simulate.StepCost) the decode steps are
    also priced here, so the rest of the step time (prefill, host work the table does not hold)
    shows."""
    span = max(t1 - t0, 1e-12)
    tab = ledger.table(t0, t1)
    starts = np.array([a for a, _ in step_calls], dtype=np.float64)
    durs = np.array([b - a for a, b in step_calls], dtype=np.float64)
    in_step = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in step_calls)
    # the call a step was committed in: the last one started at or before the commit
    owner = (np.searchsorted(starts, tab["t"], side="right") - 1).clip(0) if len(starts) else np.zeros(0, int)
    dec, pre = tab["decode"] > 0, tab["prefill_rows"] > 0
    out = {
        "window_s": round(span, 6),
        "in_engine_step_s": round(in_step, 6), "client_s": round(span - in_step, 6),
        "steps": int(len(tab["t"])),
        "preemptions": int(sum(t0 <= t < t1 for t in ledger.preemptions)),
        "prefill_rows": int(tab["prefill_rows"].sum()), "recompute_rows": int(tab["recompute_rows"].sum()),
        "decode_request_steps": int(tab["decode"].sum()),
        "verify_rows": int(tab["decode"].sum() + tab["verified"].sum()),
        "drafts_verified": int(tab["verified"].sum()), "drafts_accepted": int(tab["accepted"].sum()),
        "plain_steps": int(((tab["budget"] < 0) & (tab["decode"] > 0)).sum()),
        "partial_steps": int(((tab["drafting"] > 0) & (tab["drafting"] < tab["decode"])).sum()),
        "kv_used_mean": round(float(tab["kv_used"].mean()), 4) if len(tab["t"]) else None,
        "kv_used_max": round(float(tab["kv_used"].max()), 4) if len(tab["t"]) else None,
    }
    for name, mask in (("decode_only", dec & ~pre), ("prefill_only", pre & ~dec), ("mixed", dec & pre)):
        own = np.unique(owner[mask]) if len(starts) else np.zeros(0, dtype=int)
        out[f"{name}_steps"] = int(mask.sum())
        out[f"{name}_s"] = round(float(durs[own].sum()), 6)
        out[f"{name}_prefill_rows"] = int(tab["prefill_rows"][mask].sum())
    rk = np.stack([tab["decode"], tab["budget"], pre, tab["drafting"]], 1).astype(np.int64)[dec]
    pairs, counts = np.unique(rk, axis=0, return_counts=True) if len(rk) else (np.zeros((0, 4), np.int64), [])
    out["decode_rk"] = [[int(r), int(k), int(n), int(p), int(d)] for (r, k, p, d), n in zip(pairs, counts)]
    if phases_s:
        out["host_phases_s"] = {k: round(v, 6) for k, v in phases_s.items()}
    if cost is not None:
        table_s = sum(n * cost.decode_seconds(r, k, ledger.gamma > 0, d) for r, k, n, _, d in out["decode_rk"])
        out["decode_by_table_s"] = round(table_s, 6)
        out["rest_s"] = round(out["decode_only_s"] + out["prefill_only_s"] + out["mixed_s"] - table_s, 6)
    return out
