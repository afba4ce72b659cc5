"""One step, launched and resolved: the typed seam between the engine and the device.

The data flow of a step is one-way: the scheduler *chooses* (`StepPlan`), `Executor.launch`
*drafts and verifies* on the device (the prefill forward of runner.py, then the decode step of
speculative.py, replayed from a CUDA graph when a tier fits) and returns a `StepHandle`
without waiting; `StepHandle.result()` waits for the device and returns a `StepResult`; the
engine alone *commits* it to its requests. Nothing here receives the engine or changes a
request.

Launch and result are separate calls so that the engine can launch step n+1 before it reads
step n (overlap_loop.py); the synchronous loop calls them back to back.

Invariants: a `StepResult` holds one `Commit` per request of the plan that committed or
advanced; the device outputs a handle reads were copied into host memory of its own, so a
later step cannot overwrite them; `result()` can be called once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .ragged_graphs import RaggedGraphs, StaticInputs, pick_tier, tier_list
from .runner import Chunk, ModelRunner
from .speculative import DecodeBatch, DecodeOut, SpecStep
from .verify import VerifyMode


@dataclass
class WindowPlan:
    """The host's part of choosing windows: the budget (cost scheduler), or forced windows."""
    budget: int                       # draft tokens to verify when trimming
    trim: bool                        # choose windows by survival under the budget
    window_cap: list[int]             # most drafts per request (gamma unless forced)
    accept_cap: int                   # most drafts accepted per request (gamma unless profiling)
    predicted_step_time: float = float("nan")


@dataclass
class StepPlan:
    """What one step runs: prefill chunks (host-known) and decoding requests (by slot)."""
    chunks: list[Chunk] = field(default_factory=list)
    chunk_owners: list = field(default_factory=list)     # the request of each chunk
    decode: list = field(default_factory=list)           # decoding requests
    decode_slots: list[int] = field(default_factory=list)
    windows: WindowPlan | None = None
    greedy_only: bool = True
    truncates: bool = False


@dataclass
class Commit:
    """What one step did to one request (applied by the engine)."""
    request: object
    tokens: list[int]                 # new tokens, in order (the first may end the request)
    advanced: int                     # rows whose KV became valid (prefill rows, or 1 + accepted)
    verify: "VerifyStats | None" = None
    finite: bool = True               # False: the request's logits held a NaN or inf (it fails alone)


@dataclass
class VerifyStats:
    """One request's verify step (for SpecStats and the observers)."""
    window: int                       # the window chosen
    verified: int                     # drafts the target scored
    accepted: int
    ceiling: int | None               # cap-accept: what a full-block verify accepted
    conf: list[float]                 # calibrated conditional confidences of its gamma drafts
    conf_logits: list[float]
    drafts: list[int]                 # the gamma proposed drafts (the ceiling estimator settles trimmed ones)


@dataclass
class StepResult:
    commits: list[Commit]
    step: int                         # the step's index (the cost scheduler's relay clock)
    predicted_step_time: float = float("nan")
    seconds: float = 0.0              # launch to result, host clock
    tier: tuple[int, int] | None = None   # the graph tier replayed (None: eager or no decode)


class StepHandle:
    """A launched step: the device outputs are on their way to pinned host memory."""

    def __init__(self, plan: StepPlan, step: int, gamma: int, host: list[torch.Tensor], event, t0: float,
                 tier):
        self.plan, self.step, self.gamma, self.host, self.event, self.t0, self.tier = plan, step, gamma, host, event, t0, tier
        self._done = False

    def result(self) -> StepResult:
        assert not self._done, "a step's result is read once"
        self._done = True
        if self.event is not None:
            self.event.synchronize()
        plan, g = self.plan, self.gamma
        sampled, ints, floats = (t.tolist() for t in self.host)
        n_s = len(sampled) // 2                    # tokens, then their finite flags
        commits, j = [], 0
        for c, req in zip(plan.chunks, plan.chunk_owners):
            tokens = [sampled[j]] if c.sample else []
            ok = bool(sampled[n_s + j]) if c.sample else True
            j += c.sample
            commits.append(Commit(req, tokens, len(c.token_ids), None, ok))
        R = len(plan.decode)
        if R:
            Rp = len(ints) // (2 * g + 6)
            toks, drafts = ints[:Rp * (g + 1)], ints[Rp * (g + 1):Rp * (2 * g + 1)]
            base = Rp * (2 * g + 1)
            count, windows, verified, ceiling, finite = (ints[base + i * Rp:base + (i + 1) * Rp] for i in range(5))
            conf, conf_logits = floats[:Rp * g], floats[Rp * g:]
            for r, req in enumerate(plan.decode):
                n = count[r]
                vs = VerifyStats(windows[r], verified[r], max(n - 1, 0), ceiling[r], conf[r * g:(r + 1) * g],
                                 conf_logits[r * g:(r + 1) * g], drafts[r * g:(r + 1) * g])
                commits.append(Commit(req, toks[r * (g + 1):r * (g + 1) + n], n, vs, bool(finite[r])))
        wp = plan.windows
        return StepResult(commits, self.step, wp.predicted_step_time if wp else float("nan"),
                          time.perf_counter() - self.t0, self.tier)


def pack_out(out: DecodeOut) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode outputs as one int64 and one float32 tensor (two device-to-host copies)."""
    ints = torch.cat([out.tokens.reshape(-1), out.drafts.reshape(-1), out.count, out.windows, out.verified,
                      out.ceiling, out.finite])
    floats = torch.cat([out.conf.reshape(-1), out.conf_logits.reshape(-1)])
    return ints, floats


class Executor:
    """Launches steps: the prefill forward and the decode step, graphed where a tier fits."""

    def __init__(self, runner: ModelRunner, spec: SpecStep, max_slots: int, scratch: int, device,
                 cuda_graphs: bool, batch_sizes, token_fractions):
        self.runner, self.spec, self.device, self.scratch = runner, spec, device, scratch
        self.gamma = spec.gamma
        self.inputs = StaticInputs(max_slots, device)
        self.tiers = tier_list(batch_sizes, self.gamma, token_fractions if spec.mode.trims else (1.0,),
                               max_slots=max_slots)
        self.graphs = RaggedGraphs(self._decode, self.inputs, self.tiers, device, cuda_graphs, scratch)
        self.steps = 0
        self.cuda = torch.device(device).type == "cuda"

    def _decode(self, views, tokens: int, greedy_only: bool, truncates: bool):
        slots, valid, cap, budget, trim, accept = views
        b = DecodeBatch(slots, valid != 0, budget, trim != 0, cap, accept)
        return pack_out(self.spec(b, tokens, greedy_only, truncates))

    def tokens_needed(self, plan: StepPlan) -> int:
        """Verify rows of the decode batch, an upper bound known on the host."""
        g, w = self.gamma, plan.windows
        per = [min(g, c) if self.spec.mode is VerifyMode.COMPACT else g for c in w.window_cap]
        drafts = sum(per)
        if self.spec.mode is VerifyMode.COMPACT and w.trim:
            drafts = min(drafts, w.budget)
        return len(plan.decode) + drafts

    def launch(self, plan: StepPlan) -> StepHandle:
        t0 = time.perf_counter()
        step = self.steps
        self.steps += 1
        sampled = self.runner.prefill(plan.chunks, plan.truncates) if plan.chunks else None
        outs, tier = [], None
        if plan.decode:
            R, w = len(plan.decode), plan.windows
            need = self.tokens_needed(plan)
            tier = pick_tier(self.tiers, R, need) or (R, need)
            self.inputs.write(plan.decode_slots, self.scratch, tier[0], w.window_cap, w.budget, w.trim, w.accept_cap)
            outs = list(self.graphs.run(tier, (plan.greedy_only, plan.truncates)))
        else:
            outs = [torch.zeros(0, dtype=torch.long, device=self.device), torch.zeros(0, device=self.device)]
        dev = [sampled if sampled is not None else torch.zeros(0, dtype=torch.long, device=self.device)] + outs
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in dev]
        for h, d in zip(host, dev):
            h.copy_(d, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        graphed = tier is not None and self.graphs.captured(tier, (plan.greedy_only, plan.truncates))
        return StepHandle(plan, step, self.gamma, host, event, t0, tier if graphed else None)
