"""Window policies: the host's half of choosing a verify step's windows.

Before a decode step is launched, a policy decides its `WindowPlan` (step.py): the budget of
draft tokens the target verifies and whether to trim, or windows forced per request. The device
then chooses each request's window from its fresh confidences (speculative.py). A policy that
learns from results is also an observer: `observe` sees each step's applied rows, as arrays.

* `StaticWindows`: full blocks for everyone (verify_mode static, or compact with nothing to
  trim: no cost table, or a flat one).
* `CostWindows`: the cost scheduler (cost_scheduler.py): a budget from confidences `lag` steps
  old, pushed into its relay here as each step is committed; with a plain step-cost table, a
  step where only the most confident requests run the drafter's pass, or none (a plain step);
  with the scheduler's step clock, each decode-only step's period is timed here too.
* `ForcedWindows`: windows chosen by a function of the requests (tests and the step-cost
  profile; never built by the engine itself).

Invariant: no policy reads the drafts of the step it plans (the budget's lag, paper section 5.2).
"""
from __future__ import annotations

import time

import numpy as np

from .cost_scheduler import CostScheduler
from .step import DecodeRows, WindowPlan


class WindowPolicy:
    def plan(self, rows: DecodeRows, step: int) -> WindowPlan:
        raise NotImplementedError

    def observe(self, result) -> None:
        pass


class StaticWindows(WindowPolicy):
    def __init__(self, gamma: int):
        self.gamma = gamma

    def plan(self, rows: DecodeRows, step: int) -> WindowPlan:
        return WindowPlan(len(rows.slots) * self.gamma, False)


class CostWindows(WindowPolicy):
    def __init__(self, scheduler: CostScheduler):
        self.scheduler, self.gamma = scheduler, scheduler.gamma
        self._seen: tuple[float, bool] | None = None    # the step clock: (when the last step was seen, had it a prefill)

    def plan(self, rows: DecodeRows, step: int) -> WindowPlan:
        c = self.scheduler.draft_choice(rows.slots, rows.generations, step)
        if c is not None:                       # some rows (none: a plain step) skip the drafter's pass
            return WindowPlan(c.budget, True, None, c.predicted, draft=c.fraction,
                              order=c.order if c.fraction > 0 else None, upkeep=c.upkeep)
        budget, trim, predicted = self.scheduler.budget(rows.slots, rows.generations, step)
        return WindowPlan(budget, trim, None, predicted)

    def observe(self, result) -> None:
        d = result.decode
        if d is not None and len(d.slots):
            self.scheduler.record(result.step, d.slots, d.generations, d.out.conf, not d.plain and d.out.drafted != 0)
        if self.scheduler.step_clock:           # a step's period: from the step seen before to this one
            now, seen = time.perf_counter(), self._seen
            if d is not None and len(d.slots) and not result.prefill and seen is not None and not seen[1]:
                self.scheduler.time_step(d.out.drafted, now - seen[0], result.predicted_step_time)
            self._seen = (now, bool(result.prefill))    # a prefill's device time spills into the next step


class ForcedWindows(WindowPolicy):
    """`fn(requests) -> windows` (one int per request, clamped to 0..gamma)."""

    def __init__(self, gamma: int, fn):
        self.gamma, self.fn = gamma, fn

    def plan(self, rows: DecodeRows, step: int) -> WindowPlan:
        caps = np.clip(np.asarray([int(w) for w in self.fn(list(rows.requests))], dtype=np.int64), 0, self.gamma)
        return WindowPlan(len(rows.slots) * self.gamma, False, caps)
