"""Measurement of speculative decoding, as observers of step results (walkthrough chapter 07).

The step (step.py, speculative.py) only decides; what it did is a `StepResult`, and everything
that *measures* reads those results after the engine has applied them:

* `SpecMetrics`: per-position acceptance, the online ECE of the calibrated survivals against
  the prefix-acceptance labels the verifier produced, the block-accept ceiling (what a
  full-block verify would have accepted, estimated through trimming) and predicted vs measured
  step times — the DSpark numbers the server exports on /metrics;
* `CalibrationRecorder`: the raw confidence logits with their labels, which `train_heads.py`
  fits Sequential Temperature Scaling on.

`BlockAcceptEstimator` (the ceiling) settles a trimmed compact step later: when a window was
fully accepted, its remaining drafts are compared with the tokens the target actually committed
at their positions (exact under greedy decoding), as SGLang's estimator does.

Observers read a step's rows as arrays (step.py `DecodeRows`): no Python per request. At batch 1
a step's arithmetic is a few dozen numpy calls on one row, each costing more than its work, so
both keep the step's arrays and take them in every `FLUSH_EVERY` steps in one go; everything
that reads them (`summary`, the properties, `estimate`) flushes first. The statistics are sums
(and the ECE's `index_add_` adds in row order), so the numbers are those of a step-by-step update.

Invariants: observers never change a request or the engine; a request's pending remainder is
settled at the latest when it finishes (`release`).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .calibration import OnlineCalibrationMetrics
from .verify import VerifyMode

DEFAULT_WILSON_Z = 1.96          # z of the Wilson intervals of the ceiling estimator (~95 %)
DEFAULT_CEILING_RECORDS = 4096   # sliding window of the ceiling estimator, in records
STEP_TIMES_KEPT = 256            # (predicted, measured) pairs kept for /metrics


FLUSH_EVERY = 64                 # steps (or record batches) an observer keeps before taking them in


class SpecMetrics:
    """DSpark's numbers over the engine's life, from each step's decode rows (arrays, no Python
    per request). `batch` (the running batch, batch.py) is read to settle trimmed compact steps."""

    def __init__(self, gamma: int, mode: VerifyMode, batch=None):
        self.gamma, self.mode, self.batch = gamma, mode, batch
        self._trials = np.zeros(gamma, dtype=np.int64)             # verified drafts at position k
        self._accepts = np.zeros(gamma, dtype=np.int64)            # ... of which accepted
        self._online = OnlineCalibrationMetrics(gamma)
        self._queued: list[tuple] = []                             # (accepted, window, conf) of the steps kept
        self._ceiling = BlockAcceptEstimator(gamma)
        self._plain: list[tuple] = []                              # (windows, accepted): plain ceiling records kept
        S = batch.num_slots + 1 if batch is not None else 0
        # a trimmed compact step whose window was fully accepted, by slot: its remaining drafts wait
        # for the tokens the target commits at their positions (then the record goes in)
        self.pending = np.zeros(S, dtype=bool)
        self.p_gen, self.p_pos, self.p_window, self.p_acc = (np.zeros(S, dtype=np.int64) for _ in range(4))
        self.p_drafts = np.zeros((S, gamma), dtype=np.int64)
        self.step_times: deque[tuple[float, float]] = deque(maxlen=STEP_TIMES_KEPT)

    # what is read flushes the steps kept so far first
    @property
    def position_trials(self) -> np.ndarray:
        self.flush()
        return self._trials

    @property
    def position_accepts(self) -> np.ndarray:
        self.flush()
        return self._accepts

    @property
    def online(self) -> OnlineCalibrationMetrics:
        self.flush()
        return self._online

    @property
    def ceiling(self) -> "BlockAcceptEstimator":
        """The estimator, the plain records kept so far taken in first: a chain recorded through
        here (a trimmed step's) then goes in after them, in step order, as the ring's window needs."""
        self._take_plain()
        return self._ceiling

    def _take_plain(self) -> None:
        if self._plain:
            w, a = (np.concatenate(x) for x in zip(*self._plain))
            self._plain = []
            self._ceiling.record_many(w, a)

    def _labels(self, o) -> tuple[np.ndarray, np.ndarray]:
        """Per row: the drafts accepted, and the window verified (the prefix labels' length)."""
        return np.maximum(o.count - 1, 0), (np.minimum(o.windows, o.verified) if self.mode.trims else o.verified)

    def observe(self, result) -> None:
        """After the engine applied `result`: settle now what needs the batch as it is now (a
        trimmed step's pending drafts and chains) and keep the rest, plain records too, for `flush`."""
        d = result.decode
        if d is None or not len(d.slots) or not self.gamma or d.plain or not d.out.drafted.any():   # a plain step: nothing
            return
        if not d.out.drafted.all():          # rows that did not draft have nothing to label
            d = d.select(d.out.drafted != 0)
            if not len(d.slots):
                return
        acc, win = self._labels(d.out)
        if self.mode.trims:
            if self.pending.any():
                self._settle(self.pending.copy())
            plain = self._track_ceiling(d, win, acc)
            self._plain.append((win[plain], acc[plain]))
        else:                                                # every row is a plain record
            self._plain.append((win, acc))
        self._queued.append((acc, win, d.out.conf))
        if len(self._queued) >= FLUSH_EVERY:
            self.flush()
        self.step_times.append((result.predicted_step_time, result.seconds))

    def flush(self) -> None:
        """Count, then calibrate, the kept steps' rows: one array operation per statistic."""
        self._take_plain()
        if not self._queued:
            return
        acc, win, conf = (np.concatenate(x) for x in zip(*self._queued))
        self._queued = []
        k = np.arange(self.gamma)
        accepted = k < acc[:, None]                          # [n, gamma]: the prefix labels
        tried = k < np.minimum(acc + 1, win)[:, None]        # scored, up to the first rejection
        self._trials += tried.sum(0)
        self._accepts += (tried & accepted).sum(0)
        conf = conf.astype(np.float64)
        surv = np.cumprod(np.clip(np.where(np.isnan(conf), 0.0, conf), 0.0, 1.0), axis=1)   # NaN counts as 0
        self._online.update(torch.from_numpy(surv), torch.from_numpy(accepted), torch.from_numpy(k < win[:, None]))

    def _track_ceiling(self, d, win: np.ndarray, acc: np.ndarray) -> np.ndarray:
        """A trimming mode's step: cap-accept observes the ceiling directly; a trimmed compact step
        whose window was fully accepted leaves its remaining drafts pending. Returns the mask of
        the rows left: plain records."""
        o, g = d.out, self.gamma
        full = acc == win
        if self.mode.reports_ceiling:
            over = o.ceiling - acc                      # accepted past the window (a full verify)
            known = full & (over >= 0)
            n_rem = np.minimum(over, g - win)           # verdicts past the window, up to gamma
            run = np.where(known, acc + n_rem, acc)
            rejected = np.where(known, (o.ceiling < o.verified) & (over < g - win), acc < win)
            self.ceiling.record_chains(run, rejected, win, acc)
            return np.zeros(len(win), dtype=bool)
        plain = np.ones(len(win), dtype=bool)
        if self.batch is not None:
            rows = np.flatnonzero(full & (win < g))
            s = d.slots[rows]
            live = self.batch.live[s] & (self.batch.generation[s] == d.generations[rows])
            rows, s = rows[live], s[live]
            self.pending[s] = True
            self.p_gen[s], self.p_window[s], self.p_acc[s] = d.generations[rows], win[rows], acc[rows]
            self.p_pos[s] = self.batch.num_computed[s]   # the bonus token's position: the first trimmed draft's
            self.p_drafts[s] = o.drafts[rows]
            plain[rows] = False
        return plain

    def _settle(self, mask: np.ndarray, final: bool = False) -> None:
        """Judge pending drafts against the tokens committed since, for the slots in `mask`."""
        b, g = self.batch, self.gamma
        s = np.flatnonzero(mask)
        gone = ~b.live[s] | (b.generation[s] != self.p_gen[s])
        w = self.p_window[s]
        out_at = self.p_pos[s] - b.prompt_len[s]                    # output index of the first trimmed draft
        avail = np.where(gone, 0, np.clip(b.out_len[s] - out_at, 0, g))
        j = np.arange(g)
        cols = np.clip(out_at[:, None] + j[None, :], 0, b.out.shape[1] - 1)
        later = b.out[s[:, None], cols]
        drafts = np.take_along_axis(self.p_drafts[s], np.minimum(w[:, None] + j[None, :], g - 1), axis=1)
        valid = j[None, :] < np.minimum(avail, g - w)[:, None]
        match = (later == drafts) & valid
        run = np.cumprod(match, axis=1).sum(1)
        rejected = run < np.minimum(avail, g - w)                   # a mismatch was seen
        done = final | gone | rejected | (avail >= g - w)
        if done.any():
            self.ceiling.record_chains(w[done] + run[done], rejected[done], w[done], self.p_acc[s][done])
            self.pending[s[done]] = False

    def release(self, r) -> None:
        """`r` finishes: settle its pending drafts with what it committed."""
        if self.batch is not None and 0 <= r.slot < len(self.pending) and self.pending[r.slot]:
            mask = np.zeros(len(self.pending), dtype=bool)
            mask[r.slot] = True
            self._settle(mask, final=True)

    def summary(self) -> dict:
        """Engine-level DSpark metrics (the server exports these on /metrics)."""
        pred = [p for p, _ in self.step_times if p == p]
        meas = [m for p, m in self.step_times if p == p]
        est = self.ceiling.estimate()
        return {
            "ceiling": None if est.records == 0 or est.ceiling != est.ceiling else {
                "tau": est.ceiling, "lo": est.lo, "hi": est.hi, "delivered": est.delivered,
                "utilisation": est.utilisation},
            "position_acceptance": [a / t if t else None for a, t in zip(self.position_accepts.tolist(),
                                                                          self.position_trials.tolist())],
            "online_ece": [None if e != e else float(e) for e in self.online.ece().tolist()],
            "step_time_predicted_s": sum(pred) / len(pred) if pred else None,
            "step_time_measured_s": (sum(meas) / len(meas) if meas else
                                     (sum(m for _, m in self.step_times) / len(self.step_times) if self.step_times else None)),
        }


class CalibrationRecorder:
    """(raw confidence logits [gamma], accepted, verified, request id) per verify step."""

    def __init__(self):
        self.records: list[tuple[torch.Tensor, int, int, str]] = []

    def observe(self, result) -> None:
        d = result.decode
        if d is None:
            return
        o = d.out
        for i, req in enumerate(d.requests.tolist()):
            if not o.drafted[i]:              # the drafter did not run for it: nothing to record
                continue
            self.records.append((torch.from_numpy(o.conf_logits[i].copy()), int(max(o.count[i] - 1, 0)),
                                 int(o.verified[i]), req.request_id))


# ----------------------------------------------------------------------------- the ceiling
def wilson_interval(successes: int, n: int, z: float = DEFAULT_WILSON_Z) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) when n == 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class CeilingEstimate:
    """Full-block acceptance ceiling and how much of it trimming delivered.

    Units are committed tokens per step (accepted drafts + 1 bonus).
    ceiling: 1 + sum_k S_k, S_k = prod_{i<=k} p_i (Kaplan-Meier style); nan if some position
        has never been observed. [lo, hi]: the same sum with each p_i at its Wilson bound.
    delivered: mean committed tokens per step actually obtained.
    utilisation: delivered / ceiling (share of the full-block acceptance kept by trimming).
    window_ratio: (mean window + 1) / ceiling (verify rows spent per token the ceiling offers).
    """
    ceiling: float
    lo: float
    hi: float
    conditional: list[float]
    at_risk: list[int]
    records: int
    delivered: float
    mean_window: float
    utilisation: float
    window_ratio: float


class BlockAcceptEstimator:
    """Estimates the acceptance a full-block verify would have had, from trimmed steps.

    Each record is one request-step: the window verified, the drafts accepted, and optionally
    `remainder`, the counterfactual verdicts for the trimmed positions window+1.. (obtained later
    by comparing those drafts with what the target produced there, e.g. argmax agreement or a
    rejection test on the target's logprobs). A position is *observed* when every earlier draft
    was accepted and its own verdict is known; positions after a rejection are not at risk, and
    positions after the last known verdict of a fully accepted window are censored.
    Per position k: p_k = accepted_k / at_risk_k; the ceiling is the expected committed length
    1 + sum_k prod_{i<=k} p_i. Honest caveats: censoring by the scheduler is informative (it
    trims where confidence is low), so without remainders p_k at deep positions is biased up;
    the [lo, hi] band multiplies per-position Wilson bounds, which is a plug-in band, not a joint
    confidence interval. Memory: a sliding window of `max_records` records.
    """

    def __init__(self, gamma: int, max_records: int = DEFAULT_CEILING_RECORDS,
                 z: float = DEFAULT_WILSON_Z):
        self.gamma, self.z = gamma, z
        self.max_records = max_records
        # A chain is always some accepted verdicts then at most one rejection, so a record is
        # four numbers: (accepted verdicts, rejection 0/1, window, accepted drafts), kept in a
        # ring of max_records rows; n of them are live, the oldest at (head - n) % max_records.
        self._ring = np.zeros((max_records, 4), dtype=np.int64)
        self._head = self._n = 0
        self._queued: list[tuple] = []      # records' four columns, in order, not in the ring yet
        self._at_risk = np.zeros(gamma, dtype=np.int64)
        self._accepted = np.zeros(gamma, dtype=np.int64)
        self._sum_delivered = 0
        self._sum_window = 0

    @property
    def at_risk(self) -> np.ndarray:
        """Records that reached position k (read: the queue is taken in first)."""
        self._flush()
        return self._at_risk

    @property
    def accepted(self) -> np.ndarray:
        """... of which accepted there."""
        self._flush()
        return self._accepted

    def _chain(self, window: int, accepted: int, remainder) -> list[bool]:
        """Observed verdicts for positions 1.. (stops after the first rejection or unknown)."""
        if not 0 <= accepted <= window <= self.gamma:
            raise ValueError(f"need 0 <= accepted <= window <= gamma, got {accepted}, {window}, {self.gamma}")
        chain = [True] * accepted
        if accepted < window:
            return chain + [False]
        for verdict in list(remainder or [])[: self.gamma - window]:
            chain.append(bool(verdict))
            if not verdict:
                break
        return chain

    def _apply(self, rows: np.ndarray, sign: int) -> None:
        """Add (sign +1) or remove (-1) records [m, 4] from the per-position counts."""
        k = np.arange(self.gamma)
        runs, rejected = rows[:, 0:1], rows[:, 1:2]
        self._at_risk += sign * (k < runs + rejected).sum(0)
        self._accepted += sign * (k < runs).sum(0)
        self._sum_delivered += sign * int((rows[:, 3] + 1).sum())
        self._sum_window += sign * int(rows[:, 2].sum())

    def _push(self, *columns) -> None:
        """Queue records given as their four columns; `_flush` takes them in."""
        self._queued.append(columns)
        if len(self._queued) >= FLUSH_EVERY:
            self._flush()

    def _flush(self) -> None:
        """Append the queued records in order, dropping the oldest beyond max_records (one ring
        write and one count update for all of them: the counts are sums, so this is exact)."""
        if not self._queued:
            return
        rows = np.stack([np.concatenate(c) for c in zip(*self._queued)], axis=1)
        self._queued = []
        rows = rows[-self.max_records:]
        m, cap = len(rows), self.max_records
        at = (self._head + np.arange(m)) % cap
        overwritten = max(0, self._n + m - cap)                 # the oldest live records go
        if overwritten:
            self._apply(self._ring[(self._head - self._n + np.arange(overwritten)) % cap], -1)
        self._ring[at] = rows
        self._apply(rows, +1)
        self._head, self._n = (self._head + m) % cap, min(cap, self._n + m)

    def record(self, window: int, accepted: int, remainder: Sequence[bool] | None = None) -> None:
        """Add one request-step; the oldest record is dropped beyond `max_records`."""
        chain = self._chain(window, accepted, remainder)
        run = chain.index(False) if False in chain else len(chain)
        self._push(*(np.array([x], dtype=np.int64) for x in (run, len(chain) - run, window, accepted)))

    def record_chains(self, runs, rejected, windows, accepted) -> None:
        """Records given as their chains: `runs` accepted verdicts then, where `rejected`, one
        rejection (the array form of `record` with a remainder)."""
        r = np.array(runs, dtype=np.int64)              # copies: the queue must not see later changes
        if len(r):
            self._push(r, np.array(rejected, dtype=np.int64), np.array(windows, dtype=np.int64),
                       np.array(accepted, dtype=np.int64))

    def record_many(self, windows, accepted) -> None:
        """`record(w, a)` for each pair, without remainders, in one array operation."""
        w, a = np.array(windows, dtype=np.int64), np.array(accepted, dtype=np.int64)   # copies, as above
        if not len(w):
            return
        if ((a < 0) | (a > w) | (w > self.gamma)).any():
            raise ValueError(f"need 0 <= accepted <= window <= gamma={self.gamma}")
        self._push(a, a < w, w, a)

    def estimate(self) -> CeilingEstimate:
        self._flush()
        n = self._n
        # A position nobody reached because the survival before it is already 0 contributes 0;
        # one that is unknown for lack of data (censored) stays nan.
        p, surv = [], 1.0
        for a, r in zip(self.accepted.tolist(), self.at_risk.tolist()):
            p.append(a / r if r else (0.0 if surv == 0 else float("nan")))
            surv *= p[-1]
        bounds = [wilson_interval(a, r, self.z) for a, r in zip(self.accepted.tolist(), self.at_risk.tolist())]

        def expected_length(probs) -> float:
            return 1.0 + float(np.sum(np.cumprod(probs))) if len(probs) else 1.0

        ceiling = expected_length(p)
        delivered = self._sum_delivered / n if n else float("nan")
        mean_window = self._sum_window / n if n else float("nan")
        return CeilingEstimate(
            ceiling=ceiling,
            lo=expected_length([b[0] for b in bounds]),
            hi=expected_length([b[1] for b in bounds]),
            conditional=p, at_risk=self.at_risk.tolist(), records=n,
            delivered=delivered, mean_window=mean_window,
            utilisation=delivered / ceiling if n else float("nan"),
            window_ratio=(mean_window + 1.0) / ceiling if n else float("nan"),
        )
