"""SWA bounded replay: a prefix-cache hit on a hybrid model recomputes only a bounded suffix.

Idea (DeepSeek-V4.1's "SWA bounded replay", YOCO-style hybrids). Full-attention layers keep
paged, prefix-cacheable KV; sliding-window layers keep only the KV of the last `W` positions,
which is *not* prefix cached. After a hit of `hit` tokens, the full layers have everything,
but the sliding layers have nothing. Replaying the last `R` tokens of the hit through the whole
model rebuilds the sliding KV; those replay rows do not store into the full group (their KV is
already cached and shared), and sliding attention reads no position below the replay start.

How long must the replay be? The sliding KV of layer l at position q is a projection of layer
l's input at q. Inputs of the lowest sliding layer are exact at every replay row (only full
layers sit below it, and they see the whole cached prefix). Each further sliding layer loses
exactness on the first `W - 1` replay rows, because those rows see a truncated window. The
next token needs sliding KV at positions `> hit - W`, in all `N` sliding layers, hence

    exact:    R = N * (W - 1)     (bit-for-bit the same logits as a cold prefill, up to kernel order)
    bounded:  R = W + margin      (DeepInfer/V4.1 default 140 = 128 + 12: an approximation)

`EngineConfig.swa_replay_tokens = 0` picks the exact length; a positive value keeps that many
tokens (the V4.1 setting is 140). `tests/test_swa_replay.py` checks the exact case equals a
miss and measures the drift of the bounded case. Walkthrough chapter 02 (paged KV) explains it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplayPlan:
    start: int          # first position computed by the prefill (the request's num_computed)
    replay_until: int   # rows below this store nothing into the full group (already cached)


def exact_replay_tokens(window: int, n_sliding_layers: int) -> int:
    # BEGIN STUDENT swa-replay: exact_replay_tokens: how many tokens a replay needs so that every sliding
    #   layer's K/V above the hit is exact (each stacked sliding layer loses window - 1 rows)
    return n_sliding_layers * (window - 1)
    # END STUDENT swa-replay


def plan_replay(hit: int, window: int, n_sliding_layers: int, keep_tokens: int = 0) -> ReplayPlan:
    """Where a prefill starts after a prefix hit of `hit` tokens (multiple of the block size).

    Models without sliding layers start at the hit. `keep_tokens = 0` means exact replay."""
    # BEGIN STUDENT swa-replay: plan_replay: start the prefill keep tokens before the hit (keep_tokens, or
    #   the exact length when 0), never below 0; no hit or no sliding layer: no replay
    if hit == 0 or n_sliding_layers == 0:
        return ReplayPlan(hit, hit)
    keep = keep_tokens if keep_tokens > 0 else exact_replay_tokens(window, n_sliding_layers)
    return ReplayPlan(max(0, hit - keep), hit)
    # END STUDENT swa-replay
