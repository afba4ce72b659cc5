"""The scheduler: which requests run this step, and how many rows each computes.

The idea: continuous batching under two budgets. The token budget (`max_num_batched_tokens`)
bounds the rows of one forward; the KV budget is the free blocks of every KV group's
`BlockManager`. `Scheduler.schedule` first gives each running request its next slice (the rest
of its prompt cut to the budget: chunked prefill; or, decoding, a whole verify window of
`decode_rows` slots), then admits waiting requests in order while blocks and budget last. When a
running request cannot grow, the most recently admitted one is preempted: its blocks are freed
and it returns to the front of the queue with `num_computed = 0`, to be recomputed from its
prompt and its output so far. Admission takes a prefix-cache hit in the full-attention group,
then either a snapshot of the sliding-window KV that ends at the hit or a replay plan
(swa_replay.py: `SnapshotPool.take`, `plan_replay`); a finished request leaves a snapshot
(`save_snapshot`). Snapshots yield to live requests: a sliding-group allocation that does not fit
frees the oldest snapshot and tries again, before anything is preempted.

Block bookkeeping over all KV groups is atomic: `_allocate` and `_grow` either succeed in every
group or undo what they did and raise `NoFreeBlocks`. An admitted request also gets a slot of
the device state (`SlotPool`), given back when it is freed or preempted.

A request with a step in flight (overlap_loop.py) reserves KV for that step *and* the next:
the host does not know yet how far the one in flight will go. It cannot be preempted until
that step is read: `schedule` raises `Drain` and the loop reads it first.

Invariants: a plan's rows sum to at most the token budget; every row planned has a reserved
slot in every group (a decoding request reserves its whole verify window, also when it is
admitted decoding after a full prefix hit); a request is in exactly one of `waiting` and
`running` until it finishes; a request sent back to the queue holds no blocks; `running` never
holds more than `max_num_seqs` requests; a snapshot's blocks are in no request's table.
Walkthrough chapter 01 §4 (batching and preemption), chapter 02 (blocks, prefix hits) and
chapter 13 (SWA replay and snapshots).
"""
from __future__ import annotations

from collections import deque

from .config import EngineConfig, ModelConfig
from .paged_kv import BlockManager, BlockTable, NoFreeBlocks
from .request import Request, Status
from .swa_replay import Snapshot, SnapshotPool, plan_replay, replay_tokens, snapshot_plan


class Drain(Exception):
    """Scheduling must preempt a request whose step is still in flight: read it first."""


class SlotPool:
    """Rows of the device state, one per admitted request; a generation id per hand-out."""

    def __init__(self, n: int):
        self.free = list(range(n))[::-1]
        self.generation = [0] * n

    def take(self, req: Request) -> None:
        s = self.free.pop()
        self.generation[s] += 1
        req.slot, req.generation, req.synced, req.device_anchor = s, self.generation[s], {}, False

    def give(self, req: Request) -> None:
        if req.slot >= 0:
            self.free.append(req.slot)
        req.slot, req.synced = -1, {}


class Scheduler:
    """Admission, chunked prefill, preemption. Owns the queues and the block managers."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, managers: dict[str, BlockManager],
                 look_back: int = 0):
        """look_back: rows a decoding request may write past its frontier and take back
        (`swa_replay.look_back`), for `swa_replay_tokens="auto"`."""
        self.cfg, self.model_cfg, self.managers = cfg, model_cfg, managers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.n_sliding = model_cfg.layer_types.count("sliding_attention")
        self.window = model_cfg.sliding_window
        self.replay_keep = replay_tokens(cfg.swa_replay_tokens, self.window, self.n_sliding, look_back)
        self.slots = SlotPool(cfg.max_num_seqs)
        sliding = managers.get("sliding") if "full" in managers and cfg.enable_prefix_cache else None
        self.snapshots = SnapshotPool(sliding, self.window, cfg.swa_snapshots, cfg.swa_snapshot_ttl_s)
        # With snapshots, a sliding table keeps one more block than the window needs: a snapshot
        # is cut at a block boundary up to block_size - 1 positions before the frontier.
        self.window_kept = self.window + (cfg.block_size if self.snapshots.capacity else 0)

    # -- block bookkeeping, over all KV groups ----------------------------------------------
    def _allocate(self, req: Request) -> tuple[int, Snapshot] | None:
        """Tables for all of the request's tokens: a prefix hit in the cached groups, then the
        sliding table from a snapshot or for the replay plan (atomic). Returns the snapshot it
        took (with its key), if any."""
        ids = req.all_ids
        cached = {g: bm for g, bm in self.managers.items() if g != "sliding"}
        cap = min((bm.match_prefix(ids) for bm in cached.values()), default=0)  # a hit must hold in every group
        tables, snap, key = {}, None, None
        try:
            for g, bm in cached.items():
                tables[g] = bm.allocate_prompt(ids, cap)
            hit = tables["full"].num_cached_tokens if "full" in tables else 0
            if hit:
                key = tables["full"].last_hash
                snap = self.snapshots.take(key, hit)
            if snap is not None:
                plan, t = snapshot_plan(hit, self.window), BlockTable(list(snap.table.blocks), hit)
            else:
                plan = plan_replay(hit, self.window, self.n_sliding, self.replay_keep)
                nothing = plan.start // self.cfg.block_size        # blocks wholly below the replay
                t = BlockTable([-1] * nothing, nothing * self.cfg.block_size)
            if "sliding" in self.managers:
                self._sliding(lambda: self.managers["sliding"].ensure_capacity(t, len(ids)))
                tables["sliding"] = t
        except NoFreeBlocks:
            for g, t in tables.items():
                self.managers[g].free(t)
            if snap is not None:
                self.snapshots.put_back(key, snap)
            raise
        req.tables, req.num_computed, req.admitted_at = tables, plan.start, plan.start
        req.replay_until, req.kv_start = plan.replay_until, plan.kv_start
        return (key, snap) if snap is not None else None

    def _unadmit(self, req: Request, taken: tuple[int, Snapshot] | None) -> None:
        """Admission failed after `_allocate`: back to the queue as if never allocated; a
        snapshot it took goes back to the pool (its blocks are below the hit, untouched)."""
        if taken is not None:
            t = req.tables["sliding"]
            self.managers["sliding"].truncate(t, req.num_computed)      # the blocks added past the hit
            key, snap = taken
            snap.table = BlockTable(t.blocks, t.num_tokens)
            req.tables["sliding"] = BlockTable()
            self.snapshots.put_back(key, snap)
        self.free(req)
        req.num_computed = 0

    def _sliding(self, allocate) -> None:
        """Run a sliding-group allocation; when it does not fit, snapshots give way first."""
        while True:
            try:
                return allocate()
            except NoFreeBlocks:
                if not self.snapshots.reclaim():
                    raise

    def save_snapshot(self, req: Request) -> bool:
        """A request finished: keep its sliding-window KV for a follow-up (before `free`)."""
        full, sliding = req.tables.get("full"), req.tables.get("sliding")
        if full is None or sliding is None:
            return False
        return self.snapshots.save(full.last_hash, self.managers["full"].published_tokens(full), sliding)

    def _grow(self, req: Request, num_tokens: int) -> None:
        done = []
        try:
            for g, bm in self.managers.items():
                before, t = req.tables[g].num_tokens, req.tables[g]
                if g == "sliding":
                    self._sliding(lambda: bm.ensure_capacity(t, num_tokens))
                else:
                    bm.ensure_capacity(t, num_tokens)
                done.append((g, before))
        except NoFreeBlocks:
            for g, before in done:
                self.managers[g].truncate(req.tables[g], before)
            raise

    def free(self, req: Request) -> None:
        for g, t in req.tables.items():
            self.managers[g].free(t)
        req.tables = {}
        self.slots.give(req)

    def preempt(self, req: Request) -> None:
        if req.inflight:
            raise Drain(req.request_id)
        self.free(req)
        self.running.remove(req)
        req.status, req.num_computed = Status.WAITING, 0
        self.waiting.appendleft(req)

    # -- one step ---------------------------------------------------------------------------
    @staticmethod
    def _rows(req: Request, decode_rows: int, budget: int) -> int:
        """Rows a request computes this step: a whole verify window when it is decoding (only its
        last token lacks KV), else the next prefill chunk that fits the token budget."""
        return decode_rows if req.is_decoding else min(req.num_tokens - req.num_computed, budget)

    @staticmethod
    def reservation(req: Request, rows: int) -> int:
        """Slots a request must hold to compute `rows` more: a prefill chunk's end; for a decode
        step, a window beyond each decode step still in flight, but never past the last position
        its limit lets it write (the device clamps windows to the limit)."""
        if not req.is_decoding:
            return req.num_computed + rows
        return min(req.num_computed + rows * (1 + req.decode_inflight), req.limit_len - 1)

    def schedule(self, decode_rows: int = 1) -> list[tuple[Request, int]]:
        """(request, rows) pairs for this step. A decoding request reserves `decode_rows` slots
        (1, or 1 + gamma when the step verifies drafts)."""
        budget = self.cfg.max_num_batched_tokens
        self.snapshots.expire()
        plan: list[tuple[Request, int]] = []
        preempted = set()     # left `running` in this loop (a set: `in running` is O(n) per request)
        for req in list(self.running):
            if req in preempted or budget <= 0:
                continue
            rows = self._rows(req, decode_rows, budget)
            if rows > budget:  # a verify window does not fit the token budget: wait a step
                continue
            while True:
                try:
                    self._grow(req, self.reservation(req, rows))
                    break
                except NoFreeBlocks:
                    victim = self.running[-1]
                    self.preempt(victim)
                    preempted.add(victim)
                    plan = [(r, n) for r, n in plan if r is not victim]
                    if victim is req:
                        break
            if req not in preempted:
                plan.append((req, rows))
                budget -= rows
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            try:
                taken = self._allocate(req)
            except NoFreeBlocks:
                break
            self.slots.take(req)
            # A prefix hit can leave only the last token to compute: then the request decodes in
            # this very step and needs slots for a whole verify window, not only for its tokens.
            rows = self._rows(req, decode_rows, budget)
            fits = rows <= budget
            if fits:
                try:
                    self._grow(req, self.reservation(req, rows))
                except NoFreeBlocks:
                    fits = False
            if not fits:              # stays first in the queue, as if never allocated
                self._unadmit(req, taken)
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.append((req, rows))
            budget -= rows
        return plan
