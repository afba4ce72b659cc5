"""The speculative step: draft -> choose windows -> verify -> commit (paper §3, Fig. 1).

`SpecDecoder.step` replaces the plain forward-and-sample of a step. For every request that is
decoding, the drafter proposes a block of gamma tokens with confidences; the cost scheduler turns
the confidences into a per-request verify window; the target runs one ragged forward in which
prefill chunks and verify windows `[anchor, d_1 .. d_w]` sit side by side; `verify.py` accepts a
prefix of each window and adds the correction or bonus token; and the target hidden states of
every newly committed position are injected into the drafter's context cache. The engine then
applies the commits (engine.py `_apply`), which also rolls back the KV slots of rejected drafts.

Invariants: a request's `num_computed` advances by exactly the rows whose KV is now valid
(prefill rows, or anchor + accepted drafts); the drafter's context covers exactly the target's
committed positions; a window never lets a request run past `max_tokens` or `max_model_len`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .calibration import OnlineCalibrationMetrics, survival
from .cost_scheduler import CostScheduler
from .drafter import Draft, Drafter
from .paged_kv import BlockManager
from .runner import Chunk
from .sampling import sample_tokens, target_probs
from .verify import BlockAcceptEstimator, VerifyResult, verify_block, verify_greedy


@dataclass
class SpecStepStats:
    """What one speculative step did (the engine's metrics aggregate these)."""
    requests: int = 0
    verified: int = 0            # draft tokens verified (sum of windows)
    accepted: int = 0
    committed: int = 0
    windows: list[int] = field(default_factory=list)
    accepted_each: list[int] = field(default_factory=list)


class SpecDecoder:
    def __init__(self, drafter: Drafter, manager: BlockManager, cache: torch.Tensor, mode: str,
                 cost_scheduler: CostScheduler | None = None, max_slots: int = 1024):
        self.drafter, self.manager, self.cache, self.mode = drafter, manager, cache, mode
        self.gamma = drafter.config.gamma
        self.capture = tuple(drafter.config.target_layer_ids)
        self.scheduler = cost_scheduler or CostScheduler(self.gamma, max_slots, mode="static")
        self.window_fn = None          # tests may force windows: fn(requests, draft) -> list[int]
        # The step-cost profile sets 0: greedy rows then commit no draft (only the target's own
        # token), so every profiled step commits one token per request whatever its K, and the
        # table holds what *verifying* costs. Work per committed token (injection, detokenizing,
        # stop checks) is left out on purpose: it adds c * E to a step of E tokens, and
        # argmax E / (T + c E) = argmax E / T, so it cannot change the best budget, while a table
        # that counted it would credit trimming with the savings of committing fewer tokens.
        # (The min-gain guard compares ratios, which this makes a little optimistic: a gain is
        # diluted by the per-token share of a step, about a tenth of it at bs 256 on the H200.)
        self.accept_cap: int | None = None
        self.slots: dict[str, tuple[int, int]] = {}   # request id -> (slot, generation)
        self.free_slots = list(range(max_slots))[::-1]
        self.generation = [0] * max_slots
        self.position_trials = [0] * self.gamma      # verified drafts at position k
        self.position_accepts = [0] * self.gamma     # ... of which accepted
        self.recorder: list | None = None  # calibration: (raw conf logits, accepted, verified, request id) per proposal
        self.online = OnlineCalibrationMetrics(self.gamma)   # running ECE of the survivals (metrics)
        self.ceiling = BlockAcceptEstimator(self.gamma)      # what full-block verify would have accepted
        self.pending: dict[str, tuple] = {}  # request id -> (first position, trimmed drafts, window, accepted)
        self.step_times: deque[tuple[float, float]] = deque(maxlen=256)  # (predicted, measured) s, recent steps

    # -- slots for the confidence relay ------------------------------------------------------
    def slot_of(self, req) -> tuple[int, int]:
        if req.request_id not in self.slots:
            s = self.free_slots.pop()
            self.generation[s] += 1
            self.slots[req.request_id] = (s, self.generation[s])
        return self.slots[req.request_id]

    def release(self, req) -> None:
        if req.request_id in self.pending:
            self._settle(req, final=True)
        s = self.slots.pop(req.request_id, None)
        if s is not None:
            self.free_slots.append(s[0])

    # -- draft ----------------------------------------------------------------------------
    def draft(self, reqs) -> Draft:
        dev = self.cache.device
        anchors = torch.tensor([r.last_id for r in reqs], device=dev)
        pos = torch.tensor([r.num_computed for r in reqs], device=dev)
        tables = [r.tables["draft"].blocks for r in reqs]
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        params = [r.params for r in reqs]
        gens = [r.generator for r in reqs]

        all_greedy = all(p.greedy for p in params)

        def sample_fn(logits, k):
            if all_greedy:  # no distribution needed: verification compares argmaxes
                return logits.argmax(-1), None
            probs = target_probs(logits, params)
            return sample_tokens(probs, params, gens), probs
        return self.drafter.propose(anchors, pos, self.cache, bt, self.manager.block_size, sample_fn)

    def windows(self, reqs, draft: Draft, conf_host: torch.Tensor) -> tuple[list[int], float]:
        """Per-request windows and the cost table's predicted step time (nan without one).

        conf_host: this step's calibrated confidences, already on the host. This loop is
        synchronous (it copies the draft tokens to the host anyway), so the relay and the top-K
        both read one host copy: on a host-bound engine each device op costs tens of
        microseconds of launch time, more than the whole top-K over R * gamma cells on the CPU.
        """
        if self.window_fn is not None:
            return list(self.window_fn(reqs, draft)), float("nan")
        if self.mode == "static":
            return [self.gamma] * len(reqs), float("nan")
        ids = [self.slot_of(r) for r in reqs]
        plan = self.scheduler.plan([i[0] for i in ids], [i[1] for i in ids], conf_host)
        return plan.windows.tolist(), plan.predicted_step_time

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, eng, plan):
        t0, lap = time.perf_counter(), eng.clock.lap
        pre = [(r, n) for r, n in plan if not r.is_decoding]
        dec = [r for r, _ in plan if r.is_decoding]
        if self.accept_cap is not None and not all(r.params.greedy for r in dec):   # before any state changes
            raise ValueError("accept_cap (step-cost profiling) supports greedy requests only")
        for r in dec:
            if r.request_id in self.pending:
                self._settle(r)
        chunks = [eng.chunk_of(r, n) for r, n in pre]
        draft = self.draft(dec) if dec else None
        lap("draft")
        limits, wins, drafts, predicted = [], [], [], float("nan")
        if dec:
            drafts = draft.tokens.tolist()          # one device->host copy for the whole batch
            conf_host = draft.confidence.float().cpu()
            lap("copy")
            windows, predicted = self.windows(dec, draft, conf_host)
            lap("plan")
            for r, w, d in zip(dec, windows, drafts):
                room = min(r.params.max_tokens - len(r.output_ids), eng.max_model_len - r.num_tokens) - 1
                n_ver = min(w if self.mode == "compact" else self.gamma, room)
                limits.append(n_ver)
                wins.append(min(w, n_ver))
                chunks.append(Chunk(r.tables, r.num_computed, [r.last_id] + d[:n_ver],
                                    "all", r.replay_until, r.kv_start))
        res = eng.runner.forward(chunks, capture_layers=self.capture)
        lap("forward")
        starts = [c.start for c in chunks]
        commits = eng.sample_commits(pre, chunks[:len(pre)], res.logits, res.logit_offsets)
        committed_rows = [len(c.token_ids) for c in chunks[:len(pre)]]
        stats = SpecStepStats(requests=len(dec))
        # One device->host copy for every greedy row of the step instead of one per request.
        argmax = res.logits.argmax(-1).tolist() if any(r.params.greedy for r in dec) else None
        conf_logits = draft.conf_logits.float().cpu() if self.recorder is not None and dec else None
        lap("argmax")
        for i, r in enumerate(dec):
            j = len(pre) + i
            lo, hi = res.logit_offsets[j], res.logit_offsets[j + 1]
            n_ver = limits[i]
            if r.params.greedy:
                vr = verify_greedy(drafts[i][:n_ver], argmax[lo:hi], wins[i], self.mode)
                if self.accept_cap is not None and vr.accepted > self.accept_cap:
                    m = self.accept_cap       # the target's own token at the cap, as a rejection there
                    vr = VerifyResult(drafts[i][:m] + [argmax[lo + m]], m, vr.ceiling)
            else:
                probs = target_probs(res.logits[lo:hi], [r.params] * (hi - lo))
                vr = verify_block(draft.tokens[i, :n_ver], probs, draft.probs[i, :n_ver], wins[i], self.mode,
                                  False, r.generator)
            self._count(r, vr, wins[i], n_ver, stats)
            self._track_ceiling(r, drafts[i], vr, wins[i], n_ver)
            if self.recorder is not None:
                self.recorder.append((conf_logits[i], vr.accepted, n_ver, r.request_id))
            r.num_computed += 1 + vr.accepted
            committed_rows.append(1 + vr.accepted)
            commits.append((r, vr.tokens))
        lap("verify")
        self._inject(chunks, starts, committed_rows, res)
        lap("inject")
        if dec:
            self._observe(conf_host, stats)
            self.step_times.append((predicted, time.perf_counter() - t0))
        lap("observe")
        return commits

    def _observe(self, conf_host: torch.Tensor, stats: SpecStepStats) -> None:
        """Online calibration: survivals vs prefix-acceptance labels of the verified positions."""
        k = torch.arange(self.gamma)
        acc = torch.tensor(stats.accepted_each)
        labels = (k[None, :] < acc[:, None]).float()
        valid = k[None, :] < torch.tensor(stats.windows)[:, None]
        self.online.update(survival(conf_host), labels, valid)

    def _count(self, r, vr, window, n_ver, stats: SpecStepStats) -> None:
        verified = window if self.mode != "static" else n_ver
        r.spec.steps += 1
        r.spec.drafted += self.gamma
        r.spec.verified += verified
        r.spec.accepted += vr.accepted
        r.spec.committed += vr.accepted + 1
        stats.verified += verified
        stats.accepted += vr.accepted
        stats.committed += vr.accepted + 1
        stats.windows.append(verified)
        stats.accepted_each.append(vr.accepted)
        if vr.ceiling is not None:
            r.spec.ceiling += vr.ceiling + 1
        for k in range(min(vr.accepted + 1, verified)):
            self.position_trials[k] += 1
            self.position_accepts[k] += int(k < vr.accepted)

    def _track_ceiling(self, r, drafts: list[int], vr, window: int, n_ver: int) -> None:
        """Feed the block-accept estimator. cap-accept observes the ceiling directly; a trimmed
        compact step whose window was fully accepted leaves its remaining drafts pending, to be
        judged against the tokens the target commits at their positions (exact under greedy)."""
        if self.mode == "static":      # static verifies (and may commit) all n_ver drafts
            window = n_ver
        if vr.ceiling is not None:
            over = vr.ceiling - vr.accepted
            self.ceiling.record(window, vr.accepted, [True] * over + [False] * (vr.ceiling < n_ver) if over >= 0 and
                                vr.accepted == window else None)
        elif self.mode == "compact" and vr.accepted == window < self.gamma:
            self.pending[r.request_id] = (r.num_computed + window + 1, drafts[window:], window, vr.accepted)
        else:
            self.ceiling.record(window, vr.accepted)

    def _settle(self, r, final: bool = False) -> None:
        pos0, drafts, window, accepted = self.pending[r.request_id]
        later, verdicts = r.ids(pos0, pos0 + len(drafts)), []     # the tokens committed since
        for j, d in enumerate(drafts):
            if j >= len(later):
                break
            verdicts.append(later[j] == d)
            if not verdicts[-1]:
                break
        if final or len(verdicts) == len(drafts) or (verdicts and not verdicts[-1]):
            del self.pending[r.request_id]
            self.ceiling.record(window, accepted, verdicts)

    def summary(self) -> dict:
        """Engine-level DSpark metrics: per-position acceptance, online ECE, step time predicted
        vs measured (the server exports these on /metrics)."""
        pred = [p for p, _ in self.step_times if p == p]
        meas = [m for p, m in self.step_times if p == p]
        est = self.ceiling.estimate()
        return {
            "ceiling": None if est.records == 0 or est.ceiling != est.ceiling else {"tau": est.ceiling, "lo": est.lo, "hi": est.hi,
                                                      "delivered": est.delivered, "utilisation": est.utilisation},
            "position_acceptance": [a / t if t else None for a, t in zip(self.position_accepts, self.position_trials)],
            "online_ece": [None if e != e else float(e) for e in self.online.ece().tolist()],
            "step_time_predicted_s": sum(pred) / len(pred) if pred else None,
            "step_time_measured_s": (sum(meas) / len(meas) if meas else
                                     (sum(m for _, m in self.step_times) / len(self.step_times) if self.step_times else None)),
        }

    def _inject(self, chunks, starts, committed_rows, res) -> None:
        """Context K/V for every newly committed position (rows [0, committed) of each chunk)."""
        rows, positions, slots = [], [], []
        bs = self.manager.block_size
        for i, c in enumerate(chunks):
            table = c.tables["draft"].blocks
            for k in range(committed_rows[i]):
                p = starts[i] + k
                rows.append(res.cu_seqlens[i] + k)
                positions.append(p)
                slots.append(-1 if p < c.replay_until else table[p // bs] * bs + p % bs)
        if not rows:
            return
        dev = self.cache.device
        idx = torch.tensor(rows, device=dev)
        self.drafter.inject([h[idx] for h in res.captured], torch.tensor(positions, device=dev),
                            torch.tensor(slots, device=dev), self.cache)
