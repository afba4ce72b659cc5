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
the running batch (`RunningBatch.attach`), given back when it is freed or preempted.

A request with a step in flight (engine.py `step`) reserves KV for that step *and* the next:
the host does not know yet how far the one in flight will go. It cannot be preempted until
that step is read: `schedule` raises `Drain` and the loop reads it first.

Invariants: a plan's rows sum to at most the token budget; every row planned has a reserved
slot in every group (a decoding request reserves its whole verify window, also when it is
admitted decoding after a full prefix hit); a request is in exactly one of `waiting` and
`running` until it finishes; a request sent back to the queue holds no blocks; `running` never
holds more than `max_num_seqs` requests; a snapshot's blocks are in no request's table.
Walkthrough chapter 01 (batching and preemption), chapter 02 (blocks, prefix hits) and
chapter 13 (SWA replay and snapshots).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .batch import RunningBatch
from .config import EngineConfig, ModelConfig
from .paged_kv import BlockManager, BlockTable, NoFreeBlocks
from .request import Request, Status
from .swa_replay import Snapshot, SnapshotPool, plan_replay, replay_tokens, snapshot_plan


SETTLE_BLOCKS = 4      # KV blocks a decoding request reserves / publishes / releases at a time

def admission_due(n_waiting: int, n_decoding: int, prefilling: bool, waited: int, max_waiting_steps: int,
                  waiting_served_ratio: float) -> bool:
    """May the queue's head be admitted in this step? At once when nothing decodes, when a prefill
    runs in the step anyway, or when the queue holds `waiting_served_ratio` of the decoding
    requests; else once it has been held back `max_waiting_steps` schedules. Admitting in waves lets
    one prefill forward serve several arrivals: on the GPU its launches cost the same for one."""
    return bool(n_waiting) and (not n_decoding or prefilling or waited >= max_waiting_steps
                                or n_waiting >= waiting_served_ratio * n_decoding)


class Drain(Exception):
    """Scheduling must preempt a request whose step is still in flight: read it first."""


class Scheduler:
    """Admission, chunked prefill, preemption. Owns the queues and the block managers."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, managers: dict[str, BlockManager],
                 look_back: int = 0, batch: RunningBatch | None = None, draft_group: str | None = None):
        """look_back: rows a decoding request may write past its frontier and take back
        (`swa_replay.look_back`), for `swa_replay_tokens="auto"`. batch: the running requests'
        host arrays (batch.py; the engine's, or one of the scheduler's own). draft_group: the
        group whose blocks also hold the drafter's context ("full", shared; "draft", its own)."""
        self.cfg, self.model_cfg, self.managers = cfg, model_cfg, managers
        self.draft_group = draft_group
        # shared with the full group: its published blocks that hold no drafter context (filled
        # by a request whose context had lapsed); a prefix hit stops before the first of them
        self.no_context = np.zeros(managers["full"].num_blocks, dtype=bool) if draft_group == "full" else None
        self.batch = batch if batch is not None else RunningBatch(cfg.max_num_seqs)
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}           # admission order (a dict: O(1) removal)
        self.prefilling: dict[Request, None] = {}        # running requests not decoding yet
        self.waited = 0                                   # schedules the queue's head was held back
        # "auto" is the engine's to resolve (it knows whether steps replay graphs); unresolved: no wait
        self.max_waiting_steps = 0 if cfg.max_waiting_steps == "auto" else cfg.max_waiting_steps
        self.changed: set[Request] = set()               # tables grown since the engine last synced them
        self.n_sliding = model_cfg.layer_types.count("sliding_attention")
        self.window = model_cfg.sliding_window
        self.replay_keep = replay_tokens(cfg.swa_replay_tokens, self.window, self.n_sliding, look_back)
        sliding = managers.get("sliding") if "full" in managers and cfg.enable_prefix_cache else None
        self.snapshots = SnapshotPool(sliding, self.window, cfg.swa_snapshots, cfg.swa_snapshot_ttl_s)
        # With snapshots, a sliding table keeps one more block than the window needs: a snapshot
        # is cut at a block boundary up to block_size - 1 positions before the frontier.
        self.window_kept = self.window + (cfg.block_size if self.snapshots.capacity else 0)
        # A decoding request reserves, publishes and releases KV in runs of SETTLE_BLOCKS blocks:
        # per-request Python then runs once per run instead of once per block (host work per step
        # at batch 256), for at most SETTLE_BLOCKS - 1 blocks held ahead per request.
        self.settle_tokens = cfg.block_size * SETTLE_BLOCKS

    # -- requests in and out ----------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """`req` leaves for good: out of the queues, its blocks and slot given back."""
        self.running.pop(req, None)
        self.prefilling.pop(req, None)
        if req.status == Status.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.free(req)

    # -- block bookkeeping, over all KV groups ----------------------------------------------
    def _allocate(self, req: Request) -> tuple[int, Snapshot] | None:
        """Tables for all of the request's tokens: a prefix hit in the cached groups, then the
        sliding table from a snapshot or for the replay plan (atomic). Returns the snapshot it
        took (with its key), if any."""
        ids = req.all_ids
        cached = {g: bm for g, bm in self.managers.items() if g != "sliding"}
        cap = min((bm.match_prefix(ids) for bm in cached.values()), default=0)  # a hit must hold in every group
        if cap and self.no_context is not None:     # ... and hold the drafter's context
            hits = self.managers["full"].prefix_blocks(ids, cap)
            cap = next((i for i, b in enumerate(hits) if self.no_context[b]), len(hits)) * self.cfg.block_size
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
        self.settle(req, 0)                             # publish what a run of blocks left unpublished
        return self.snapshots.save(full.last_hash, self.managers["full"].published_tokens(full), sliding)

    def _grow(self, req: Request, num_tokens: int) -> None:
        """Reserve positions < num_tokens in every group, rounded up to whole blocks (a decoding
        request: to a run of SETTLE_BLOCKS, within its limit): a request then needs the scheduler
        again only when its next rows cross that boundary."""
        bs = self.cfg.block_size
        if req.is_decoding:
            run = self.settle_tokens
            num_tokens = max(num_tokens, min(-(-num_tokens // run) * run, -(-req.limit_len // bs) * bs))
        num_tokens = -(-num_tokens // bs) * bs
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
        self.changed.discard(req)
        self.batch.detach(req)

    def preempt(self, req: Request) -> None:
        if req.inflight:
            raise Drain(req.request_id)
        self.free(req)
        self.running.pop(req)
        self.prefilling.pop(req, None)
        req.status, req.num_computed = Status.WAITING, 0
        self.waiting.appendleft(req)

    def settle(self, req: Request, old_computed: int) -> None:
        """After a commit moved `req` from `old_computed` across a block boundary: release the
        sliding blocks the window has left, publish the blocks that became full."""
        bs = self.cfg.block_size
        for g, t in req.tables.items():
            bm = self.managers[g]
            if g == "sliding":
                bm.release_outside_window(t, self.window_kept, min(req.num_computed, req.num_tokens))
            elif g == "draft" and self.batch.lapsed[req.slot]:
                continue                                # holes in its drafter context: nothing to share
            elif bm.enable_prefix_cache:                # the unpublished tail only: O(new), not O(length)
                start = bm.published_tokens(t)
                if req.num_computed - start >= bs:
                    first = t.num_hashed_blocks
                    bm.commit(t, req.ids(start, req.num_computed), start)
                    if g == self.draft_group == "full":   # the blocks it published: with its context?
                        for b in t.blocks[first:t.num_hashed_blocks]:
                            if b != -1 and bm.block_hash[b] is not None:      # (not: another's was first)
                                self.no_context[b] = self.batch.lapsed[req.slot]

    # -- one step ---------------------------------------------------------------------------
    @staticmethod
    def prefill_end(req: Request) -> int:
        """Where a request's prefill stops: the end of its prompt, whose last row samples the first
        token; after a preemption, one short of its last token, which becomes the anchor of a verify
        step as it would have without the preemption (so recompute draws what it would have)."""
        return req.num_tokens - 1 if req.num_output else req.num_tokens

    @staticmethod
    def reservation(req: Request, rows: int) -> int:
        """Slots a request must hold to compute `rows` more: a prefill chunk's end; for a decode
        step, a window beyond each decode step still in flight, but never past the last position
        its limit lets it write (the device clamps windows to the limit)."""
        if not req.is_decoding:
            return req.num_computed + rows
        return min(req.num_computed + rows * (1 + req.decode_inflight), req.limit_len - 1)

    def schedule(self, decode_rows: int = 1) -> "Schedule":
        """This step's work, in three passes: every decoding request computes a verify window of
        `decode_rows` rows (all at once, on arrays); running requests still prefilling get the
        next chunk of the token budget that is left; waiting requests are admitted, in order,
        while slots, blocks and budget last."""
        b, budget = self.batch, self.cfg.max_num_batched_tokens
        self.snapshots.expire()
        out = Schedule()
        for req in [r for r in self.prefilling if r.is_decoding]:     # its prompt is computed
            del self.prefilling[req]
            b.decoding[req.slot] = True
            out.joined.append(req)
        # 1. decoding requests: a window each; Python only for those that cross a KV block
        dec = np.flatnonzero(b.decoding)[:max(budget, 0) // decode_rows]
        need = np.minimum(b.num_computed[dec] + decode_rows * (1 + b.decode_inflight[dec]), b.limit_len[dec] - 1)
        for s in dec[need > b.reserved[dec]].tolist():
            req = b.req[s]
            if b.live[s]:                                  # (a preemption below may have taken it)
                self._reserve(req, self.reservation(req, decode_rows), out)
        dec = dec[b.live[dec] & b.decoding[dec]]          # without the preempted
        admitted = []                                     # slots admitted decoding (a full prefix hit)
        budget -= decode_rows * len(dec)
        # 2. running requests still prefilling: the next chunk
        for req in list(self.prefilling):
            if budget <= 0:
                break
            if req not in self.prefilling:                 # preempted for another in this loop
                continue
            rows = min(self.prefill_end(req) - req.num_computed, budget)
            if self._reserve(req, self.reservation(req, rows), out):
                out.prefill.append((req, rows))
                budget -= rows
        # 3. admission, while slots, blocks and budget last, when it is due
        due = bool(self.waiting) and self.admission_due(len(dec), bool(out.prefill))
        while due and self.waiting and budget > 0 and b.num_free > 0:
            req = self.waiting[0]
            try:
                taken = self._allocate(req)
            except NoFreeBlocks:
                break
            b.attach(req)
            # A prefix hit can leave only the last token to compute: then the request decodes in
            # this very step and needs slots for a whole verify window, not only for its tokens.
            decoding = req.is_decoding
            rows = decode_rows if decoding else min(self.prefill_end(req) - req.num_computed, budget)
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
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running[req] = None
            self.changed.add(req)
            b.reserved[req.slot] = self._reserved(req)
            if decoding:
                b.decoding[req.slot] = True
                admitted.append(req.slot)
                out.joined.append(req)
            else:
                self.prefilling[req] = None
                out.prefill.append((req, rows))
            budget -= rows
        out.decode = np.concatenate([dec, admitted]).astype(np.int64) if admitted else dec
        return out

    def admission_due(self, n_decoding: int, prefilling: bool) -> bool:
        """`admission_due` for this queue, counting the schedules its head is held back."""
        due = admission_due(len(self.waiting), n_decoding, prefilling, self.waited, self.max_waiting_steps,
                            self.cfg.waiting_served_ratio)
        self.waited = 0 if due else self.waited + 1
        return due

    def _reserve(self, req: Request, need: int, out: "Schedule") -> bool:
        """Grow `req`'s tables to `need` positions, preempting the most recently admitted requests
        while blocks lack. False if `req` itself had to go."""
        while True:
            try:
                self._grow(req, need)
                break
            except NoFreeBlocks:
                victim = next(reversed(self.running))
                self.preempt(victim)
                out.prefill = [(r, n) for r, n in out.prefill if r is not victim]
                if victim is req:
                    return False
        self.changed.add(req)
        self.batch.reserved[req.slot] = self._reserved(req)
        return True

    @staticmethod
    def _reserved(req: Request) -> int:
        return min((t.num_tokens for t in req.tables.values()), default=0)


@dataclass
class Schedule:
    """What one step computes: decoding slots (a verify window each) and prefill chunks."""
    decode: np.ndarray | list = field(default_factory=list)       # slots, int64
    prefill: list[tuple[Request, int]] = field(default_factory=list)   # (request, rows)
    joined: list[Request] = field(default_factory=list)        # became decoding in this schedule

    def __bool__(self) -> bool:
        return bool(len(self.decode) or self.prefill)
