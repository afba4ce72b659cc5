"""One step, launched and resolved: the typed seam between the engine and the device.

The data flow of a step is one-way: the scheduler *chooses* (a `StepPlan`), `Executor.launch`
*drafts and verifies* on the device (the prefill forward of runner.py, then the decode step of
speculative.py, replayed from a CUDA graph when a tier fits) and returns a `StepHandle` without
waiting; `StepHandle.result()` waits for the device and returns a `StepResult`; the engine alone
*commits* it to its requests. Nothing here receives the engine or changes a request.

A step's decode half is arrays, one row per decoding request of the plan, in the plan's order
(`DecodeRows`: the slots, their generations when launched, and the `DecodeOut` copied to the
host): the engine commits all rows at once and touches a request's object only when something
happens to it. Launch and result are separate calls so that the engine can launch step n+1
before it reads step n (engine.py `step`).

Invariants: the device outputs a handle reads were copied into host memory of its own, so a
later step cannot overwrite them; `result()` can be called once; row i of a `DecodeRows` is the
request that held `slots[i]` with generation `generations[i]` when the step was launched.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .ragged_graphs import RaggedGraphs, StaticInputs, pick_tier, tier_list
from .runner import Chunk, ModelRunner
from .speculative import DecodeBatch, DecodeOut, SpecStep


@dataclass
class WindowPlan:
    """The host's part of choosing windows: the budget (cost scheduler), or forced windows."""
    budget: int                       # draft tokens to verify when trimming
    trim: bool                        # choose windows by survival under the budget
    window_cap: np.ndarray | None = None   # most drafts per request (None: gamma for every request)
    predicted_step_time: float = float("nan")
    draft: float = 1.0                # the share of rows that run the drafter's pass (0: a plain step)
    order: np.ndarray | None = None   # the rows in launch order, the drafting ones first (None: as planned)
    upkeep: bool = True               # False: a plain step that lets the drafter's context lapse


@dataclass
class StepPlan:
    """What one step runs: prefill chunks (host-known) and decoding requests (by slot)."""
    chunks: list[Chunk] = field(default_factory=list)
    chunk_owners: list = field(default_factory=list)              # the request of each chunk
    decode_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    decode_generations: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    windows: WindowPlan | None = None
    greedy_only: bool = True
    truncates: bool = False


@dataclass
class PrefillResult:
    """One chunk of the step: its request, and the token it sampled if it ended the prompt."""
    request: object
    chunk: Chunk
    token: int | None                 # None: the chunk did not reach the end of the request's tokens
    finite: bool = True               # False: the sampling row's logits held a NaN or inf


@dataclass
class DecodeRows:
    """The decode half of a step, one row per decoding request (host numpy arrays)."""
    slots: np.ndarray                 # int64 [R]
    generations: np.ndarray           # int64 [R]: the slots' generations at launch
    out: DecodeOut                    # numpy fields, R rows
    requests: np.ndarray | None = None     # object [R]: set by the engine for the rows it applied

    @property
    def accepted(self) -> np.ndarray:
        return np.maximum(self.out.count - 1, 0)

    @property
    def plain(self) -> bool:
        """A plain step's rows (no row drafted): the result has no draft columns."""
        return self.out.drafts.shape[1] == 0

    def select(self, rows: np.ndarray) -> "DecodeRows":
        """The rows `rows` (an index or boolean mask) only."""
        o = self.out
        return DecodeRows(self.slots[rows], self.generations[rows],
                          DecodeOut(*(f[rows] for f in o.fields())),
                          None if self.requests is None else self.requests[rows])


@dataclass
class StepResult:
    prefill: list[PrefillResult]
    decode: DecodeRows | None
    step: int                         # the step's index (the cost scheduler's relay clock)
    predicted_step_time: float = float("nan")
    seconds: float = 0.0              # launch to result, host clock
    tier: tuple[int, int] | None = None   # the graph tier replayed (None: eager or no decode)


class StepHandle:
    """A launched step: the device outputs are on their way to pinned host memory."""

    def __init__(self, plan: StepPlan, step: int, gamma: int, sampled: torch.Tensor, decode: tuple, event,
                 t0: float, tier):
        self.plan, self.step, self.gamma, self.event, self.t0, self.tier = plan, step, gamma, event, t0, tier
        self.sampled, self.decode = sampled, decode       # host copies (pinned on CUDA)
        self._done = False

    @property
    def host(self) -> list[torch.Tensor]:
        """Every host copy of the step's outputs (a tensor-parallel rank digests them)."""
        return [self.sampled, *self.decode]

    def result(self) -> StepResult:
        assert not self._done, "a step's result is read once"
        self._done = True
        if self.event is not None:
            self.event.synchronize()
        plan = self.plan
        sampled = self.sampled.tolist()
        n_s = len(sampled) // 2                            # tokens, then their finite flags
        prefill, j = [], 0
        for c, req in zip(plan.chunks, plan.chunk_owners):
            if c.sample:
                prefill.append(PrefillResult(req, c, sampled[j], bool(sampled[n_s + j])))
                j += 1
            else:
                prefill.append(PrefillResult(req, c, None))
        decode = None
        R = len(plan.decode_slots)
        if R:
            out = DecodeOut.unpack(*self.decode, self.gamma, R)      # the tier's first R rows: the requests
            decode = DecodeRows(plan.decode_slots, plan.decode_generations, out)
        wp = plan.windows
        return StepResult(prefill, decode, self.step, wp.predicted_step_time if wp else float("nan"),
                          time.perf_counter() - self.t0, self.tier)


class Executor:
    """Launches steps: the prefill forward and the decode step, graphed where a tier fits."""

    def __init__(self, runner: ModelRunner, spec: SpecStep, max_slots: int, scratch: int, device,
                 cuda_graphs: bool, batch_sizes, token_fractions, draft_fractions=()):
        self.runner, self.spec, self.device, self.scratch = runner, spec, device, scratch
        self.gamma = spec.gamma
        self.inputs = StaticInputs(max_slots, device, DecodeBatch)
        fractions = token_fractions if spec.mode.trims else (1.0,)
        # the tiers of each share of drafting rows (WindowPlan.draft): 1 = every row drafts;
        # with the cost scheduler's partial drafting also ceil(f * slots) rows, and 0 (a plain
        # step: one row per request)
        self.draft_tiers = {1.0: tier_list(batch_sizes, self.gamma, fractions, max_slots=max_slots)}
        if spec.mode.trims and self.gamma:
            self.draft_tiers[0.0] = tier_list(batch_sizes, 0, max_slots=max_slots)
            for f in draft_fractions:
                self.draft_tiers[f] = sorted({(b, b + math.ceil(tf * math.ceil(f * b) * self.gamma))
                                              for b in batch_sizes if b <= max_slots for tf in fractions})
        self.tiers = self.draft_tiers[1.0]
        self.graphs = RaggedGraphs(self._decode, self.inputs, self.tiers, device, cuda_graphs, scratch)
        self.steps = 0
        self.cuda = torch.device(device).type == "cuda"
        self.no_samples = torch.zeros(0, dtype=torch.long, device=device)     # a step without prefill
        self._tier_of: dict[tuple, tuple[int, int]] = {}                    # (requests, tokens, draft) -> tier

    def _decode(self, batch: DecodeBatch, tokens: int, greedy_only: bool, truncates: bool, draft: float = 1.0,
                upkeep: bool = True):
        return self.spec(batch, tokens, greedy_only, truncates, draft, upkeep).pack()

    def variant(self, plan: StepPlan) -> tuple:
        """The graph variant of a plan: the sampling code it needs, its share of drafting rows, and
        (a plain step only) whether it lets the drafter's context lapse."""
        w = plan.windows
        if w.draft == 1.0:
            return plan.greedy_only, plan.truncates
        return (plan.greedy_only, plan.truncates, w.draft) + (() if w.upkeep else (False,))

    def tokens_needed(self, plan: StepPlan) -> int:
        """Verify rows of the decode batch, an upper bound known on the host."""
        g, w, R = self.gamma, plan.windows, len(plan.decode_slots)
        if w.draft < 1.0:                 # a share of the rows drafts (none: a plain step); trimming
            return R + min(w.budget, math.ceil(w.draft * R) * g)
        if not self.spec.mode.verifies_window:
            return R * (1 + g)
        drafts = int(np.minimum(w.window_cap, g).sum()) if w.window_cap is not None else R * g
        return R + (min(drafts, w.budget) if w.trim else drafts)

    def launch(self, plan: StepPlan) -> StepHandle:
        t0 = time.perf_counter()
        step = self.steps
        self.steps += 1
        sampled = self.runner.prefill(plan.chunks, plan.truncates) if plan.chunks else None
        decode, tier = (), None
        R = len(plan.decode_slots)
        if R:
            w, need = plan.windows, (R, self.tokens_needed(plan))
            variant = self.variant(plan)
            tier = self._tier_of.get((*need, w.draft))
            if tier is None:                  # the tiers are fixed: a pair always picks the same one
                tier = self._tier_of[(*need, w.draft)] = pick_tier(self.draft_tiers.get(w.draft, ()), *need) or need
            self.inputs.write(plan.decode_slots, self.scratch, tier[0], w.window_cap, self.gamma, w.budget, w.trim)
            decode = self.graphs.run(tier, variant)
        if sampled is None:
            sampled = self.no_samples
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in (sampled, *decode)]
        for h, d in zip(host, (sampled, *decode)):
            h.copy_(d, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        graphed = tier is not None and self.graphs.captured(tier, variant)
        width = self.gamma if R and plan.windows.draft else 0     # a plain step's result has no draft columns
        return StepHandle(plan, step, width, host[0], tuple(host[1:]), event, t0, tier if graphed else None)
