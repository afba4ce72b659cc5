"""The step-cost table: how long one verify step takes, T(bs, K), measured on this device.

The cost scheduler (cost_scheduler.py) trades expected accepted tokens against step time, so it
needs T(bs, K): seconds per step with bs requests and K extra (draft) verify tokens, M = bs + K
rows. Paper: DSpark section 5.1 (profiled step cost, the additive model). Walkthrough: chapter 07.

The idea
    `CostTable` keeps the table: the measured cost per point (`measurements`, what the scheduler
    reads), the per-point estimates before forcing (`raw`) and every timed step (`samples`). The
    scheduler reads the staircase itself (ceiling lookup in K, linear in bs at the same drafts
    per request). `force_monotone` makes a table non-decreasing in K (least-squares isotonic fit
    by default), and `is_flat` says when no batch size's cost grows with K, so that trimming
    could save nothing. The additive model T = bias + alpha(bs) + theta(M) is fitted and printed
    next to the table; it explains a profile but smooths its cliffs away, so it is not read.
    How a table is measured (rounds over the K grid, the round-adjusted estimate, the trend
    gate) is lab code: `nanodspark/lab/profile_stats.py` (`profile_step_cost`), run by
    `python -m nanodspark.bench profile`.

Invariants
    * The table read by the scheduler is non-decreasing in K at every measured batch size.
    * Nothing is forced across batch sizes (the scheduler compares steps of one bs only).
    * A table is keyed by model, dtype, device and graph tiers; it says nothing about others.

Defaults (the one place they are written down; every function takes them as parameters)
    DEFAULT_FLAT_REL_TOL = 0.01  a table is flat if T(bs, K) varies by < 1 % over K at every bs
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

DEFAULT_FLAT_REL_TOL = 0.01


def share_name(model_name: str, fraction: float) -> str:
    """The model name a partial step's table is keyed by: only `fraction` of the batch drafts
    (`bench profile --draft-fraction`; the cost scheduler's partial drafting)."""
    return f"{model_name} (draft {fraction:g})"


def lapsed_name(model_name: str) -> str:
    """The model name the table of a plain step that lets the drafter's context lapse is keyed
    by (`bench profile --draft-fraction 0 --lapse`; speculative.py)."""
    return f"{model_name} (lapsed)"


def share_of(model_name: str) -> float | None:
    """`share_name`'s inverse: the fraction, or None for a table of another kind."""
    head, sep, tail = model_name.rpartition(" (draft ")
    return float(tail[:-1]) if sep and tail.endswith(")") else None


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
    larger K (on the H200 that made compact trim for nothing: chapter 09).
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
        return all(s.max() - s.min() <= rel_tol * s.min() for _, s in self._rows().values())

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
