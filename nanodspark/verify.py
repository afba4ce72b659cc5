"""Lossless verification of a draft block (paper §2.1, §6; speculative sampling).

The target scores `[anchor, d_1 .. d_w]` in one forward, giving its distributions
`P_0 .. P_w` (row j predicts the token after row j). Drafts are accepted left to right:

* greedy: accept `d_k` while it equals the target's argmax `t_{k-1}`; then commit the target's
  own token at the first mismatch (or the bonus `t_w` after the last draft);
* sampling: accept `d_k` with probability `min(1, P_{k-1}(d_k) / Q_k(d_k))`, where `Q_k` is the
  Markov-corrected draft distribution the token was actually sampled from; on the first
  rejection sample the correction from the residual `norm(max(0, P - Q))`; if every draft is
  accepted, sample the bonus from `P_w`.

Either way the committed tokens are distributed exactly as target-only decoding would produce
them, whatever the draft distribution: that is why trimming the window (the cost scheduler)
cannot change the output, as long as the window was chosen without looking at the draft token
it admits (cost_scheduler.py, Appendix A). Committed = accepted + 1.

Verify modes, given a per-request window `w <= gamma`:
`static` verifies and may commit the whole block; `compact` verifies only `w` drafts;
`cap-accept` verifies the whole block (the cost of static) but commits at most what compact
would, and reports the untrimmed acceptance as the `ceiling`.

Trimming hides how much a full-block verify would have accepted. `BlockAcceptEstimator`
estimates that ceiling from compact steps, settling each trimmed remainder later against the
tokens the target actually committed there (exact under greedy decoding), with an interval;
utilisation = delivered / ceiling (paper's production notes; SGLang's block-accept estimator).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

DEFAULT_WILSON_Z = 1.96          # z of the Wilson intervals of the ceiling estimator (~95 %)
DEFAULT_CEILING_RECORDS = 4096   # sliding window of the ceiling estimator, in records


@dataclass
class VerifyResult:
    tokens: list[int]          # committed tokens: accepted drafts, then the correction or bonus token
    accepted: int              # drafts accepted (<= the window)
    ceiling: int | None = None  # cap-accept: drafts a full-block verify accepted


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> int:
    """Length of the prefix of drafts equal to the target's argmax tokens (target_argmax[k] is
    the target's choice for the position of drafts[k])."""
    m = 0
    while m < len(drafts) and drafts[m] == target_argmax[m]:
        m += 1
    return m


def accept_sampling(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Rejection sampling over w drafts. q: [w, V] draft distributions, p: [w+1, V] target ones.

    Returns (accepted m, residual distribution to sample the correction from, or None when all
    w were accepted and the bonus comes from p[w])."""
    w = drafts.shape[0]
    if w == 0:
        return 0, None
    idx = torch.arange(w, device=drafts.device)
    pd, qd = p[idx, drafts], q[idx, drafts]
    u = torch.rand(w, generator=generator, device=drafts.device)
    # accept iff u < p/q, i.e. u * q < p (no division, q > 0 for a sampled token)
    ok = (u * qd < pd).tolist()
    m = 0
    while m < w and ok[m]:
        m += 1
    if m == w:
        return m, None
    residual = (p[m] - q[m]).clamp_min(0)
    mass = residual.sum()
    return m, (residual / mass if mass > 0 else p[m])


def verify_greedy(drafts: list[int], target_argmax: list[int], window: int, mode: str) -> VerifyResult:
    """Greedy verification on host lists: drafts [n_ver], target_argmax [rows] (the target's
    choice after each verified row)."""
    cap = len(drafts) if mode == "static" else window
    m_full = accept_greedy(drafts, target_argmax)
    m = min(m_full, cap)
    return VerifyResult(drafts[:m] + [target_argmax[m]], m, m_full if mode == "cap-accept" else None)


def verify_block(drafts: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                 window: int, mode: str, greedy: bool, generator: torch.Generator | None) -> VerifyResult:
    """One request. drafts: [gamma]; target_probs: [rows, V] for the verified rows (rows = window+1
    in compact mode, gamma+1 otherwise); draft_probs: [gamma, V] (sampling only)."""
    gamma = drafts.shape[0]
    n_ver = window if mode == "compact" else gamma
    cap = window if mode != "static" else gamma
    d = drafts[:n_ver]
    if greedy:
        return verify_greedy(d.tolist(), target_probs.argmax(-1).tolist(), window if mode != "static" else gamma,
                             mode)
    m_full, residual = accept_sampling(d, draft_probs[:n_ver], target_probs, generator)
    m = min(m_full, cap)
    # A rejection inside the cap resamples from the residual; otherwise the next token comes from
    # the target distribution at the cap (exactly what a verify of `cap` drafts would sample).
    dist = residual if m_full < cap else target_probs[m]
    nxt = int(torch.multinomial(dist, 1, generator=generator))
    return VerifyResult(d[:m].tolist() + [nxt], m, m_full if mode == "cap-accept" else None)


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
        self._records: deque = deque()
        self.max_records = max_records
        self.at_risk = [0] * gamma
        self.accepted = [0] * gamma
        self._sum_delivered = 0
        self._sum_window = 0

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

    def _apply(self, chain: list[bool], window: int, accepted: int, sign: int) -> None:
        for k, ok in enumerate(chain):
            self.at_risk[k] += sign
            self.accepted[k] += sign * int(ok)
        self._sum_delivered += sign * (accepted + 1)
        self._sum_window += sign * window

    def record(self, window: int, accepted: int, remainder: Sequence[bool] | None = None) -> None:
        """Add one request-step; the oldest record is dropped beyond `max_records`."""
        chain = self._chain(window, accepted, remainder)
        self._records.append((chain, window, accepted))
        self._apply(chain, window, accepted, +1)
        if len(self._records) > self.max_records:
            self._apply(*self._records.popleft(), sign=-1)

    def estimate(self) -> CeilingEstimate:
        n = len(self._records)
        # A position nobody reached because the survival before it is already 0 contributes 0;
        # one that is unknown for lack of data (censored) stays nan.
        p, surv = [], 1.0
        for a, r in zip(self.accepted, self.at_risk):
            p.append(a / r if r else (0.0 if surv == 0 else float("nan")))
            surv *= p[-1]
        bounds = [wilson_interval(a, r, self.z) for a, r in zip(self.accepted, self.at_risk)]

        def expected_length(probs) -> float:
            return 1.0 + float(np.sum(np.cumprod(probs))) if len(probs) else 1.0

        ceiling = expected_length(p)
        delivered = self._sum_delivered / n if n else float("nan")
        mean_window = self._sum_window / n if n else float("nan")
        return CeilingEstimate(
            ceiling=ceiling,
            lo=expected_length([b[0] for b in bounds]),
            hi=expected_length([b[1] for b in bounds]),
            conditional=p, at_risk=list(self.at_risk), records=n,
            delivered=delivered, mean_window=mean_window,
            utilisation=delivered / ceiling if n else float("nan"),
            window_ratio=(mean_window + 1.0) / ceiling if n else float("nan"),
        )
