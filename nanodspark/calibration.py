"""Calibration of the confidence head: metrics and Sequential Temperature Scaling (STS).

Paper: DSpark sections 3.2.1 (confidence head, cumulative survival, STS) and 4.3.3 (ECE / AUROC of
the raw and calibrated head). Walkthrough: chapter 06.

The idea
    The confidence head gives, per draft position k, a logit z_k whose sigmoid c_k is meant to
    be the *conditional* probability that draft token k survives verification given tokens
    1..k-1 survived. The scheduler uses the *survival* a_k = c_1 * ... * c_k (a cumulative
    product) as an absolute probability, so the head must be calibrated, not only rank well.
    STS fits one temperature T_k per position, left to right: with T_1..T_{k-1} fixed, it picks
    the T on a log grid that minimises the ECE of a_k = prod_{i<k} sigmoid(z_i/T_i) *
    sigmoid(z_k/T) against the prefix label y_k (1 iff drafts 1..k were all accepted).
    At run time c_k = sigmoid(z_k / T_k) (`apply_temperatures`).
    STS with shifts (`fit_sts_shifted`, our addition): c_k = sigmoid(z_k / T_k + s_k). A
    temperature cannot lower the mean of confidences that sit near 1/2, so a constant
    over-prediction survives STS; a per-position shift s_k removes it. Each position alternates
    a temperature and a shift search minimising the log-loss of a_k (chapter 06 says why not ECE).

Invariants
    * Labels are prefix labels: y_k = 1 implies y_j = 1 for j < k. `valid[n, k]` says position k
      of proposal n exists (was drafted and verified); metrics at position k use only valid rows.
    * Temperature scaling is strictly monotone per position, so position 1's AUROC is unchanged.
    * Every metric is computed in float64 on the CPU copy of its inputs; nothing here touches a
      device stream, and nothing is kept at module level.
    * `OnlineCalibrationMetrics` holds only fixed-size histograms (memory is O(gamma * n_bins)).

Definitions (on the cumulative survival vs the prefix label, per position): ECE over
equal-width bins on [0, 1]; AUROC as the Mann-Whitney statistic (average ranks for ties, nan
with one class); Brier; the ECE floor (what a calibrated predictor shows at the same N); the
offset, mean prediction - observed rate, with a bootstrap interval over prompts.

Defaults (the one place they are written down; every function takes them as parameters)
    N_BINS = 20                 equal-width ECE / reliability bins (DeepSpec's evaluator)
    STS_T_MIN, STS_T_MAX = 0.05, 20.0 and STS_GRID_POINTS = 256, plus T = 1.0 (DeepSpec PR #63)
    STS tie-break: among grid temperatures with equal ECE, the one closest to 1 (|log T| least).
    STS_SHIFT_MAX = 2.0, STS_SHIFT_POINTS = 201 (step 0.02, 0 included), STS_SHIFT_ROUNDS = 3;
    shift tie-break: the smallest |s|.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

N_BINS = 20            # equal-width bins for ECE and reliability diagrams
STS_T_MIN = 0.05       # smallest temperature on the STS grid
STS_T_MAX = 20.0       # largest temperature on the STS grid
STS_GRID_POINTS = 256  # log-spaced points between STS_T_MIN and STS_T_MAX (T = 1.0 is added)
STS_SHIFT_MAX = 2.0    # largest |logit shift| searched by fit_sts_shifted
STS_SHIFT_POINTS = 201 # evenly spaced shifts in [-STS_SHIFT_MAX, STS_SHIFT_MAX]
STS_SHIFT_ROUNDS = 3   # temperature <-> shift alternations per position


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def as_float64(x) -> torch.Tensor:
    """Any array-like -> a float64 CPU tensor (metrics are host-side; lists are read as float64)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def _bin_index(pred: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Equal-width bin of each prediction in [0, 1]; 1.0 falls into the last bin."""
    return (pred.clamp(0.0, 1.0) * n_bins).long().clamp_(max=n_bins - 1)


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------

def ece(pred, label, n_bins: int = N_BINS) -> float:
    """Expected calibration error: sum_b n_b/N |mean_pred_b - mean_label_b| (equal-width bins)."""
    # BEGIN STUDENT sts ece
    p, y = as_float64(pred).flatten(), as_float64(label).flatten()
    if p.numel() == 0:
        return float("nan")
    b = _bin_index(p, n_bins)
    gap = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, b, p - y)
    return float(gap.abs().sum() / p.numel())
    # END STUDENT sts


def ece_noise_floor(pred, n_bins: int = N_BINS, draws: int = 32, seed: int = 0) -> float:
    """The ECE a *perfectly* calibrated predictor would show with these predictions and this
    sample size (labels drawn as Bernoulli(pred), mean over `draws`). Binned ECE is biased
    upward by sampling noise (about 0.4 * sqrt(n_bins / N)); a measured ECE near this floor
    means "calibrated within what the sample can resolve"."""
    p = as_float64(pred).flatten()
    if p.numel() == 0:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    p = p.clamp(0.0, 1.0)
    return sum(ece(p, torch.bernoulli(p, generator=g), n_bins) for _ in range(draws)) / draws


def auroc(pred, label) -> float:
    """Exact area under the ROC curve (rank statistic, average ranks for ties); nan if one class."""
    p, y = as_float64(pred).flatten(), as_float64(label).flatten() > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(p, sorted=True, return_inverse=True, return_counts=True)
    first_rank = torch.cumsum(counts, 0) - counts + 1          # 1-based rank of each group's first
    avg_rank = first_rank.to(torch.float64) + (counts.to(torch.float64) - 1) / 2
    rank_sum_pos = avg_rank[inverse][y].sum()
    return float((rank_sum_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier(pred, label) -> float:
    """Mean squared error between predicted probability and the 0/1 label."""
    p, y = as_float64(pred).flatten(), as_float64(label).flatten()
    return float(((p - y) ** 2).mean()) if p.numel() else float("nan")


@dataclass(frozen=True)
class ReliabilityBins:
    """Per-bin means and counts of a reliability diagram; empty bins have nan means."""
    edges: torch.Tensor       # [n_bins + 1]
    mean_pred: torch.Tensor   # [n_bins]
    mean_label: torch.Tensor  # [n_bins]
    count: torch.Tensor       # [n_bins] int64


def reliability(pred, label, n_bins: int = N_BINS) -> ReliabilityBins:
    """Equal-width reliability bins: (mean predicted, mean observed, count) per bin."""
    p, y = as_float64(pred).flatten(), as_float64(label).flatten()
    b = _bin_index(p, n_bins)
    count = torch.bincount(b, minlength=n_bins)
    sp = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, b, p)
    sy = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, b, y)
    denom = count.to(torch.float64)
    nan = torch.full_like(denom, float("nan"))
    return ReliabilityBins(
        edges=torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64),
        mean_pred=torch.where(count > 0, sp / denom.clamp(min=1), nan),
        mean_label=torch.where(count > 0, sy / denom.clamp(min=1), nan),
        count=count,
    )


# ---------------------------------------------------------------------------------------------
# survival and STS
# ---------------------------------------------------------------------------------------------

def survival(conf: torch.Tensor) -> torch.Tensor:
    """Cumulative survival a_k = c_1 * ... * c_k along the last dim (the chain rule)."""
    return torch.cumprod(conf, dim=-1)


def apply_temperatures(logits: torch.Tensor, temps, shifts=None) -> torch.Tensor:
    """Calibrated conditional confidences c_k = sigmoid(z_k / T_k + s_k); logits [..., gamma]
    (shifts default to 0: plain STS).

    Runs on the logits' device and dtype (temps are moved there), so the engine can call it on
    the drafter output without a host sync.
    """
    t = torch.as_tensor(temps, dtype=logits.dtype, device=logits.device)
    if shifts is None:
        return torch.sigmoid(logits / t)
    return torch.sigmoid(logits / t + torch.as_tensor(shifts, dtype=logits.dtype, device=logits.device))


def sts_grid(t_min: float = STS_T_MIN, t_max: float = STS_T_MAX,
             n_points: int = STS_GRID_POINTS) -> torch.Tensor:
    """Sorted float64 grid: n_points log-spaced temperatures in [t_min, t_max] plus T = 1.0."""
    g = torch.logspace(math.log10(t_min), math.log10(t_max), n_points, dtype=torch.float64)
    return torch.unique(torch.cat([g, torch.ones(1, dtype=torch.float64)]))


def _ece_per_candidate(pred: torch.Tensor, label: torch.Tensor, n_bins: int) -> torch.Tensor:
    """ECE of each column of pred [N, G] against label [N]; returns [G]."""
    n, g = pred.shape
    b = _bin_index(pred, n_bins)                                   # [N, G]
    flat = b + n_bins * torch.arange(g).unsqueeze(0)              # one histogram per column
    gap = torch.zeros(g * n_bins, dtype=torch.float64)
    gap.index_add_(0, flat.flatten(), (pred - label.unsqueeze(1)).flatten())
    return gap.view(g, n_bins).abs().sum(1) / n


def shift_grid(s_max: float = STS_SHIFT_MAX, n_points: int = STS_SHIFT_POINTS) -> torch.Tensor:
    """Sorted float64 grid of logit shifts, evenly spaced in [-s_max, s_max] (0 included when
    n_points is odd)."""
    return torch.linspace(-s_max, s_max, n_points, dtype=torch.float64)


def _nll_per_candidate(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Mean log-loss of each column of pred [N, G] against label [N]; returns [G]."""
    p = pred.clamp(1e-12, 1.0 - 1e-12)
    y = label.unsqueeze(1)
    return -(y * p.log() + (1.0 - y) * (1.0 - p).log()).mean(0)


def _pick(err: torch.Tensor, grid: torch.Tensor, distance: torch.Tensor) -> float:
    """The grid value of least error; among equal errors the one of least `distance`."""
    best = torch.isclose(err, err.min(), rtol=0.0, atol=1e-12)
    return float(grid[torch.where(best, distance, torch.inf).argmin()])


def _fit_sequential(logits, labels, valid, temp_grid, shifts_grid, rounds: int, n_bins: int,
                    objective: str = "ece"):
    z, y = as_float64(logits), as_float64(labels)
    v = torch.ones_like(z, dtype=torch.bool) if valid is None else torch.as_tensor(valid).cpu().bool()
    t_dist, s_dist = temp_grid.log().abs(), shifts_grid.abs()   # tie-breaks: T near 1, s near 0
    gamma = z.shape[-1]
    temps = torch.ones(gamma, dtype=torch.float64)
    shifts = torch.zeros(gamma, dtype=torch.float64)
    prefix = torch.ones(z.shape[0], dtype=torch.float64)        # prod_{i<k} c_i (already fitted)
    # BEGIN STUDENT sts fit
    for k in range(gamma):
        rows = v[:, k]
        if rows.any():
            p, zk, yk = prefix[rows].unsqueeze(1), z[rows, k].unsqueeze(1), y[rows, k]
            loss = ((lambda pred: _ece_per_candidate(pred, yk, n_bins)) if objective == "ece"
                    else (lambda pred: _nll_per_candidate(pred, yk)))
            for _ in range(rounds):
                temps[k] = _pick(loss(p * torch.sigmoid(zk / temp_grid + shifts[k])), temp_grid, t_dist)
                if len(shifts_grid) > 1:
                    shifts[k] = _pick(loss(p * torch.sigmoid(zk / temps[k] + shifts_grid)), shifts_grid, s_dist)
        prefix = prefix * torch.sigmoid(z[:, k] / temps[k] + shifts[k])
    # END STUDENT sts
    return temps, shifts


def fit_sts(logits, labels, valid=None, grid=None, n_bins: int = N_BINS) -> torch.Tensor:
    """Sequential Temperature Scaling: one temperature per position, fitted left to right.

    logits, labels: [N, gamma] raw confidence logits z and prefix labels y (0/1).
    valid: [N, gamma] bool, position k exists for proposal n (default: all True).
    grid: candidate temperatures (default `sts_grid()`).
    Returns temperatures [gamma] (float64). A position with no valid rows keeps T = 1.
    """
    grid = sts_grid() if grid is None else as_float64(grid)
    return _fit_sequential(logits, labels, valid, grid, torch.zeros(1, dtype=torch.float64), 1, n_bins)[0]


def fit_sts_shifted(logits, labels, valid=None, grid=None, shifts=None, n_bins: int = N_BINS,
                    rounds: int = STS_SHIFT_ROUNDS) -> tuple[torch.Tensor, torch.Tensor]:
    """STS with a logit shift per position: (temperatures [gamma], shifts [gamma]), float64.

    Same sequential order as `fit_sts`; at each position a temperature search on `grid` and a
    shift search on `shifts` (default `shift_grid()`) alternate `rounds` times, starting from
    T = 1, s = 0. The objective is the log-loss of the survival, not its ECE: with a shift, a
    huge T and s = logit(mean rate) make a constant predictor whose ECE is ~0 and whose ranking
    is gone; a proper scoring rule does not reward that. A position with no valid rows keeps (1, 0).
    """
    grid = sts_grid() if grid is None else as_float64(grid)
    return _fit_sequential(logits, labels, valid, grid, shift_grid() if shifts is None else as_float64(shifts),
                           rounds, n_bins, objective="nll")


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

@dataclass
class PositionMetrics:
    """Calibration metrics of one position's cumulative survival vs its prefix label."""
    count: int
    ece: float
    auroc: float
    brier: float
    mean_pred: float
    mean_observed: float
    ece_floor: float = float("nan")   # ECE of a perfectly calibrated predictor at this count


def offset_interval(surv, labels, valid, groups, draws: int = 200, level: float = 0.9,
                    seed: int = 0) -> list[tuple[float, float, float]]:
    """Per position: (mean prediction - observed rate, lower, upper) with a `level` bootstrap
    interval that resamples *groups* (prompts), not proposals.

    Proposals of one prompt are correlated (a looping prompt accepts everything), so an interval
    that treats them as independent is too narrow. An interval that excludes 0 says the head
    is offset beyond what the prompts' variability explains; a temperature cannot fix that.
    """
    a, y = as_float64(surv), as_float64(labels)
    v = torch.ones_like(a, dtype=torch.bool) if valid is None else torch.as_tensor(valid).cpu().bool()
    _, gid = torch.unique(torch.as_tensor(groups).cpu(), return_inverse=True)
    n = max(1, int(gid.max()) + 1 if gid.numel() else 0)
    gen = torch.Generator().manual_seed(seed)
    # bootstrap weights: how often each prompt is drawn in each of `draws` resamples
    picks = torch.randint(n, (draws, n), generator=gen)
    w = torch.zeros(draws, n, dtype=torch.float64).scatter_add_(1, picks, torch.ones(draws, n, dtype=torch.float64))
    out = []
    for k in range(a.shape[-1]):
        m = v[:, k]
        if not m.any():
            out.append((float("nan"),) * 3)
            continue
        diff = torch.bincount(gid[m], weights=a[m, k] - y[m, k], minlength=n)   # per prompt
        cnt = torch.bincount(gid[m], minlength=n).double()
        boot = (w @ diff) / (w @ cnt).clamp_min(1.0)
        lo, hi = torch.quantile(boot, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
        out.append((float(diff.sum() / cnt.sum()), float(lo), float(hi)))
    return out


def position_metrics(surv, labels, valid=None, n_bins: int = N_BINS) -> list[PositionMetrics]:
    """Per-position metrics of survivals [N, gamma] against prefix labels, on valid rows only."""
    a, y = as_float64(surv), as_float64(labels)
    v = torch.ones_like(a, dtype=torch.bool) if valid is None else torch.as_tensor(valid).cpu().bool()
    out = []
    for k in range(a.shape[-1]):
        pk, yk = a[v[:, k], k], y[v[:, k], k]
        n = int(pk.numel())
        out.append(PositionMetrics(
            count=n, ece=ece(pk, yk, n_bins), auroc=auroc(pk, yk), brier=brier(pk, yk),
            mean_pred=float(pk.mean()) if n else float("nan"),
            mean_observed=float(yk.mean()) if n else float("nan"),
            ece_floor=ece_noise_floor(pk, n_bins)))
    return out


@dataclass
class CalibrationReport:
    """Per-position metrics before (raw, T = 1) and after STS (with shifts when `shifts`)."""
    temperatures: list[float]
    before: list[PositionMetrics]
    after: list[PositionMetrics]
    n_bins: int = N_BINS
    shifts: list[float] | None = None

    def mean_ece(self, which: str = "after") -> float:
        """Count-weighted mean ECE over positions ("before" or "after")."""
        rows = getattr(self, which)
        total = sum(m.count for m in rows)
        return sum(m.ece * m.count for m in rows if m.count) / total if total else float("nan")

    def format(self) -> str:
        """A plain-text table, one line per position."""
        head = (f"{'pos':>3} {'T':>7} {'shift':>6} {'n':>7} | {'ECE raw':>8} {'ECE sts':>8} | {'AUROC raw':>9} "
                f"{'AUROC sts':>9} | {'Brier raw':>9} {'Brier sts':>9} | {'pred raw':>8} "
                f"{'pred sts':>8} {'observed':>8} | {'ECE floor':>9}")
        lines = [head, "-" * len(head)]
        shifts = self.shifts or [0.0] * len(self.temperatures)
        for k, (t, s, b, a) in enumerate(zip(self.temperatures, shifts, self.before, self.after)):
            lines.append(f"{k + 1:>3} {t:>7.3f} {s:>+6.2f} {b.count:>7d} | {b.ece:>8.4f} {a.ece:>8.4f} | "
                         f"{b.auroc:>9.4f} {a.auroc:>9.4f} | {b.brier:>9.4f} {a.brier:>9.4f} | "
                         f"{b.mean_pred:>8.4f} {a.mean_pred:>8.4f} {b.mean_observed:>8.4f} | "
                         f"{a.ece_floor:>9.4f}")
        lines.append(f"mean ECE (count-weighted): raw {self.mean_ece('before'):.4f} -> "
                     f"STS {self.mean_ece('after'):.4f}")
        return "\n".join(lines)


def calibration_report(logits, labels, valid=None, temps=None, n_bins: int = N_BINS,
                       shifts=None) -> CalibrationReport:
    """Metrics of the raw head (T = 1) and of the head with `temps` (and `shifts`, if given);
    temps=None fits plain STS."""
    z = as_float64(logits)
    temps = fit_sts(z, labels, valid, n_bins=n_bins) if temps is None else as_float64(temps)
    raw = survival(torch.sigmoid(z))
    cal = survival(apply_temperatures(z, temps, None if shifts is None else as_float64(shifts)))
    return CalibrationReport(
        temperatures=[float(t) for t in temps],
        before=position_metrics(raw, labels, valid, n_bins),
        after=position_metrics(cal, labels, valid, n_bins),
        n_bins=n_bins,
        shifts=None if shifts is None else [float(x) for x in shifts],
    )


# ---------------------------------------------------------------------------------------------
# online metrics (the engine feeds these while serving)
# ---------------------------------------------------------------------------------------------

@dataclass
class OnlineCalibrationMetrics:
    """Running per-position calibration of predicted survival vs observed prefix acceptance.

    Memory is three [gamma, n_bins] histograms (count, sum of predictions, sum of labels), so it
    can run forever. `update` takes the survivals the scheduler used and the prefix labels the
    verifier produced; only positions that were actually verified (valid) should be fed, since
    a trimmed position has no label.
    """
    gamma: int
    n_bins: int = N_BINS
    count: torch.Tensor = field(init=False)
    sum_pred: torch.Tensor = field(init=False)
    sum_label: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        shape = (self.gamma, self.n_bins)
        self.count = torch.zeros(shape, dtype=torch.float64)
        self.sum_pred = torch.zeros(shape, dtype=torch.float64)
        self.sum_label = torch.zeros(shape, dtype=torch.float64)

    def update(self, surv, labels, valid=None) -> None:
        """Accumulate survivals [N, gamma] and prefix labels [N, gamma] where valid [N, gamma]."""
        a, y = as_float64(surv), as_float64(labels)
        v = torch.ones_like(a, dtype=torch.bool) if valid is None else torch.as_tensor(valid).cpu().bool()
        pos = torch.arange(self.gamma).expand_as(a)
        cell = (pos * self.n_bins + _bin_index(a, self.n_bins))[v]
        self.count.view(-1).index_add_(0, cell, torch.ones_like(a[v]))
        self.sum_pred.view(-1).index_add_(0, cell, a[v])
        self.sum_label.view(-1).index_add_(0, cell, y[v])

    def samples(self) -> torch.Tensor:
        """Number of observations per position [gamma]."""
        return self.count.sum(1)

    def ece(self) -> torch.Tensor:
        """Running ECE per position [gamma]; nan where a position has no observation yet."""
        n = self.samples()
        e = (self.sum_pred - self.sum_label).abs().sum(1) / n.clamp(min=1)
        return torch.where(n > 0, e, torch.full_like(e, float("nan")))

    def mean_pred(self) -> torch.Tensor:
        n = self.samples()
        return torch.where(n > 0, self.sum_pred.sum(1) / n.clamp(min=1), torch.full_like(n, float("nan")))

    def mean_observed(self) -> torch.Tensor:
        n = self.samples()
        return torch.where(n > 0, self.sum_label.sum(1) / n.clamp(min=1), torch.full_like(n, float("nan")))
