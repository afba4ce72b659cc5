"""SWA replay and SWA snapshots: what a prefix-cache hit on a hybrid model still recomputes.

The idea (DeepSeek-V4.1's "SWA bounded replay"; YOCO-style hybrids, Sun et al. 2024;
walkthrough chapter 13, which derives the lengths and measures the drift). Full-attention
layers keep paged, prefix-cacheable KV; sliding-window layers need only the KV of the last `W`
positions, which is *not* prefix cached. After a hit of `hit` tokens the full layers have
everything and the sliding layers have nothing. Two ways back:

**Replay.** Recompute the last `R` tokens of the hit through the whole model. Those rows store
nothing into the prefix-cached groups and sliding attention reads no position below the replay
start (`kv_start`). Each sliding layer above the lowest loses exactness on the first `W - 1`
replay rows, and the next token needs sliding KV at positions `> hit - W` in all `N` of them:

    exact:    R = N * (W - 1)    the same logits as a cold prefill, up to kernel order
    bounded:  R = W + look_back  an approximation: the upper sliding layers start from a
                                 truncated window (DeepInfer / V4.1: 140 = 128 + 12)

`look_back = (1 + gamma) * windows` (windows = 1, or 2 with the overlapped step) is what the
engine may write past a request's committed frontier and take back; a ring of sliding KV must
hold `W + look_back` entries, and the bounded suffix is that ring's content. No setting replays
more than the exact length.

**Snapshot.** `SnapshotPool` keeps, for a finished request, the sliding blocks that hold
positions `[end - W + 1, end)`, where `end` is the prefix its full-attention blocks publish,
keyed by that prefix's chain hash (paged_kv.py). A follow-up whose prefix hit ends at the same
hash starts at `end` with those blocks in its sliding table: exact, and no replay. The pool is
bounded (`EngineConfig.swa_snapshots`, oldest out first; `swa_snapshot_ttl_s`), and under KV
pressure snapshots give their blocks back before any running request is preempted. Without a
snapshot a follow-up falls back to the configured replay.

Invariants: a snapshot's blocks are held by it alone (ref count 1, unpublished), until a
follow-up takes them (they move into its table) or the pool frees them; `tables()` lists them,
so `BlockManager.check_invariants(live + pool.tables())` holds at every step; a plan never
starts above the hit, and a replay never longer than the hit.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from .paged_kv import BlockManager, BlockTable


@dataclass(frozen=True)
class ReplayPlan:
    start: int          # first position computed by the prefill (the request's num_computed)
    replay_until: int   # rows below this store nothing into the prefix-cached groups
    kv_start: int       # first position sliding attention reads (the replay start, or a snapshot's)


# ---- how long a replay is -------------------------------------------------------------------
def exact_replay_tokens(window: int, n_sliding_layers: int) -> int:
    # BEGIN STUDENT swa-replay exact-replay
    return n_sliding_layers * (window - 1)
    # END STUDENT swa-replay


def look_back(gamma: int, windows: int = 1) -> int:
    """Positions past the committed frontier that the engine may write and take back: `windows`
    verify windows of anchor + gamma drafts (1 with the synchronous loop; 2 with the overlapped
    one, where a window is launched before the previous one is read)."""
    return (1 + gamma) * windows


def bounded_suffix(window: int, back: int) -> int:
    """The suffix a bounded replay keeps: the window plus the look-back (128 + 12 = 140)."""
    return window + back


def replay_tokens(setting: int | str, window: int, n_sliding_layers: int, back: int) -> int:
    """The replay length a `swa_replay_tokens` setting means: 0 = exact, "auto" = the window plus
    the look-back, n > 0 = n; never more than the exact length (a longer one buys nothing)."""
    exact = exact_replay_tokens(window, n_sliding_layers)
    if setting == "auto":
        return min(bounded_suffix(window, back), exact)
    return exact if setting == 0 else min(int(setting), exact)


def plan_replay(hit: int, window: int, n_sliding_layers: int, keep_tokens: int = 0) -> ReplayPlan:
    """Where a prefill starts after a prefix hit of `hit` tokens (multiple of the block size).

    Models without sliding layers start at the hit. `keep_tokens = 0` means exact replay; a
    longer bound than the exact length is cut to it. Sliding attention reads from the start."""
    # BEGIN STUDENT swa-replay plan-replay
    if hit == 0 or n_sliding_layers == 0:
        return ReplayPlan(hit, hit, hit)
    exact = exact_replay_tokens(window, n_sliding_layers)
    keep = min(keep_tokens, exact) if keep_tokens > 0 else exact
    start = max(0, hit - keep)
    return ReplayPlan(start, hit, start)
    # END STUDENT swa-replay


def snapshot_plan(end: int, window: int) -> ReplayPlan:
    """A follow-up that found a snapshot ending at `end`: nothing replayed."""
    return ReplayPlan(end, end, max(0, end - window + 1))


# ---- snapshots ------------------------------------------------------------------------------
@dataclass
class Snapshot:
    end: int              # the prefix its full blocks publish; a follow-up starts here
    table: BlockTable     # sliding blocks holding positions [end - W + 1, end); -1 below
    saved: float          # clock time it was taken (the TTL counts from here)


class SnapshotPool:
    """Sliding-window KV of finished requests, kept for a follow-up. Keys: the chain hash of
    the full-attention prefix the snapshot ends (`BlockTable.last_hash`)."""

    def __init__(self, manager: BlockManager | None, window: int, capacity: int, ttl_s: float,
                 clock=time.monotonic):
        self.manager, self.window, self.ttl_s, self.clock = manager, window, ttl_s, clock
        self.capacity = capacity if manager is not None else 0
        self.entries: OrderedDict[int, Snapshot] = OrderedDict()   # oldest first
        self.stats = dict(saved=0, hits=0, misses=0, uncovered=0, evicted=0, expired=0, reclaimed=0)

    def save(self, key: int, end: int, table: BlockTable) -> bool:
        """Move the blocks of `table` that hold positions [end - W + 1, end) into a snapshot
        (their entries in `table` become -1, so freeing the table leaves them alone)."""
        if self.capacity == 0 or end <= 0:
            return False
        bs = self.manager.block_size
        lo, hi = max(0, end - self.window + 1) // bs, end // bs
        kept = table.blocks[lo:hi]
        if len(kept) < hi - lo or -1 in kept:    # released already: nothing exact to keep
            self.stats["uncovered"] += 1
            return False
        if key in self.entries:                  # the same prefix again: the newer one stays
            self._drop(key)
        while len(self.entries) >= self.capacity:
            self._drop(next(iter(self.entries)))
            self.stats["evicted"] += 1
        for i in range(lo, hi):
            table.blocks[i] = -1
        self.entries[key] = Snapshot(end, BlockTable([-1] * lo + kept, num_tokens=end), self.clock())
        self.stats["saved"] += 1
        return True

    def take(self, key: int, end: int) -> Snapshot | None:
        """The snapshot ending at `end` under `key`, removed from the pool (its blocks are the
        caller's now), or None."""
        if self.capacity == 0 or end <= 0:
            return None
        self.expire()
        snap = self.entries.get(key)
        if snap is None or snap.end != end:
            self.stats["misses"] += 1
            return None
        del self.entries[key]
        self.stats["hits"] += 1
        return snap

    def put_back(self, key: int, snap: Snapshot) -> None:
        """Undo a `take` whose admission failed (its blocks were not touched)."""
        self.stats["hits"] -= 1
        self.entries[key] = snap
        self.entries.move_to_end(key, last=False)   # it keeps its age

    def expire(self) -> None:
        now = self.clock()
        for key in [k for k, s in self.entries.items() if now - s.saved > self.ttl_s]:
            self._drop(key)
            self.stats["expired"] += 1

    def reclaim(self) -> bool:
        """KV pressure: free the oldest snapshot. False when there is none."""
        if not self.entries:
            return False
        self._drop(next(iter(self.entries)))
        self.stats["reclaimed"] += 1
        return True

    def clear(self) -> None:
        for key in list(self.entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        self.manager.free(self.entries.pop(key).table)

    def tables(self) -> list[BlockTable]:
        return [s.table for s in self.entries.values()]

    @property
    def num_blocks(self) -> int:
        return sum(b != -1 for t in self.tables() for b in t.blocks)
