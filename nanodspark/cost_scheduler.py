"""Hardware-aware prefix scheduler: how many draft tokens the target verifies, and whose.

Paper: DSpark §3.2.2 (Algorithm 1, the synchronous lossless rule, and Appendix A on why it
stops early), §5.2 (production relay: budget from confidences two steps old, allocation by
top-K over the fresh ones). The block-accept ceiling estimator lives in verify.py. Walkthrough: chapter 07.

The idea
    Each request r has conditional confidences c_{r,1..gamma}; its survival a_{r,k} =
    c_{r,1} ... c_{r,k} is the probability that draft k is accepted. Verifying one more draft
    of r adds a_{r,k} expected tokens and one verify token of cost. With a profiled step cost,
    the scheduler picks the windows (drafts verified per request) that maximise expected
    tokens per second, Theta = tau * SPS(B) = tau / T(B), where B = R + sum(windows) verify
    tokens (one anchor per request plus the drafts) and tau = R + sum of admitted survivals.
    Because a_{r,k} never increases with k, admitting cells in globally descending survival
    order always yields prefix windows.

Two ways to stay lossless (admission of draft x_{r,k} must not depend on x_{r,k} itself,
whose value feeds c_{r,k+1} through the Markov feature):
    * `algorithm1`: one synchronous pass that stops at the first non-improvement of Theta; it
      admits (r, k) before it ever looks at a_{r,k+1}. Optimal when Theta is unimodal.
    * `budget_from_lagged` + `allocate_windows_topk` (production): the *number* K of drafts is a
      global argmax computed from confidences `lag` steps old (independent of this step's
      drafts), then the K cells with the largest *current* survivals are admitted, ties going
      to the lower position. a_{r,k+1} <= a_{r,k} and the tie-break mean no cell that depends on
      x_{r,k} can outrank (r, k), so "window_r >= k iff (r, k) is in the top K" is decided
      before x_{r,k} matters.

Invariants
    * Windows are contiguous prefixes: window_r = number of admitted cells of row r.
    * Sort order of cells: survival descending, then position ascending, then request ascending.
    * A cell with survival 0 is never admitted.
    * `allocate_windows_topk` never reads a device value back to the host (it runs where its
      input is; the engine's synchronous step passes a host copy).
    * A cost table is non-decreasing in K at every batch size; without one (or with a flat
      one) nothing is trimmed: the full budget R * gamma is verified.
    * The relay gives survival 1.0 (conservative: verify everything) to a slot whose lagged
      entry is missing, stale (another step) or recycled (another generation id).

Defaults (the one place they are written down; every function takes them as parameters)
    DEFAULT_LAG = 2              steps between the confidences the budget uses and now (§5.2)
    DEFAULT_MIN_GAIN = 0.04      trim only if predicted Theta beats full verify by > 4 %
                                 (the value TensorRT-LLM's `confidence_min_predicted_gain` uses)
    DEFAULT_SURVIVAL_EPS = 1e-6  lagged survivals below this count as 0 in the budget search
    DEFAULT_REPEATS = 5          timed rounds per batch size in `profile_step_cost`
    DEFAULT_WARMUP = 1           untimed rounds over a batch size's K grid before the timed ones
    DEFAULT_SETTLE = 1           untimed steps of the same (bs, K) right before each timed one
    DEFAULT_FLAT_REL_TOL = 0.01  a table is flat if T(bs, K) varies by < 1 % over K at every bs
"""

from __future__ import annotations

import json
import random
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

DEFAULT_LAG = 2
DEFAULT_MIN_GAIN = 0.04
DEFAULT_SURVIVAL_EPS = 1e-6
DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 1
DEFAULT_SETTLE = 1
DEFAULT_FLAT_REL_TOL = 0.01
MODES = ("static", "compact", "cap-accept")


# =============================================================================================
# cost table: T(bs, K) seconds per step, bs requests, K extra verify tokens, M = bs + K
# =============================================================================================

def _basis(x: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Piecewise-linear (hat) weights of points x [n] on knots [m] -> [n, m].

    Clamped below the first knot; linear extrapolation of the last segment above the last knot
    (so a cost keeps growing past the profiled range instead of going flat).
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    m = len(knots)
    w = np.zeros((x.size, m))
    if m == 1:
        w[:, 0] = 1.0
        return w
    xc = np.maximum(x, knots[0])
    seg = np.clip(np.searchsorted(knots, xc, side="right") - 1, 0, m - 2)
    t = (xc - knots[seg]) / (knots[seg + 1] - knots[seg])
    rows = np.arange(x.size)
    w[rows, seg] = 1.0 - t
    w[rows, seg + 1] = t
    return w


@dataclass(frozen=True)
class AdditiveCost:
    """T(bs, K) = bias + alpha(bs) + theta(bs + K), alpha/theta piecewise linear on their knots.

    alpha is the per-request floor (draft pass, per-request overheads) that trimming cannot
    change; theta is the cost of M verify tokens, the only part trimming recovers.
    alpha(bs_knots[0]) = 0 and theta(m_knots[0]) = 0 make the split identifiable.
    """
    bias: float
    bs_knots: tuple[float, ...]
    alpha: tuple[float, ...]
    m_knots: tuple[float, ...]
    theta: tuple[float, ...]

    def curve(self, bs: int, ks) -> np.ndarray:
        """Predicted seconds of a step with bs requests for each K in ks (vectorised)."""
        ks = np.asarray(ks, dtype=np.float64).reshape(-1)
        a = _basis(np.array([bs]), np.asarray(self.bs_knots)) @ np.asarray(self.alpha)
        th = _basis(bs + ks, np.asarray(self.m_knots)) @ np.asarray(self.theta)
        return self.bias + a[0] + th

    def __call__(self, bs: int, k: int) -> float:
        return float(self.curve(bs, [k])[0])


MONOTONE_METHODS = ("isotonic", "max")


def _pool_adjacent_violators(y: list[float]) -> list[float]:
    """Least-squares non-decreasing fit of y (equal weights): merge neighbouring blocks whose
    means decrease until none do; each point takes its block's mean."""
    blocks: list[list[float]] = []                  # [sum, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]


def force_monotone(measurements: dict[tuple[int, int], float],
                   method: str = "isotonic") -> dict[tuple[int, int], float]:
    """Make T(bs, K) non-decreasing in K at every bs.

    Noise can make verifying more tokens look cheaper; the scheduler must never believe that.
    "isotonic" (default): the least-squares non-decreasing fit (pool adjacent violators), so one
    stalled point becomes a small step shared with its neighbours; "max": raise each point to
    the largest value at a smaller K, which turns one stalled point into a cliff for every
    larger K (on the H200 that made compact trim for nothing: chapter 09 §5a).
    Only along K: the scheduler compares steps of one batch size, and forcing across batch sizes
    too would let one slow outlier at a small bs inflate every larger bs.
    """
    if method not in MONOTONE_METHODS:
        raise ValueError(f"method must be one of {MONOTONE_METHODS}, not {method!r}")
    rows: dict[int, list[tuple[int, float]]] = {}
    for (bs, k), v in sorted(measurements.items()):
        rows.setdefault(bs, []).append((k, v))
    out: dict[tuple[int, int], float] = {}
    for bs, row in rows.items():
        vals = [v for _, v in row]
        fitted = _pool_adjacent_violators(vals) if method == "isotonic" else np.maximum.accumulate(vals).tolist()
        out.update({(bs, k): float(f) for (k, _), f in zip(row, fitted)})
    return out


@dataclass
class CostTable:
    """Measured step seconds {(bs, K): s} (the staircase) and the additive model fitted to them.

    The scheduler reads the staircase (`curve`, `staircase`): within a measured batch size, the
    cost of K is the measured cost at the first profiled K' >= K (conservative: a cliff between
    two points is charged early); between measured batch sizes, linear in bs at the same drafts
    per request. The additive model is fitted and printed next to it: it explains the cost, but
    a smooth fit erases the cliffs that make trimming pay (and one outlier bends it everywhere).
    `raw` keeps the per-point estimates before `force_monotone`.
    Keyed (for `save` / `load`) by model name, dtype, device and the graph tiers in use, since a
    table measured under one of those says nothing about another.
    """
    measurements: dict[tuple[int, int], float] = field(default_factory=dict)
    model_name: str = ""
    dtype: str = ""
    device: str = ""
    graph_tiers: tuple[int, ...] = ()
    additive: AdditiveCost | None = None
    raw: dict[tuple[int, int], float] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)      # how it was measured (context, phases, ...)
    samples: dict[tuple[int, int], list[float]] = field(default_factory=dict)   # every timed step
    _row_cache: tuple = field(default=(), init=False, repr=False, compare=False)
    _curve_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # ---- fitting and prediction ----
    def fit_additive(self, m_knots: Sequence[int] | None = None) -> AdditiveCost:
        """Least-squares fit of bias + alpha(bs) + theta(M); forced monotone; stored and returned.

        Knots default to the measured batch sizes and the measured M = bs + K values. The
        problem is linear in (bias, alpha at knots, theta at knots), so one joint `lstsq`
        (minimum-norm where the design leaves freedom) replaces backfitting.
        """
        if not self.measurements:
            raise ValueError("cannot fit an empty cost table")
        keys = sorted(self.measurements)
        bs = np.array([b for b, _ in keys], dtype=np.float64)
        m = np.array([b + k for b, k in keys], dtype=np.float64)
        y = np.array([self.measurements[key] for key in keys])
        bk = np.unique(bs)
        mk = np.unique(m) if m_knots is None else np.unique(np.asarray(m_knots, dtype=np.float64))
        design = np.hstack([np.ones((len(y), 1)), _basis(bs, bk)[:, 1:], _basis(m, mk)[:, 1:]])
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        alpha = np.maximum.accumulate(np.concatenate([[0.0], coef[1:len(bk)]]))
        theta = np.maximum.accumulate(np.concatenate([[0.0], coef[len(bk):]]))
        self.additive = AdditiveCost(float(coef[0]), tuple(bk.tolist()), tuple(alpha.tolist()),
                                     tuple(mk.tolist()), tuple(theta.tolist()))
        return self.additive

    def model(self) -> AdditiveCost:
        return self.additive if self.additive is not None else self.fit_additive()

    def _rows(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{bs: (K values, seconds)}, sorted; cached (the scheduler reads the table every step)
        and rebuilt when `measurements` is replaced or changes size, not on an in-place edit."""
        key = (id(self.measurements), len(self.measurements))
        if not self._row_cache or self._row_cache[0] != key:
            rows: dict[int, list] = {}
            for (b, k), s in sorted(self.measurements.items()):
                rows.setdefault(b, []).append((k, s))
            self._row_cache = (key, {b: (np.array([k for k, _ in v], dtype=np.float64), np.array([s for _, s in v]))
                                     for b, v in rows.items()})
            self._curve_cache = {}
        return self._row_cache[1]

    @staticmethod
    def _lookup(ks: np.ndarray, s: np.ndarray, want: np.ndarray) -> np.ndarray:
        """Cost at the first measured K' >= want (ceiling lookup); past the last K, the last."""
        return s[np.minimum(np.searchsorted(ks, want - 1e-9, side="left"), len(ks) - 1)]

    def staircase(self, bs: int, ks) -> np.ndarray:
        """Predicted seconds at batch size bs for each K in ks, read off the measured staircase.

        At a measured bs: ceiling lookup in K. Between measured batch sizes lo < bs < hi: linear
        in bs between lo's cost at K * lo / bs and hi's at K * hi / bs (the same drafts per
        request). Outside the measured range: the nearest batch size at the same drafts per request.
        """
        rows = self._rows()
        if not rows:
            raise ValueError("cannot read an empty cost table")
        ks = np.asarray(ks, dtype=np.float64).reshape(-1)
        bss = sorted(rows)
        lo = max([b for b in bss if b <= bs], default=bss[0])
        hi = min([b for b in bss if b >= bs], default=bss[-1])
        c_lo = self._lookup(*rows[lo], ks * lo / bs)
        if hi == lo:
            return c_lo
        w = (bs - lo) / (hi - lo)
        return (1.0 - w) * c_lo + w * self._lookup(*rows[hi], ks * hi / bs)

    def predict(self, bs: int, k: int) -> float:
        """Predicted seconds of a verify step with bs requests and k extra (draft) tokens."""
        return float(self.staircase(bs, [k])[0])

    def curve(self, bs: int, k_max: int) -> np.ndarray:
        """Predicted seconds for K = 0..k_max at batch size bs (cached: read every step; do not
        modify the returned array)."""
        self._rows()                                   # drops the cache if the table changed
        c = self._curve_cache.get((bs, k_max))
        if c is None:
            c = self._curve_cache[(bs, k_max)] = self.staircase(bs, np.arange(k_max + 1))
        return c

    def is_flat(self, rel_tol: float = DEFAULT_FLAT_REL_TOL) -> bool:
        """True when no measured batch size shows the cost growing with K (or nothing measured).

        On a flat table trimming saves nothing, so the budget search returns the full budget.
        """
        by_bs: dict[int, list[float]] = {}
        for (b, _), s in self.measurements.items():
            by_bs.setdefault(b, []).append(s)
        return all(max(v) - min(v) <= rel_tol * min(v) for v in by_bs.values())

    def format_fit(self) -> str:
        """Raw median, monotone (what the scheduler reads) and additive-fit milliseconds for
        every measured (bs, K)."""
        model = self.model()
        lines = [f"{'bs':>5} {'K':>5} {'M':>6} {'raw ms':>9} {'monotone ms':>12} {'additive ms':>12} {'err %':>7}"]
        for (b, k), s in sorted(self.measurements.items()):
            p = model(b, k)
            raw = self.raw.get((b, k), float("nan"))
            lines.append(f"{b:>5} {k:>5} {b + k:>6} {1e3 * raw:>9.3f} {1e3 * s:>12.3f} {1e3 * p:>12.3f} "
                         f"{100 * (p - s) / s if s else float('nan'):>7.2f}")
        return "\n".join(lines)

    # ---- persistence ----
    @property
    def key(self) -> str:
        tiers = ",".join(str(t) for t in self.graph_tiers)
        return f"{self.model_name}|{self.dtype}|{self.device}|tiers={tiers}"

    def to_json(self) -> dict:
        d = {"model_name": self.model_name, "dtype": self.dtype, "device": self.device,
             "graph_tiers": list(self.graph_tiers),
             "measurements": [[b, k, s] for (b, k), s in sorted(self.measurements.items())],
             "raw": [[b, k, s] for (b, k), s in sorted(self.raw.items())], "notes": self.notes,
             "samples": [[b, k, v] for (b, k), v in sorted(self.samples.items())]}
        if self.additive is not None:
            a = self.additive
            d["additive"] = {"bias": a.bias, "bs_knots": list(a.bs_knots), "alpha": list(a.alpha),
                             "m_knots": list(a.m_knots), "theta": list(a.theta)}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        add = d.get("additive")
        return cls(
            measurements={(int(b), int(k)): float(s) for b, k, s in d["measurements"]},
            model_name=d.get("model_name", ""), dtype=d.get("dtype", ""), device=d.get("device", ""),
            graph_tiers=tuple(int(t) for t in d.get("graph_tiers", ())),
            raw={(int(b), int(k)): float(s) for b, k, s in d.get("raw", [])}, notes=d.get("notes", {}),
            samples={(int(b), int(k)): [float(x) for x in v] for b, k, v in d.get("samples", [])},
            additive=None if add is None else AdditiveCost(
                float(add["bias"]), tuple(add["bs_knots"]), tuple(add["alpha"]),
                tuple(add["m_knots"]), tuple(add["theta"])))

    def save(self, path) -> None:
        """Add (or replace) this table in a JSON file that maps `key` -> table."""
        path = Path(path)
        tables = json.loads(path.read_text()) if path.exists() else {}
        tables[self.key] = self.to_json()
        path.write_text(json.dumps(tables, indent=1))

    @classmethod
    def load(cls, path, model_name: str, dtype: str, device: str,
             graph_tiers: Sequence[int] = ()) -> "CostTable | None":
        """The table stored under this key in `path`, or None if the file or key is absent."""
        path = Path(path)
        if not path.exists():
            return None
        key = cls(model_name=model_name, dtype=dtype, device=device, graph_tiers=tuple(graph_tiers)).key
        d = json.loads(path.read_text()).get(key)
        return None if d is None else cls.from_json(d)


ESTIMATORS = ("rounds", "median")


def round_adjusted(samples_by_k: Sequence[Sequence[float]], iterations: int = 3) -> list[float]:
    """Per-K step cost from a [K, rounds] grid of timings, with each round's level removed.

    The profiler visits every K once per round, so a round is a block: on the H200 whole
    rounds ran ~50 % slow (the machine alternates between a fast and a slow state lasting about
    a round), and a plain median per K then depends on how many of its samples fell in slow
    rounds. In logs, t[k, r] = mu_k + rho_r + noise; alternating medians (a median polish)
    estimate mu_k and rho_r robustly, rho centred on the typical round; returns exp(mu_k).
    """
    L = np.log(np.maximum(np.asarray(samples_by_k, dtype=np.float64), 1e-12))   # a 0 s timing stays finite
    rho = np.zeros(L.shape[1])
    for _ in range(iterations):
        mu = np.median(L - rho[None, :], axis=1)
        rho = np.median(L - mu[:, None], axis=0)
        rho -= np.median(rho)
    return np.exp(np.median(L - rho[None, :], axis=1)).tolist()


def profile_step_cost(run_step: Callable[[int, int], None], batch_sizes: Sequence[int],
                      extra_tokens: Sequence[int] | Callable[[int], Sequence[int]],
                      repeats: int = DEFAULT_REPEATS, timer: Callable[[], float] = time.perf_counter,
                      warmup: int = DEFAULT_WARMUP, model_name: str = "", dtype: str = "",
                      device: str = "", graph_tiers: Sequence[int] = (), verbose: bool = True,
                      settle: int = DEFAULT_SETTLE, shuffle: bool = True,
                      monotone: str = "isotonic", estimator: str = "rounds") -> CostTable:
    """Time run_step(bs, K) on a (bs, K) staircase; a cost per point (`estimator`: "rounds" =
    `round_adjusted`, each round's level removed; "median" = plain median of the repeats), forced
    monotone (`force_monotone` with `monotone` as its method), additive fit.

    run_step must *execute* a verify step with exactly bs anchors and K extra tokens and block
    until it has finished (e.g. end with torch.cuda.synchronize()), otherwise the timer measures
    the launch only. If it has a `prepare(bs, K)` attribute, that is called untimed before each
    point (e.g. to bring the batch back to the profiled context length). extra_tokens is a list
    of K, or a function bs -> list of K (e.g. K <= bs*gamma).
    """
    from tqdm.auto import tqdm

    prepare = getattr(run_step, "prepare", None)     # optional untimed set-up before each point
    ks = {b: list(extra_tokens(b) if callable(extra_tokens) else extra_tokens) for b in batch_sizes}
    times: dict[tuple[int, int], list[float]] = {(b, k): [] for b in batch_sizes for k in ks[b]}
    bar = tqdm(total=sum(len(v) for v in ks.values()) * (warmup + repeats), desc="profiling step cost",
               disable=not verbose)
    for b in batch_sizes:
        # rounds over the K grid of one batch size: a slow stretch of the machine (clocks, a
        # garbage collection) lands on one repeat of many points, not on every repeat of one.
        # `settle` untimed steps of the same shape before each timed one: a step's cost depends
        # on the shape of the step before it. `shuffle`: each round visits the K grid in a new
        # (seeded) order, so an event that recurs every n steps (on the H200 a ~45 ms stall hit
        # one K of every round in a fixed order) cannot land on the same point every round.
        rng = random.Random(b)
        for r in range(warmup + repeats):
            order = list(ks[b])
            if shuffle:
                rng.shuffle(order)
            for k in order:
                if prepare is not None:
                    prepare(b, k)
                for _ in range(settle if r >= warmup else 0):
                    run_step(b, k)
                t0 = timer()
                run_step(b, k)
                if r >= warmup:
                    times[(b, k)].append(timer() - t0)
                bar.update()
    bar.close()
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, not {estimator!r}")
    raw = {key: statistics.median(v) for key, v in times.items()}
    if estimator == "rounds" and repeats > 1:
        for b in batch_sizes:               # times[(b, k)][r] is round r: every K once per round
            raw.update(zip([(b, k) for k in ks[b]], round_adjusted([times[(b, k)] for k in ks[b]])))
    table = CostTable(force_monotone(raw, monotone), model_name, dtype, device, tuple(graph_tiers), raw=raw, samples=times)
    table.fit_additive()
    if verbose:
        print(table.format_fit())
    return table


# =============================================================================================
# Algorithm 1 (synchronous, lossless by early stop)
# =============================================================================================

def descending_cells(surv: Sequence[Sequence[float]]) -> list[tuple[int, int, float]]:
    """Cells (r, k, a) with a > 0, 1-based k, sorted by (-a, k, r): the scheduler's total order."""
    cells = [(r, k + 1, float(a)) for r, row in enumerate(surv) for k, a in enumerate(row) if a > 0]
    return sorted(cells, key=lambda c: (-c[2], c[1], c[0]))


def algorithm1(conf, sps: Callable[[int], float]) -> torch.Tensor:
    """Paper Algorithm 1: windows [R] (int64, CPU) from conditional confidences conf [R, gamma].

    Admits cells in descending survival order while Theta = tau * SPS(B) strictly improves;
    stops at the first non-improvement (that stop is what keeps it lossless, App. A).
    """
    c = torch.as_tensor(conf, dtype=torch.float64).cpu().clamp(0.0, 1.0)
    R = c.shape[0]
    windows = [0] * R
    best_windows = list(windows)
    tau, batch = float(R), R
    best = tau * sps(batch)
    for r, k, a in descending_cells(torch.cumprod(c, dim=1).tolist()):
        windows[r] = k
        tau, batch = tau + a, batch + 1
        theta = tau * sps(batch)
        if theta <= best:
            break
        best, best_windows = theta, list(windows)
    return torch.tensor(best_windows, dtype=torch.int64)


# =============================================================================================
# production: budget from lagged confidences (host), windows from fresh ones (device)
# =============================================================================================

def _step_time_curve(step_time, bs: int, k_max: int) -> np.ndarray:
    if isinstance(step_time, CostTable):
        return step_time.curve(bs, k_max)
    return np.array([step_time(bs, k) for k in range(k_max + 1)], dtype=np.float64)


def budget_from_lagged(survival_lagged, step_time: CostTable | Callable[[int, int], float],
                       min_gain: float = DEFAULT_MIN_GAIN,
                       survival_eps: float = DEFAULT_SURVIVAL_EPS) -> int:
    """Number K of draft tokens to verify this step (0 <= K <= R*gamma), from lagged survivals.

    Global search (no early stop; the lag makes it causal): K* = argmax_K Theta(K) with
    Theta(K) = (R + sum of the K largest lagged survivals) / T(R, K); ties go to the smaller K.
    Guard: K* is returned only if Theta(K*) > (1 + min_gain) * Theta(R*gamma); otherwise the
    full budget R*gamma (trimming must promise a clear win, since a wrong trim costs accepted
    tokens and the cost model is only a model). A step cost that does not vary with K (flat
    table) also returns the full budget.
    """
    s = (survival_lagged.detach().double().cpu().numpy() if isinstance(survival_lagged, torch.Tensor)
         else np.asarray(survival_lagged, dtype=np.float64))
    R, gamma = s.shape
    full = R * gamma
    if full == 0:
        return 0
    vals = np.sort(np.where(s >= survival_eps, s, 0.0).reshape(-1))[::-1]   # host numpy: no torch dispatch
    tau = R + np.concatenate([[0.0], np.cumsum(vals)])
    times = _step_time_curve(step_time, R, full)
    if times.max() - times.min() <= 0.0:
        return full
    theta = tau / times
    k_best = int(np.argmax(theta))
    return k_best if theta[k_best] > (1.0 + min_gain) * theta[full] else full


def allocate_windows_topk(conf_current: torch.Tensor, budget: int) -> torch.Tensor:
    """Windows [R] (int64, on conf's device): row counts of the top-`budget` survival cells.

    survival = cumprod(conf); cells are ordered by survival descending, then position
    ascending, then request ascending (a stable descending sort over a position-major
    flattening); the first `budget` cells with positive survival are admitted. Host
    confidences are handled in numpy (the engine's synchronous loop passes a host copy);
    device ones stay on the device with no host sync (`budget` is a host int).
    """
    if conf_current.device.type == "cpu":
        return torch.from_numpy(_topk_windows_np(conf_current.detach().float().numpy(), budget))
    return _topk_windows_torch(conf_current, budget)


def _topk_windows_torch(conf_current: torch.Tensor, budget: int) -> torch.Tensor:
    """`allocate_windows_topk` with torch ops, on the confidences' device (no host sync)."""
    a = torch.cumprod(conf_current.float().nan_to_num(0.0).clamp(0.0, 1.0), dim=1)
    R, gamma = a.shape
    k = max(0, min(int(budget), R * gamma))
    if k == R * gamma:                             # the full budget: every positive cell, no sort
        return (a > 0).sum(1)
    flat = a.t().reshape(-1)                       # index = position * R + request
    order = torch.sort(flat, descending=True, stable=True).indices[:k]
    admitted = torch.zeros_like(flat, dtype=torch.bool).index_fill_(0, order, True) & (flat > 0)
    return admitted.view(gamma, R).sum(0)


def _topk_windows_np(conf: np.ndarray, budget: int) -> np.ndarray:
    """`allocate_windows_topk` for host confidences, in numpy (same order and tie-break)."""
    a = np.cumprod(np.minimum(np.fmax(conf, 0.0), 1.0), axis=1)     # fmax maps NaN to 0
    R, gamma = a.shape
    k = max(0, min(int(budget), R * gamma))
    if k == R * gamma:
        return (a > 0).sum(1).astype(np.int64)
    flat = a.T.reshape(-1)                         # index = position * R + request
    if k == 0:
        return np.zeros(R, dtype=np.int64)
    # O(n) instead of a sort: every cell above the k-th largest value is in; of the cells equal
    # to it, the first ones in position-major order fill the rest (the tie-break of the sort)
    v = np.partition(flat, flat.size - k)[flat.size - k]
    admitted = flat > v
    ties = np.flatnonzero(flat == v)[:k - int(admitted.sum())]
    admitted[ties] = True
    return (admitted & (flat > 0)).reshape(gamma, R).sum(0).astype(np.int64)


class ConfidenceRelay:
    """Ring of past conditional confidences per request slot, stamped with step and generation.

    `push(step, ...)` stores this step's confidences; `lagged(..., step=n)` returns the
    survivals pushed at step n - lag for each slot whose stamp and generation id still match,
    and survival 1.0 otherwise (slot never pushed, not pushed at n - lag, or reused by a newer
    request). Memory: (lag + 1) * max_slots * gamma floats on the host.
    """

    def __init__(self, max_slots: int, gamma: int, lag: int = DEFAULT_LAG):
        if lag < 1:
            raise ValueError("lag must be >= 1 (lag 0 would let a draft decide its own admission)")
        self.max_slots, self.gamma, self.lag = max_slots, gamma, lag
        depth = lag + 1
        # numpy, not torch: a few small host ops per step, each far cheaper than a torch dispatch
        self.conf = np.ones((depth, max_slots, gamma), dtype=np.float32)
        self.stamp = np.full((depth, max_slots), -1, dtype=np.int64)
        self.generation = np.full((depth, max_slots), -1, dtype=np.int64)

    def push(self, step: int, slot_ids, generation_ids, conf) -> None:
        """Record conf [R, gamma] (copied to the host) for slots at `step`."""
        row = step % (self.lag + 1)
        slots = _host_ints(slot_ids)
        self.conf[row, slots] = _host_floats(conf)
        self.stamp[row, slots] = step
        self.generation[row, slots] = _host_ints(generation_ids)

    def lagged(self, slot_ids, generation_ids, step: int) -> torch.Tensor:
        """Survivals [R, gamma] (float32, host) from step - lag; 1.0 where the entry is not valid."""
        return torch.from_numpy(self.lagged_np(slot_ids, generation_ids, step))

    def lagged_np(self, slot_ids, generation_ids, step: int) -> np.ndarray:
        slots = _host_ints(slot_ids)
        src = step - self.lag
        if src < 0:
            return np.ones((len(slots), self.gamma), dtype=np.float32)
        row = src % (self.lag + 1)
        ok = (self.stamp[row, slots] == src) & (self.generation[row, slots] == _host_ints(generation_ids))
        conf = np.where(ok[:, None], self.conf[row, slots], np.float32(1.0))
        return np.cumprod(conf, axis=1)


def _host_ints(x) -> np.ndarray:
    return x.detach().cpu().numpy().astype(np.int64) if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.int64)


def _host_floats(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)


@dataclass
class SchedulePlan:
    """What the runner needs for one verify step.

    budget: admitted draft tokens (host int; windows sum to at most this).
    windows: int64 [R] on the device of the confidences; request r verifies its anchor and
        drafts 1..windows[r] (cap-accept: verifies all gamma, commits at most windows[r]).
    verify_tokens: rows the target computes, known on the host: R + budget (compact) or
        R * (1 + gamma) (static, cap-accept); the runner sizes its graph tier from it.
    predicted_step_time: seconds per the cost table, nan without one.
    """
    step: int
    mode: str
    budget: int
    windows: torch.Tensor
    verify_tokens: int
    predicted_step_time: float


class CostScheduler:
    """The production scheduler: relay + lagged budget + fresh top-K allocation.

    mode "static": every request verifies gamma drafts. "compact": lagged budget, top-K windows,
    the target computes R + budget rows. "cap-accept": the same windows, but the target verifies
    full blocks (a measurement mode exposing the untrimmed ceiling). Without a cost table, or
    with a flat one, a non-static mode falls back to static and warns once per scheduler.
    """

    def __init__(self, gamma: int, max_slots: int, mode: str = "static",
                 cost_table: CostTable | None = None, lag: int = DEFAULT_LAG,
                 min_gain: float = DEFAULT_MIN_GAIN, survival_eps: float = DEFAULT_SURVIVAL_EPS):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.gamma, self.mode, self.cost_table = gamma, mode, cost_table
        self.min_gain, self.survival_eps = min_gain, survival_eps
        self.relay = ConfidenceRelay(max_slots, gamma, lag)
        self.next_step = 0
        self._can_trim = (cost_table is not None and bool(cost_table.measurements)
                          and not cost_table.is_flat())
        self._warned = False

    def effective_mode(self) -> str:
        """The mode actually used: static when trimming has no cost table to stand on."""
        if self.mode == "static":
            return "static"
        if not self._can_trim:
            if not self._warned:
                warnings.warn(f"verify_mode={self.mode!r} needs a profiled, non-flat cost table; "
                              "verifying full blocks (static) instead", stacklevel=3)
                self._warned = True
            return "static"
        return self.mode

    def _predict(self, bs: int, k: int) -> float:
        if self.cost_table is None or not self.cost_table.measurements:
            return float("nan")
        return self.cost_table.predict(bs, k)

    def plan(self, slot_ids, generation_ids, conf_current: torch.Tensor, *,
             step: int | None = None, record: bool = True) -> SchedulePlan:
        """Plan one verify step for the R requests given by slot_ids / generation_ids.

        conf_current: [R, gamma] calibrated conditional confidences of this step's drafts (any
        device). step defaults to an internal counter. With record=True the confidences are
        pushed into the relay after planning (a device->host copy); an overlapped loop passes
        record=False and calls `record` itself once the confidences are on the host.
        """
        if not len(slot_ids) == len(generation_ids) == conf_current.shape[0]:
            raise ValueError("slot_ids, generation_ids and conf_current must have one entry per request")
        step = self.next_step if step is None else step
        self.next_step = step + 1
        slot_ids, generation_ids = _host_ints(slot_ids), _host_ints(generation_ids)   # once, not per use
        R, full = conf_current.shape[0], conf_current.shape[0] * self.gamma
        mode = self.effective_mode()
        if mode == "static":
            windows = torch.full((R,), self.gamma, dtype=torch.int64, device=conf_current.device)
            plan = SchedulePlan(step, mode, full, windows, R + full, self._predict(R, full))
        else:
            times = self.cost_table.curve(R, full)
            if times[-1] <= (1.0 + self.min_gain) * times.min():
                # No survivals can make trimming pass the guard at this bs: Theta(K) / Theta(full)
                # <= T(full) / T(K), since the top-K survivals are at most all of them. Skip the search.
                budget = full
            else:
                lagged = self.relay.lagged_np(slot_ids, generation_ids, step)
                budget = budget_from_lagged(lagged, self.cost_table, self.min_gain, self.survival_eps)
            windows = allocate_windows_topk(conf_current, budget)
            verified = budget if mode == "compact" else full
            plan = SchedulePlan(step, mode, budget, windows, R + verified, float(times[verified]))
        if record:
            self.record(step, slot_ids, generation_ids, conf_current)
        return plan

    def record(self, step: int, slot_ids, generation_ids, conf) -> None:
        """Push a step's confidences into the relay (used by `plan(record=True)`)."""
        self.relay.push(step, slot_ids, generation_ids, conf)
