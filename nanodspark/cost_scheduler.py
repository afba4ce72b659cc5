"""Hardware-aware prefix scheduler: how many draft tokens the target verifies, and whose.

Paper: DSpark section 3.2.2 (Algorithm 1 and Appendix A on why it stops early), 5.2 (production: a
budget from confidences two steps old, windows by top-K over the fresh ones). Walkthrough: 07.

The idea
    Request r has conditional confidences c_{r,1..gamma}; its survival a_{r,k} = c_{r,1} ...
    c_{r,k} is the probability that draft k is accepted. Verifying one more draft of r adds
    a_{r,k} expected tokens and one verify token of cost. With a profiled step cost, the
    scheduler picks the windows (drafts verified per request) that maximise expected tokens per
    second, Theta = tau / T(B): B = R + sum(windows) verify tokens, tau = R + the admitted
    survivals. a_{r,k} never increases with k, so admitting cells in globally descending
    survival order always yields prefix windows.

Lossless means: admitting draft x_{r,k} must not depend on x_{r,k} itself (its value feeds
c_{r,k+1} through the Markov feature). Two ways, one function each:
    * `algorithm1`, the paper's synchronous rule: admit while Theta strictly improves and stop
      at the first non-improvement, before a_{r,k+1} is ever looked at.
    * production: `budget_from_lagged` sets the *number* K of drafts from confidences `lag`
      steps old (a global argmax, causal by the lag), and `topk_windows` admits the K cells of
      largest *current* survival, ties to the lower position: no cell that depends on x_{r,k}
      can outrank (r, k), so "window_r >= k" is decided before x_{r,k} matters.
      `CostScheduler.budget` is the host's half of a step, `choose_windows` the device's.
    * partial drafting: `CostScheduler.draft_choice` may let only the requests of largest lagged
      survival draft (a profiled share; none: a plain step, `lapse_after`); lossless by the lag.

Invariants
    * Cells are ordered by survival descending, then position, then request
      (`descending_cells`); a cell of survival 0 is never admitted; windows are prefixes.
    * `topk_windows` / `choose_windows` never read a device value on the host.
    * Without a profiled, non-flat cost table nothing is trimmed (full budget R * gamma).
    * The relay gives survival 1.0 (verify everything) to a slot whose lagged entry is
      missing, stale (another step) or recycled (another generation id).

Defaults (every function takes them as parameters)
    DEFAULT_LAG = 2              steps between the confidences the budget uses and now (paper 5.2)
    DEFAULT_MIN_GAIN = 0.04      trim only if predicted Theta beats full verify by > 4 % (TRT-LLM's too)
    DEFAULT_SURVIVAL_EPS = 1e-6  lagged survivals below this count as 0 in the budget search
    DEFAULT_PLAIN_HOLD = 8       steps a plain choice, or a clear one of every row drafting, holds (`draft_choice`)
The step-cost table is cost_table.py; how it is profiled, lab/profile_stats.py."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .cost_table import CostTable

DEFAULT_LAG = 2
DEFAULT_MIN_GAIN = 0.04
DEFAULT_SURVIVAL_EPS = 1e-6
DEFAULT_PLAIN_HOLD = 8
CLOCK_DECAY = 0.95           # the step clock's memory: about 20 steps of a kind
CLOCK_MIN_STEPS = 8          # steps of a kind timed before its correction applies
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
    # BEGIN STUDENT cost-scheduler algorithm1
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
    # BEGIN STUDENT cost-scheduler budget
    vals = np.sort(np.where(s >= survival_eps, s, 0.0).reshape(-1))[::-1]   # host numpy: no torch dispatch
    tau = R + np.concatenate([[0.0], np.cumsum(vals)])
    times = _step_time_curve(step_time, R, full)
    if times.max() - times.min() <= 0.0:
        return full
    theta = tau / times
    k_best = int(np.argmax(theta))
    return k_best if theta[k_best] > (1.0 + min_gain) * theta[full] else full
    # END STUDENT cost-scheduler


def topk_windows(conf: torch.Tensor, budget, active: torch.Tensor | None = None) -> torch.Tensor:
    """Windows [R] (int64, on conf's device, no host sync): each row's count of the `budget`
    cells of largest survival. conf [R, gamma] conditional confidences (NaN counts as 0);
    budget a host int or a 0-dim tensor on conf's device; rows where `active` is False admit
    nothing and take no share of the budget. Order: `descending_cells`'."""
    # BEGIN STUDENT cost-scheduler topk
    a = torch.cumprod(conf.float().nan_to_num(0.0).clamp(0.0, 1.0), dim=1)
    if active is not None:
        a = torch.where(active[:, None], a, -1.0)
    R, gamma = a.shape
    flat = a.t().reshape(-1)                                   # index = position * R + request
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return ((rank < budget) & (flat > 0)).view(gamma, R).sum(0)
    # END STUDENT cost-scheduler


def choose_windows(conf: torch.Tensor, active: torch.Tensor, budget: torch.Tensor, trim: torch.Tensor,
                   window_cap: torch.Tensor) -> torch.Tensor:
    """The decode step's windows [R] (speculative.SpecStep): with `trim`, `topk_windows` under
    `budget` over the active rows; without, full blocks. Capped by window_cap [R]."""
    R, g = conf.shape
    if g == 0:
        return torch.zeros(R, dtype=torch.long, device=conf.device)
    if trim.device.type == "cpu" and not bool(trim):    # on the host the branch costs no sync: skip the sort
        return window_cap.clamp(max=g)
    return torch.minimum(torch.where(trim, topk_windows(conf, budget, active), g), window_cap)


@dataclass
class DraftChoice:
    """A step in which only some requests draft (`CostScheduler.draft_choice`)."""
    fraction: float          # the share of the batch that drafts (0: a plain step)
    order: np.ndarray | None  # the plan's rows, the ceil(fraction * R) drafting ones first (None: none draft)
    budget: int              # draft tokens to verify (over the drafting rows)
    predicted: float         # T(R, budget, drafting rows), seconds
    upkeep: bool = True      # False: a plain step deep in a plain run, the drafter's context lapses


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
        # each slot's last drafted confidences, and their running mean over every request
        self.last = np.ones((max_slots, gamma), dtype=np.float32)
        self.last_generation = np.full(max_slots, -1, dtype=np.int64)
        self.mean = np.ones(gamma, dtype=np.float32)
        # a plain step's row is written lazily: what its slots carry (`last`, or the mean then) is
        # read from `last` until a fresh push is about to change it (`_settle_plain`), and its
        # stamps wait, as (step, slots, generations), until the row is read (`_stamp`)
        self.plain = np.zeros(depth, dtype=bool)
        self.plain_mean = np.ones((depth, gamma), dtype=np.float32)
        self._stamps: list[tuple | None] = [None] * depth

    def push(self, step: int, slot_ids, generation_ids, conf, drafted=True) -> None:
        """Record conf [R, gamma] (copied to the host) for slots at `step`. A row that did not
        draft (`drafted`: a bool for every row, or one per row; False on a plain step) has no
        confidences of its own: its slot carries its last ones forward (a request that never
        drafted: the running mean over the batches' rows), so its budget `lag` steps later still
        reads what the drafter last said, never a survival of 1.0. A plain step brings no news:
        the mean holds, and its row is only stamped, when read (its values are `last`'s)."""
        row = step % (self.lag + 1)
        if not _any(drafted):                 # a plain step: every row carries its last ones forward
            # its stamps too wait until the row is read: most plain rows never are (a plain choice
            # holds); an older row's stamps left unwritten are stale whatever they hold
            self._stamps[row] = (step, np.array(slot_ids, dtype=np.int64), np.array(generation_ids, dtype=np.int64))
            self.plain[row] = True
            self.plain_mean[row] = self.mean
            return
        self._settle_plain()                  # `last` changes below: write what plain rows carry now
        self._stamps[row] = None
        own = np.asarray(drafted, dtype=bool)
        slots, gens = _host_ints(slot_ids), _host_ints(generation_ids)
        self.stamp[row, slots] = step
        self.generation[row, slots] = gens
        if own.ndim == 0 or own.all():        # every row drafted: its own confidences, no gathers
            c = _host_floats(conf)
            self.last[slots], self.last_generation[slots] = c, gens
        else:
            c = np.empty((len(slots), self.gamma), dtype=np.float32)
            fresh = _host_floats(conf)[own]
            self.last[slots[own]], self.last_generation[slots[own]] = fresh, gens[own]
            c[own] = fresh
            s, g = slots[~own], gens[~own]
            c[~own] = np.where((self.last_generation[s] == g)[:, None], self.last[s], self.mean)
        # the mean over every row of the batch, not over those that drafted: when only the
        # confident ones draft, their mean would make every newcomer look confident too
        self.mean = 0.9 * self.mean + (0.1 / len(c)) * c.sum(0)
        self.conf[row, slots] = c

    def _settle_plain(self) -> None:
        """Write the values every lazily kept plain row carries (all slots: a few array operations,
        paid when a plain streak ends, not on each of its steps)."""
        for row in np.flatnonzero(self.plain).tolist():
            self._stamp(row)
            same = (self.last_generation == self.generation[row])[:, None]
            self.conf[row] = np.where(same, self.last, self.plain_mean[row])
            self.plain[row] = False

    def _stamp(self, row: int) -> None:
        """Write a plain row's waiting stamps."""
        if self._stamps[row] is not None:
            step, slots, gens = self._stamps[row]
            self.stamp[row, slots], self.generation[row, slots] = step, gens
            self._stamps[row] = None

    def lagged(self, slot_ids, generation_ids, step: int) -> torch.Tensor:
        """Survivals [R, gamma] (float32, host) from step - lag; 1.0 where the entry is not valid."""
        return torch.from_numpy(self.lagged_np(slot_ids, generation_ids, step))

    def lagged_np(self, slot_ids, generation_ids, step: int, prior: bool = False) -> np.ndarray:
        """`lagged` as numpy; `prior`: the running mean, not 1.0, where the entry is not valid
        (what a request nobody has drafted for yet is expected to accept, not what is safe to verify)."""
        slots = _host_ints(slot_ids)
        src = step - self.lag
        unknown = self.mean if prior else np.float32(1.0)
        if src < 0:
            return np.cumprod(np.broadcast_to(unknown, (len(slots), self.gamma)), axis=1).astype(np.float32)
        row, gens = src % (self.lag + 1), _host_ints(generation_ids)
        self._stamp(row)
        ok = (self.stamp[row, slots] == src) & (self.generation[row, slots] == gens)
        if self.plain[row]:                   # carried: the slot's last confidences, or the mean then
            kept = np.where((self.last_generation[slots] == gens)[:, None], self.last[slots], self.plain_mean[row])
        else:
            kept = self.conf[row, slots]
        return np.cumprod(np.where(ok[:, None], kept, unknown), axis=1)


def _any(drafted) -> bool:
    """Did any row draft? (a plain bool, the plain step's, is read without numpy: every step)"""
    return drafted if isinstance(drafted, bool) else bool(np.any(drafted))


def _host_ints(x) -> np.ndarray:
    return x.detach().cpu().numpy().astype(np.int64) if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.int64)


def _host_floats(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)


def can_trim(table: CostTable | None) -> bool:
    """Is there anything to trim for? Only on a profiled table whose cost grows with K somewhere."""
    return table is not None and bool(table.measurements) and not table.is_flat()


def warn_static(mode: str, stacklevel: int = 2) -> None:
    warnings.warn(f"verify_mode={mode!r} needs a profiled, non-flat cost table; verifying full blocks "
                  "(static) instead", stacklevel=stacklevel)


class CostScheduler:
    """The production scheduler: relay + lagged budget + fresh top-K allocation.

    mode "static": every request verifies gamma drafts. "compact": lagged budget, top-K windows,
    the target computes R + budget rows. "cap-accept": the same windows, but the target verifies
    full blocks (a measurement mode exposing the untrimmed ceiling). Without a cost table, or
    with a flat one, a non-static mode falls back to static and warns once per scheduler.
    """

    def __init__(self, gamma: int, max_slots: int, mode: str = "static",
                 cost_table: CostTable | None = None, lag: int = DEFAULT_LAG,
                 min_gain: float = DEFAULT_MIN_GAIN, survival_eps: float = DEFAULT_SURVIVAL_EPS,
                 plain_table: CostTable | None = None, share_tables: dict | None = None,
                 plain_hold: int = DEFAULT_PLAIN_HOLD, step_clock: bool = False, lapse_after: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.gamma, self.mode, self.cost_table = gamma, mode, cost_table
        self.plain_table = plain_table if plain_table is not None and plain_table.measurements else None
        self.min_gain, self.survival_eps = min_gain, survival_eps
        # share of the batch that drafts -> the step cost T(R, K) measured with that share drafting
        self.share_tables = {f: t for f, t in (share_tables or {}).items() if t is not None and t.measurements}
        if not all(0.0 < f < 1.0 for f in self.share_tables):
            raise ValueError(f"draft shares must lie strictly between 0 and 1, not {sorted(self.share_tables)}")
        self.relay = ConfidenceRelay(max_slots, gamma, lag)
        if plain_hold < 1:
            raise ValueError("plain_hold must be >= 1 (1: choose at every step)")
        self.plain_hold = plain_hold
        # after this many plain steps in a row, plain steps stop feeding the drafter's context
        # (0: never): a run that long says the load holds, and upkeep is what a plain step pays
        # beyond the target's own step; a request that drafts again reads the context fed since
        self.lapse_after, self._plain_run = lapse_after, 0
        self._held: int | None = None                 # the step a plain streak's hold ends
        self._all_held: tuple[int, int] | None = None # the same for a clear choice of every row drafting
        # the engine's step clock: per kind (0: plain, 1: every row drafting), decayed sums of
        # measured and predicted seconds and the steps timed (`time_step`)
        self.step_clock = step_clock
        self._clock = [(0.0, 0.0, 0), (0.0, 0.0, 0)]
        self._can_trim = can_trim(cost_table)
        self._warned = False

    def effective_mode(self) -> str:
        """The mode actually used: static when trimming has no cost table to stand on."""
        if self.mode == "static":
            return "static"
        if not self._can_trim:
            if not self._warned:
                warn_static(self.mode, stacklevel=4)
                self._warned = True
            return "static"
        return self.mode

    def _predict(self, bs: int, k: int) -> float:
        if self.cost_table is None or not self.cost_table.measurements:
            return float("nan")
        return float(self.cost_table.curve(bs, k)[k])     # the cached curve: read every step

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

    def draft_choice(self, slot_ids, generation_ids, step: int) -> DraftChoice | None:
        """Compact mode with a plain table (the target alone, `bench profile-plain`): should only
        some requests draft this step? Rows are ranked by the sum of their lagged survivals (the
        drafts they would add); for each profiled share f (`share_tables`) and for f = 0 (a plain
        step), the best budget over the top ceil(f * R) rows is priced by that share's profile.
        Returns the best such step if its expected tokens per second (`budget_from_lagged`'s
        objective) beat every step where all rows draft by more than min_gain; else None. A
        plain step, once chosen, holds for `plain_hold` steps unless drafted confidences arrive
        (`record`): the lag makes any choice lossless, and this one saves the host a choice per
        step that would read the same relay. A bigger batch does not end it: verifying drafts only
        costs more there, and its newcomers (counted at the running mean) are read when the hold
        ends. Every row drafting holds too when it beat each alternative by more than min_gain,
        unless the batch grows (and unless the step clock is on): a choice that clear does not
        turn on one step's news, and it is the host's work of every step on a pair where
        drafting always pays."""
        if self.plain_table is None or self.effective_mode() != "compact":
            return None
        R, g = len(slot_ids), self.gamma
        if self._held is not None and step < self._held:
            return self._plain(DraftChoice(0.0, None, 0, float(self.plain_table.curve(R, 0)[0])))  # still plain
        if self._all_held is not None and step < self._all_held[0] and R <= self._all_held[1]:
            self._plain_run = 0
            return None                                                                 # still every row
        # the profile's prices, corrected by the step clock where it has timed both kinds
        # (`predicted` stays the profile's own: the clock compares against it)
        fp, fd = self.correction(0), self.correction(1)
        # a request without lagged confidences (just admitted) counts as the running mean, not as
        # certain: a wave of admissions must not buy a drafter's pass on hope
        lagged = self.relay.lagged_np(_host_ints(slot_ids), _host_ints(generation_ids), step, prior=True)
        s = np.where(lagged >= self.survival_eps, lagged, 0.0)

        def best_of(cells, times):      # the best budget over cells (any order) and its tokens/s
            theta = (R + np.concatenate(([0.0], np.cumsum(np.sort(cells)[::-1])))) / times
            k = int(np.argmax(theta))
            return k, float(theta[k])
        everyone = best_of(s.reshape(-1), fd * self.cost_table.curve(R, R * g))[1]
        plain_t = float(self.plain_table.curve(R, 0)[0])
        best, choice = R / (fp * plain_t), DraftChoice(0.0, None, 0, plain_t)     # a plain step: no cells
        if self.share_tables:           # the requests of largest lagged survival draft first
            order = np.argsort(-s.sum(1), kind="stable")
            for f in sorted(self.share_tables):
                D = math.ceil(f * R)
                if D in (0, R):
                    continue
                times = self.share_tables[f].curve(R, D * g)
                k, theta = best_of(s[order[:D]].reshape(-1), fd * times)
                if theta > best:
                    best, choice = theta, DraftChoice(f, order, k, float(times[k]))
        # every row drafting, by a margin (not with the step clock: its prices move every step)
        clear = everyone > (1.0 + self.min_gain) * best and not self.step_clock
        choice = choice if best > (1.0 + self.min_gain) * everyone else None
        plain = choice is not None and choice.fraction == 0.0
        self._held = step + self.plain_hold if plain else None
        self._all_held = (step + self.plain_hold, R) if clear else None
        if plain:
            return self._plain(choice)
        self._plain_run = 0
        return choice

    def _plain(self, choice: DraftChoice) -> DraftChoice:
        """Count a plain step into the run; past `lapse_after` of them it lets the context lapse."""
        self._plain_run += 1
        if self.lapse_after and self._plain_run > self.lapse_after:
            choice.upkeep = False
        return choice

    def time_step(self, drafted, seconds: float, predicted: float) -> None:
        """The step clock (`step_clock`): a decode-only step's measured period (`CostWindows`
        times it) against the profile's price for it, kept for plain steps and for steps where
        every row drafted. A profile timed in another run, without prefills, can be off by more
        than `min_gain`, and by different amounts for the two kinds; this is what corrects it."""
        drafted = np.asarray(drafted, dtype=bool)
        kind = 0 if not drafted.any() else 1 if drafted.all() else None
        if kind is None or not predicted > 0 or not 0 < seconds < 4 * predicted:
            return                               # a partial step, an unpriced one, or an idle gap
        m, p, n = self._clock[kind]
        self._clock[kind] = (CLOCK_DECAY * m + seconds, CLOCK_DECAY * p + predicted, n + 1)

    def correction(self, kind: int) -> float:
        """Measured over predicted seconds of a kind of step (0: plain, 1: every row drafting);
        1.0 without the step clock or before `CLOCK_MIN_STEPS` of that kind were timed."""
        m, p, n = self._clock[kind]
        return m / p if self.step_clock and n >= CLOCK_MIN_STEPS else 1.0

    def drafting_pays(self, slot_ids, generation_ids, step: int) -> bool:
        """Does any request run the drafter's pass this step (`draft_choice`)?"""
        c = self.draft_choice(slot_ids, generation_ids, step)
        return c is None or c.fraction > 0

    def record(self, step: int, slot_ids, generation_ids, conf, drafted=True) -> None:
        """Push a step's confidences [R, gamma] into the relay (CostWindows.observe does, once
        the step's result is on the host); a row that did not draft carries its last ones forward.
        Fresh confidences end a plain streak's hold: the next choice reads them."""
        if _any(drafted):
            self._held = None
        self.relay.push(step, slot_ids, generation_ids, conf, drafted)
