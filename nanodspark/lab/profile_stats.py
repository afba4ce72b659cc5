"""Profiling statistics of the step-cost table: rounds, the round-adjusted estimate, the trend gate.

The cost scheduler reads T(bs, K), the seconds of one verify step with bs requests and K extra
(draft) verify tokens, from a `CostTable` (cost_table.py). This file measures one. Paper: DSpark
§5.1 (profiled step cost). Walkthrough: chapter 07 §4; what the statistics fixed: chapter 09 §5a.

The idea
    `profile_step_cost` runs real steps of every (bs, K) of a grid and times them. Each batch
    size's K grid is visited in rounds (a new seeded order per round), with one untimed step of
    the same shape before each timed one, and an optional untimed `prepare(bs, K)` (the bench
    uses it to keep the context length fixed). A round is a block: the cost per point is the
    median over rounds after each round's level is removed (`round_adjusted`), because the
    machine has slow stretches that last about a round. `force_monotone` (cost_table.py) then
    makes the table non-decreasing in K. Last, `gate_by_trend` asks of each batch size whether
    its timings rise with K at all beyond their noise (a Mann-Kendall trend test over every
    timed step, `trend_z`); where they do not, the row is made flat, so the scheduler never
    trims on a slope that the profile cannot tell from noise. What is timed (whole engine
    steps at a fixed context) is `bench_profile.py`'s.

Invariants
    * Every timed step is kept in the table's `samples`, in round order per (bs, K).
    * A batch size whose trend z is below `trend_z_min` has one cost at every K (flat).
    * Warm-up rounds and settling steps are never timed.

Defaults (the one place they are written down; every function takes them as parameters)
    DEFAULT_REPEATS = 5          timed rounds per batch size in `profile_step_cost`
    DEFAULT_WARMUP = 1           untimed rounds over a batch size's K grid before the timed ones
    DEFAULT_SETTLE = 1           untimed steps of the same (bs, K) right before each timed one
    DEFAULT_TREND_Z = 1.645      one-sided 5 %: the z a batch size's rise with K must reach
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from ..cost_table import CostTable, force_monotone

DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 1
DEFAULT_SETTLE = 1
DEFAULT_TREND_Z = 1.645

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
    rho = _round_levels(L, iterations)
    return np.exp(np.median(L - rho[None, :], axis=1)).tolist()


def _round_levels(L: np.ndarray, iterations: int = 3) -> np.ndarray:
    """Median polish of log timings L [K, rounds]: each round's level rho [rounds], centred."""
    rho = np.zeros(L.shape[1])
    for _ in range(iterations):
        mu = np.median(L - rho[None, :], axis=1)
        rho = np.median(L - mu[:, None], axis=0)
        rho -= np.median(rho)
    return rho


def trend_z(ks: Sequence[int], samples_by_k: Sequence[Sequence[float]]) -> float:
    """Mann-Kendall z of step time rising with K, over every timed step of one batch size.

    samples_by_k[i][r]: round r's timing at K = ks[i] (the profiler's [K, rounds] grid); each
    round's level is removed first (`_round_levels`). S counts, over all pairs of timings at
    different K, +1 where the larger K took longer and -1 where it was quicker; z = (S - sign
    S) / sd(S), with sd corrected for the ties in K. Rank-based, so a bimodal machine (on the
    H200, steps of one shape near 30 or near 47 ms) moves it no more than any other outlier.
    z > 1.645: a rise at the one-sided 5 % level.
    """
    L = np.log(np.maximum(np.asarray(samples_by_k, dtype=np.float64), 1e-12))
    if L.ndim != 2 or L.shape[0] < 2:
        return 0.0
    y = (L - _round_levels(L)[None, :]).reshape(-1)
    x = np.repeat(np.asarray(ks, dtype=np.float64), L.shape[1])
    s = float(np.sum(np.triu(np.sign(x[None, :] - x[:, None]) * np.sign(y[None, :] - y[:, None]), 1)))
    n = x.size
    t = np.unique(x, return_counts=True)[1]
    var = (n * (n - 1) * (2 * n + 5) - np.sum(t * (t - 1) * (2 * t + 5))) / 18.0
    return 0.0 if var <= 0 or s == 0 else (s - np.sign(s)) / float(np.sqrt(var))


def gate_by_trend(table: "CostTable", z_min: float = DEFAULT_TREND_Z) -> dict[int, float]:
    """Flatten (in place) every batch size of `table` whose timings do not rise with K at
    z >= z_min; returns {bs: z}. A flattened row takes the median of its per-K estimates at
    every K, so predicted step times keep their level. Needs `table.samples` (rows without
    them, or with one round, are left as they are). Records z and the flattened batch sizes in
    `table.notes` and refits the additive model."""
    rows: dict[int, list[int]] = {}
    for b, k in sorted(table.samples):
        rows.setdefault(b, []).append(k)
    zs: dict[int, float] = {}
    measurements = dict(table.measurements)              # a new dict, so the table's caches see the change
    for b, ks in rows.items():
        grid = [table.samples[(b, k)] for k in ks]
        if len({len(g) for g in grid}) != 1 or len(grid[0]) < 2:
            continue
        zs[b] = float(trend_z(ks, grid))
        if zs[b] < z_min:
            level = float(np.median([table.raw.get((b, k), measurements[(b, k)]) for k in ks]))
            measurements.update({(b, k): level for k in ks})
    table.measurements = measurements
    table.notes = {**table.notes, "trend_z_min": z_min, "trend_z": {str(b): round(z, 2) for b, z in zs.items()},
                   "flattened": [b for b, z in zs.items() if z < z_min]}
    table.fit_additive()
    return zs


def profile_step_cost(run_step: Callable[[int, int], None], batch_sizes: Sequence[int],
                      extra_tokens: Sequence[int] | Callable[[int], Sequence[int]],
                      repeats: int = DEFAULT_REPEATS, timer: Callable[[], float] = time.perf_counter,
                      warmup: int = DEFAULT_WARMUP, model_name: str = "", dtype: str = "",
                      device: str = "", graph_tiers: Sequence[int] = (), verbose: bool = True,
                      settle: int = DEFAULT_SETTLE, shuffle: bool = True,
                      monotone: str = "isotonic", estimator: str = "rounds",
                      trend_z_min: float | None = DEFAULT_TREND_Z) -> CostTable:
    """Time run_step(bs, K) on a (bs, K) staircase; a cost per point (`estimator`: "rounds" =
    `round_adjusted`, each round's level removed; "median" = plain median of the repeats), forced
    monotone (`force_monotone` with `monotone` as its method), batch sizes without a significant
    rise flattened (`gate_by_trend` at `trend_z_min`; None: not gated), additive fit.

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
    if trend_z_min is not None and repeats > 1:
        zs = gate_by_trend(table, trend_z_min)            # (refits the additive model)
        if verbose:
            print("trend z by bs (flat below %.2f): " % trend_z_min
                  + " ".join(f"{b}: {z:.2f}" for b, z in zs.items()))
    else:
        table.fit_additive()
    if verbose:
        print(table.format_fit())
    return table
