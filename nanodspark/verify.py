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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


def verify_block(drafts: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                 window: int, mode: str, greedy: bool, generator: torch.Generator | None) -> VerifyResult:
    """One request. drafts: [gamma]; target_probs: [rows, V] for the verified rows (rows = window+1
    in compact mode, gamma+1 otherwise); draft_probs: [gamma, V] (sampling only)."""
    gamma = drafts.shape[0]
    n_ver = window if mode == "compact" else gamma
    cap = window if mode != "static" else gamma
    d = drafts[:n_ver]
    if greedy:
        t = target_probs.argmax(-1).tolist()
        m_full = accept_greedy(d.tolist(), t)
        m = min(m_full, cap)
        return VerifyResult(d[:m].tolist() + [t[m]], m, m_full if mode == "cap-accept" else None)
    m_full, residual = accept_sampling(d, draft_probs[:n_ver], target_probs, generator)
    m = min(m_full, cap)
    # A rejection inside the cap resamples from the residual; otherwise the next token comes from
    # the target distribution at the cap (exactly what a verify of `cap` drafts would sample).
    dist = residual if m_full < cap else target_probs[m]
    nxt = int(torch.multinomial(dist, 1, generator=generator))
    return VerifyResult(d[:m].tolist() + [nxt], m, m_full if mode == "cap-accept" else None)
