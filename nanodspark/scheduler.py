"""The scheduler: which requests run this step, and how many rows each computes.

The idea: continuous batching under two budgets. The token budget (`max_num_batched_tokens`)
bounds the rows of one forward; the KV budget is the free blocks of every KV group's
`BlockManager`. `Scheduler.schedule` first gives each running request its next slice (the rest
of its prompt cut to the budget: chunked prefill; or, decoding, a whole verify window of
`decode_rows` slots), then admits waiting requests in order while blocks and budget last. When a
running request cannot grow, the most recently admitted one is preempted: its blocks are freed
and it returns to the front of the queue with `num_computed = 0`, to be recomputed from its
prompt and its output so far. Admission takes a prefix-cache hit in the full-attention group and
plans the SWA replay after it (`swa_replay.plan_replay`).

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
holds more than `max_num_seqs` requests. Walkthrough chapter 01 §4 (batching and preemption) and
chapter 02 (blocks, prefix hits, SWA replay).
"""
from __future__ import annotations

from collections import deque

from .config import EngineConfig, ModelConfig
from .paged_kv import BlockManager, BlockTable, NoFreeBlocks
from .request import Request, Status
from .swa_replay import plan_replay


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

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, managers: dict[str, BlockManager]):
        self.cfg, self.model_cfg, self.managers = cfg, model_cfg, managers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.n_sliding = model_cfg.layer_types.count("sliding_attention")
        self.slots = SlotPool(cfg.max_num_seqs)

    # -- block bookkeeping, over all KV groups ----------------------------------------------
    def _allocate(self, req: Request) -> None:
        """Tables for all of the request's tokens; prefix hit on the full group (atomic)."""
        ids = req.all_ids
        cached = [bm for g, bm in self.managers.items() if g != "sliding"]
        cap = min((bm.match_prefix(ids) for bm in cached), default=0)  # a hit must hold in every group
        tables = {}
        try:
            for g, bm in self.managers.items():
                tables[g] = _fresh(bm, len(ids)) if g == "sliding" else bm.allocate_prompt(ids, cap)
        except NoFreeBlocks:
            for g, t in tables.items():
                self.managers[g].free(t)
            raise
        hit = tables["full"].num_cached_tokens if "full" in tables else 0
        plan = plan_replay(hit, self.model_cfg.sliding_window, self.n_sliding, self.cfg.swa_replay_tokens)
        req.tables, req.num_computed = tables, plan.start
        req.replay_until, req.kv_start = plan.replay_until, plan.start

    def _grow(self, req: Request, num_tokens: int) -> None:
        done = []
        try:
            for g, bm in self.managers.items():
                before = req.tables[g].num_tokens
                bm.ensure_capacity(req.tables[g], num_tokens)
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
        plan: list[tuple[Request, int]] = []
        for req in list(self.running):
            if req not in self.running or budget <= 0:
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
                    plan = [(r, n) for r, n in plan if r is not victim]
                    if victim is req:
                        break
            if req in self.running:
                plan.append((req, rows))
                budget -= rows
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            try:
                self._allocate(req)
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
                self.free(req)
                req.num_computed = 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.append((req, rows))
            budget -= rows
        return plan


def _fresh(bm: BlockManager, n: int) -> BlockTable:
    t = BlockTable()
    bm.ensure_capacity(t, n)
    return t
