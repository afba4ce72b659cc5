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

The step-cost table (forcing, lookup) is cost_table.py; how it is profiled is lab/profile_stats.py.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .cost_table import CostTable

DEFAULT_LAG = 2
DEFAULT_MIN_GAIN = 0.04
DEFAULT_SURVIVAL_EPS = 1e-6
MODES = ("static", "compact", "cap-accept")


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
    # BEGIN STUDENT cost-scheduler: Algorithm 1: admit the cells of descending_cells(survivals) one by one
    #   (tau += a, one more verify token) while Theta = tau * sps(B) strictly improves; stop at the first
    #   non-improvement; return the best windows (int64 [R])
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
    # END STUDENT cost-scheduler


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
    # BEGIN STUDENT cost-scheduler: the global search: Theta(K) = (R + sum of the K largest lagged
    #   survivals, those below survival_eps as 0) / T(R, K) for K = 0 .. R*gamma (_step_time_curve); K* =
    #   the first argmax, kept only if Theta(K*) > (1 + min_gain) * Theta(full), else full; a flat cost
    #   gives full
    vals = np.sort(np.where(s >= survival_eps, s, 0.0).reshape(-1))[::-1]   # host numpy: no torch dispatch
    tau = R + np.concatenate([[0.0], np.cumsum(vals)])
    times = _step_time_curve(step_time, R, full)
    if times.max() - times.min() <= 0.0:
        return full
    theta = tau / times
    k_best = int(np.argmax(theta))
    return k_best if theta[k_best] > (1.0 + min_gain) * theta[full] else full
    # END STUDENT cost-scheduler


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
    # BEGIN STUDENT cost-scheduler: top-K windows with torch ops and no host sync: survival = cumprod of the
    #   confidences (NaN as 0, clamped to [0, 1]); admit the `budget` cells of largest survival, ties to the
    #   lower position then the lower request, never a cell of survival 0; window_r = admitted cells of row
    #   r
    a = torch.cumprod(conf_current.float().nan_to_num(0.0).clamp(0.0, 1.0), dim=1)
    R, gamma = a.shape
    k = max(0, min(int(budget), R * gamma))
    if k == R * gamma:                             # the full budget: every positive cell, no sort
        return (a > 0).sum(1)
    flat = a.t().reshape(-1)                       # index = position * R + request
    order = torch.sort(flat, descending=True, stable=True).indices[:k]
    admitted = torch.zeros_like(flat, dtype=torch.bool).index_fill_(0, order, True) & (flat > 0)
    return admitted.view(gamma, R).sum(0)
    # END STUDENT cost-scheduler


def _topk_windows_np(conf: np.ndarray, budget: int) -> np.ndarray:
    """`allocate_windows_topk` for host confidences, in numpy (same order and tie-break)."""
    # BEGIN STUDENT cost-scheduler: the same top-K rule on a host numpy array (what CPU tensors take), int64
    #   windows; the simplest correct body is return _topk_windows_torch(torch.from_numpy(conf),
    #   budget).numpy(), the reference's is O(R*gamma) with np.partition
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
    # END STUDENT cost-scheduler


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

    def budget(self, slot_ids, generation_ids, step: int) -> tuple[int, bool, float]:
        """The host's half of planning a verify step of R = len(slot_ids) requests whose windows
        the device chooses: (budget, trim, predicted step time). The budget comes from the
        survivals pushed `lag` steps ago (the relay), never from this step's drafts, which the
        host has not seen: that is what lets the device pick the windows (top-K under the
        budget) and the step be launched without waiting."""
        R, mode = len(slot_ids), self.effective_mode()
        full = R * self.gamma
        if mode == "static":
            return full, False, self._predict(R, full)
        times = self.cost_table.curve(R, full)
        if times[-1] <= (1.0 + self.min_gain) * times.min():
            budget = full          # no survivals can pass the guard at this batch size
        else:
            lagged = self.relay.lagged_np(_host_ints(slot_ids), _host_ints(generation_ids), step)
            budget = budget_from_lagged(lagged, self.cost_table, self.min_gain, self.survival_eps)
        return budget, True, float(times[budget if mode == "compact" else full])

    def record(self, step: int, slot_ids, generation_ids, conf) -> None:
        """Push a step's confidences into the relay (used by `plan(record=True)`)."""
        self.relay.push(step, slot_ids, generation_ids, conf)
