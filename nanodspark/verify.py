"""Lossless verification of a draft block (paper sections 2.1 and 6; speculative sampling).

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

Fresh noise for every attempt. A budget is sized from confidences `lag` steps old
(cost_scheduler.py), which came from drafts of positions this step may propose again. Keyed by
position alone, an old draft and the new one at the same position would share their noise, so
the budget -- and with it the window that admits the new draft -- would depend on that draft,
which losslessness forbids. The speculative streams (draft, accept, residual) are therefore keyed
by the position *and* the step's anchor; only the target's own stream is keyed by position alone.

The engine verifies a whole batch at once on the device (`verify_batch`, with keyed noise,
sampling.py); `verify_greedy` / `verify_block` / `accept_sampling` are the same rules for one
request on host values, the textbook form the tests check against. What a full-block verify
would have accepted under trimming is estimated by observers.py (`BlockAcceptEstimator`).

`SyntheticAcceptance` is not verification: for benchmarks on random weights, whose drafts are
never accepted, it stands in for a trained drafter with a known acceptance law, so that a step
costs what it would at paper scale while the engine's scheduling, windows and verify rows are the
real ones. The engine refuses it with real weights (config.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from .sampling import (GREEDY_BELOW, STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SYNTHETIC, STREAM_TARGET,
                       SamplingTensors, _M32, _mix32, _to_uniform, gumbel_argmax, probs_from_logits, uniforms)


class VerifyMode(Enum):
    """How a window `w` (0..gamma, from the cost scheduler) turns into verify rows and commits.

    STATIC verifies and may commit the whole block; COMPACT verifies `w` drafts; CAP_ACCEPT
    verifies the whole block (the cost of static) but commits at most `w` drafts and reports
    the untrimmed acceptance as the ceiling. The one place these rules are written."""
    STATIC = "static"
    COMPACT = "compact"
    CAP_ACCEPT = "cap-accept"

    @classmethod
    def parse(cls, name: "str | VerifyMode") -> "VerifyMode":
        if isinstance(name, VerifyMode):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"verify_mode must be one of {[m.value for m in cls]}, not {name!r}") from None

    def verified(self, window, gamma):
        """Drafts the target verifies (works on ints and tensors)."""
        return window if self is VerifyMode.COMPACT else gamma

    def cap(self, window, gamma):
        """Most drafts that may be committed."""
        return gamma if self is VerifyMode.STATIC else window

    def reported_window(self, window, verified):
        """The window a step counts as verified: the chosen one when trimming, else what was scored."""
        return min(window, verified) if self.trims else verified

    @property
    def trims(self) -> bool:
        return self is not VerifyMode.STATIC

    @property
    def verifies_window(self) -> bool:
        """Does the target score only the window (so a trimmed step has fewer verify rows)?"""
        return self is VerifyMode.COMPACT

    @property
    def reports_ceiling(self) -> bool:
        return self is VerifyMode.CAP_ACCEPT


@dataclass
class VerifyResult:
    tokens: list[int]          # committed tokens: accepted drafts, then the correction or bonus token
    accepted: int              # drafts accepted (<= the window)
    ceiling: int | None = None  # cap-accept: drafts a full-block verify accepted


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> int:
    """Length of the prefix of drafts equal to the target's argmax tokens (target_argmax[k] is
    the target's choice for the position of drafts[k])."""
    # BEGIN STUDENT verify accept-greedy
    m = 0
    while m < len(drafts) and drafts[m] == target_argmax[m]:
        m += 1
    return m
    # END STUDENT verify


def accept_sampling(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Rejection sampling over w drafts. q: [w, V] draft distributions, p: [w+1, V] target ones.

    Returns (accepted m, residual distribution to sample the correction from, or None when all
    w were accepted and the bonus comes from p[w])."""
    # BEGIN STUDENT verify accept-sampling
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
    # END STUDENT verify


def verify_greedy(drafts: list[int], target_argmax: list[int], window: int, mode: str) -> VerifyResult:
    """Greedy verification on host lists: drafts [n_ver], target_argmax [rows] (the target's
    choice after each verified row)."""
    # BEGIN STUDENT verify verify-greedy
    cap = len(drafts) if mode == "static" else window
    m_full = accept_greedy(drafts, target_argmax)
    m = min(m_full, cap)
    return VerifyResult(drafts[:m] + [target_argmax[m]], m, m_full if mode == "cap-accept" else None)
    # END STUDENT verify


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
    # BEGIN STUDENT verify verify-block
    m_full, residual = accept_sampling(d, draft_probs[:n_ver], target_probs, generator)
    m = min(m_full, cap)
    # A rejection inside the cap resamples from the residual; otherwise the next token comes from
    # the target distribution at the cap (exactly what a verify of `cap` drafts would sample).
    dist = residual if m_full < cap else target_probs[m]
    nxt = int(torch.multinomial(dist, 1, generator=generator))
    return VerifyResult(d[:m].tolist() + [nxt], m, m_full if mode == "cap-accept" else None)
    # END STUDENT verify


# ----------------------------------------------------------------------------- a batch, on the device
@dataclass
class BatchVerdict:
    """What verification decided for R requests (device tensors, no host sync to make them)."""
    tokens: torch.Tensor       # int64 [R, gamma + 1]: accepted drafts, then the correction / bonus
    accepted: torch.Tensor     # int64 [R]: drafts accepted (tokens[r, :accepted[r] + 1] are committed)
    ceiling: torch.Tensor      # int64 [R]: drafts a full-block verify accepted (the leading run)


def verify_batch(drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                 row_index: torch.Tensor, st: SamplingTensors | None, anchor_pos: torch.Tensor,
                 verified: torch.Tensor, cap: torch.Tensor, greedy_only: bool,
                 coupled: bool = False) -> BatchVerdict:
    """Accept a prefix of each request's drafts, all requests at once.

    drafts [R, g]; draft_probs [R, g, V] (the Markov-corrected draft distributions; None when
    every request is greedy); logits [T, V] of the packed verify rows and row_index [R, g + 1]:
    logits[row_index[r, k]] is the target after request r's anchor and drafts 1..k (entries
    past `verified` are ignored); anchor_pos [R]; verified [R] drafts the target scored; cap [R]
    most drafts that may be committed (<= verified); st the requests' sampling (None if greedy_only).

    Greedy rows accept draft k while it equals the target's argmax. Sampled rows accept draft k
    with probability min(1, P/Q), testing u < P(d)/Q(d) with a keyed uniform (stream ACCEPT at
    the draft's position and the anchor's); the first rejection inside the cap resamples from
    norm(max(0, P - Q)) (stream RESIDUAL, keyed the same way), and otherwise the next token is the target's own sample at the cap
    (stream TARGET, exactly what target-only decoding would draw from P there).

    Coupled (`coupled=True`, the drafts drawn with the TARGET stream's noise): the target's own
    sample at every verified position is the Gumbel-max of P there with the TARGET noise — the
    token target-only decoding would draw — and a draft is accepted iff it equals it; the next
    token is the target's own sample. Every committed token is then *the* target-only token, so
    output is the same with speculation on or off, for any drafter and window."""
    R, g = drafts.shape
    dev = drafts.device
    k = torch.arange(g, device=dev)
    pos = anchor_pos[:, None] + 1 + torch.arange(g + 1, device=dev)       # position of each committed slot
    in_window = k[None, :] < verified[:, None]
    # BEGIN STUDENT verify verify-batch
    target_argmax = logits.argmax(-1)[row_index]                           # [R, g + 1]
    ok = (drafts == target_argmax[:, :g]) & in_window
    probs = None
    if not greedy_only:
        rows = st.rows(torch.arange(R, device=dev).repeat_interleave(g + 1))
        probs = probs_from_logits(logits[row_index.reshape(-1)], rows).view(R, g + 1, -1)
    if probs is not None and coupled:
        seeds = st.seed[:, None].expand(R, g + 1).reshape(-1)
        own = gumbel_argmax(torch.log(probs.reshape(R * (g + 1), -1)), seeds, pos.reshape(-1),
                            STREAM_TARGET).view(R, g + 1)
        sampled_ok = (drafts == own[:, :g]) & in_window
        greedy_rows = (st.temperature < GREEDY_BELOW)
        ok = torch.where(greedy_rows[:, None], ok, sampled_ok)
        m_full = ok.long().cumprod(1).sum(1)
        m = torch.minimum(m_full, cap)
        nxt = torch.where(greedy_rows, target_argmax.gather(1, m[:, None])[:, 0], own.gather(1, m[:, None])[:, 0])
        return _verdict(drafts, m, m_full, nxt)
    if probs is not None and g > 0:
        pd = probs[:, :g].gather(2, drafts[:, :, None])[..., 0]
        qd = draft_probs.gather(2, drafts[:, :, None])[..., 0]
        u = uniforms(st.seed[:, None].expand(R, g).reshape(-1), pos[:, :g].reshape(-1), STREAM_ACCEPT,
                     anchor_pos[:, None].expand(R, g).reshape(-1)).view(R, g)
        sampled_ok = (u * qd < pd) & in_window                             # u < p/q without dividing
        ok = torch.where((st.temperature < GREEDY_BELOW)[:, None], ok, sampled_ok)
    m_full = ok.long().cumprod(1).sum(1)                                   # leading run of acceptances
    m = torch.minimum(m_full, cap)
    at_m = m[:, None]
    nxt = target_argmax.gather(1, at_m)[:, 0]
    if probs is not None:
        p_m = probs.gather(1, at_m[:, :, None].expand(R, 1, probs.shape[-1]))[:, 0]
        p_next = pos.gather(1, at_m)[:, 0]
        drawn = gumbel_argmax(torch.log(p_m), st.seed, p_next, STREAM_TARGET)
        if g > 0:
            q_m = draft_probs.gather(1, at_m.clamp(max=g - 1)[:, :, None].expand(R, 1, probs.shape[-1]))[:, 0]
            residual = (p_m - q_m).clamp_min(0)
            rejected = m_full < cap                                       # rejection inside the cap
            dist = torch.where((rejected & (residual.sum(-1) > 0))[:, None], residual, p_m)
            res_tok = gumbel_argmax(torch.log(dist), st.seed, p_next, STREAM_RESIDUAL, anchor_pos)
            drawn = torch.where(rejected, res_tok, drawn)
        nxt = torch.where(st.temperature < GREEDY_BELOW, nxt, drawn)
    # END STUDENT verify
    return _verdict(drafts, m, m_full, nxt)


def _verdict(drafts, m, m_full, nxt) -> BatchVerdict:
    """tokens [R, g + 1]: the m accepted drafts, then `nxt`, then zeros."""
    R, g = drafts.shape
    k = torch.arange(g + 1, device=drafts.device)[None, :]
    tokens = torch.zeros(R, g + 1, dtype=torch.long, device=drafts.device)
    tokens[:, :g] = drafts
    tokens.scatter_(1, m[:, None], nxt[:, None])
    return BatchVerdict(torch.where(k <= m[:, None], tokens, 0), m, m_full)


def _law_key(seed: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per request of `SyntheticAcceptance` (int64 [R]): its seed and the law's stream."""
    seed = seed.long()
    hi = (((seed >> 32) & _M32) * 0x61C88647) & _M32
    return _mix32((seed & _M32) ^ hi ^ ((STREAM_SYNTHETIC * 0x85EBCA6B) & _M32))


@dataclass(frozen=True)
class SyntheticAcceptance:
    """A benchmark's acceptance law (`EngineConfig.synthetic_acceptance = "LO:HI"`), random weights only.

    Each request gets its own rate `alpha`, uniform in [lo, hi] from its seed; every draft in its
    window survives with probability `alpha` given the ones before it (keyed noise, fresh per
    step), so a full block commits `(1 - alpha^(gamma+1)) / (1 - alpha)` tokens on average. The
    drafter still runs (its cost is real) and its confidences are replaced by `alpha`, which makes
    them calibrated. Committed tokens are the accepted drafts and then the target's argmax: a
    sequence whose KV matches its tokens, but not the target's output."""
    lo: float
    hi: float

    @classmethod
    def parse(cls, spec: str) -> "SyntheticAcceptance":
        try:
            lo, hi = (float(x) for x in str(spec).split(":"))
        except ValueError:
            raise ValueError(f"synthetic_acceptance must be 'LO:HI' (two rates), not {spec!r}") from None
        if not 0 <= lo <= hi < 1:
            raise ValueError(f"synthetic_acceptance {spec!r}: need 0 <= LO <= HI < 1")
        return cls(lo, hi)

    def rates(self, seed: torch.Tensor) -> torch.Tensor:
        """alpha per request [R] (float32), a function of its seed alone."""
        return self._rate(_law_key(seed))

    def _rate(self, key: torch.Tensor) -> torch.Tensor:
        return self.lo + (self.hi - self.lo) * _to_uniform(_mix32(key))

    def expected_tau(self, gamma: int) -> float:
        """Tokens a full block commits per verify step, over the steps of requests of one length:
        a request of rate alpha takes 1 / tau(alpha) steps per token, so the mean over steps is
        the harmonic mean of tau(alpha) over the rates (below the mean over requests)."""
        a = np.linspace(self.lo, self.hi, 4097)
        tau = (1 - a ** (gamma + 1)) / (1 - a)
        return float(1 / np.mean(1 / tau))

    def verdict(self, drafts: torch.Tensor, logits: torch.Tensor, row_index: torch.Tensor, seed: torch.Tensor,
                anchor_pos: torch.Tensor, verified: torch.Tensor, cap: torch.Tensor,
                rate: torch.Tensor | None = None) -> BatchVerdict:
        """`verify_batch`'s result under this law: draft k accepted iff its uniform < alpha (inside
        the window; `rate`: `rates(seed)` if the caller has it); the next token is the target's
        argmax after the accepted drafts. The noise is keyed by (seed, position, anchor) in two
        hash rounds: the law stands in for a greedy verify, which draws no noise at all, so its
        price inside every drafting step must stay near that one's (the sampler's
        `noise_key` would cost some 240 small kernels a step)."""
        R, g = drafts.shape
        k = torch.arange(g, device=drafts.device)
        key = _law_key(seed)
        rate = self._rate(key) if rate is None else rate
        pos = anchor_pos[:, None] + 1 + k[None, :]                      # each draft's position
        h = _mix32(key[:, None] ^ ((pos * 0x165667B1) & _M32))
        u = _to_uniform(_mix32(h ^ ((anchor_pos[:, None] * 0x27D4EB2F) & _M32)))
        ok = (u < rate[:, None]) & (k[None, :] < verified[:, None])
        m_full = ok.long().cumprod(1).sum(1)
        m = torch.minimum(m_full, cap)
        nxt = logits.argmax(-1)[row_index].gather(1, m[:, None])[:, 0]
        return _verdict(drafts, m, m_full, nxt)
