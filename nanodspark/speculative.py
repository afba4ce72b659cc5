"""The decode step on the device: draft -> choose windows -> verify -> accept (paper section 3, Fig. 1).

One call of `SpecStep` advances every decoding request of a batch by one verify step, without
the host: the anchors and positions come from the device state (device_state.py), the drafter
proposes gamma tokens with confidences, the windows are chosen from those confidences (top-K
over survivals under the budget the cost scheduler set from older confidences), the windows are
packed into one ragged batch (ragged_graphs.py), the target scores it, `verify.verify_batch`
accepts a prefix of each window and adds the correction or bonus token, the state advances to
the new anchor, and the target features of the committed positions are injected into the
drafter's context cache. The step returns `DecodeOut` (device tensors); the engine copies it to
the host once and applies it. Plain decoding is the same step with gamma = 0 and no drafter.
The cost scheduler may let only the first ceil(draft * R) rows run the drafter's pass (`draft`
< 1, its most confident requests first; 0: a plain step): the others verify no draft, but every
committed row's features are injected, so any request can draft again the next step. After a
long run of plain steps it may also let the context *lapse* (`upkeep=False`, a plain step only):
no features captured or injected, a plain step at the target's own price, and each request's
`draft_start` moves past the step's token, so a request that drafts again reads only the context
fed since (lossless either way: verification decides; only acceptance can suffer).

Because nothing in here reads a device value on the host, the whole step can be captured in a
CUDA graph (ragged_graphs.py) and the next step can be launched before this one's result has
reached the host (engine.py `step`).

Invariants: a request's `seq_len` advances by exactly the rows whose KV is now valid (anchor +
accepted drafts); the drafter's context covers exactly the committed positions from
`draft_start` on; a window never lets a request run past its limit (`limit_len`: max_tokens or
max_model_len); a padding row (the scratch slot, or a request already at its limit) computes
nothing that is kept.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

import torch

from .cost_scheduler import choose_windows
from .device_state import DeviceState
from .drafter import Drafter
from .model import CausalLM, GroupMeta, KVCache, Ops, PagedAttentionContext
from .paged_kv import row_cache_index
from .ragged_graphs import pack_rows
from .sampling import STREAM_DRAFT, STREAM_TARGET
from .verify import VerifyMode, verify_batch


@dataclass
class DecodeBatch:
    """Inputs of one decode step over R request slots (static shapes: graph buffers)."""
    slots: torch.Tensor        # int64 [R]: device-state row per request (padding: the scratch slot)
    valid: torch.Tensor        # int64 [R]: 1 for a request, 0 for padding
    window_cap: torch.Tensor   # int64 [R]: most drafts per request (a forced window; gamma otherwise)
    budget: torch.Tensor       # int64 []: draft tokens the target verifies when trimming
    trim: torch.Tensor         # int64 []: 1 = choose windows by survival under `budget` (else full blocks)


@dataclass
class DecodeOut:
    """What one decode step did, per request slot of the batch (device tensors; on the host, after
    `unpack`, numpy arrays). A plain step's has no draft columns (gamma reads 0 below)."""
    tokens: torch.Tensor       # int64 [R, gamma + 1]: committed tokens are tokens[r, :count[r]]
    drafts: torch.Tensor       # int64 [R, gamma]: the proposed drafts (the ceiling estimator settles trimmed ones)
    count: torch.Tensor        # int64 [R]: tokens committed (accepted + 1; 0 for padding)
    windows: torch.Tensor      # int64 [R]: the window chosen (before the limit clamp)
    verified: torch.Tensor     # int64 [R]: drafts the target scored
    ceiling: torch.Tensor      # int64 [R]: drafts a full-block verify accepted (cap-accept)
    finite: torch.Tensor       # int64 [R]: 1 if every logit row of the request was finite
    drafted: torch.Tensor      # int64 [R]: 1 if the drafter's pass ran for the request (its conf is fresh)
    conf: torch.Tensor         # float32 [R, gamma]: calibrated conditional confidences
    conf_logits: torch.Tensor  # float32 [R, gamma]: raw confidence logits (calibration records)

    INTS = 8                   # the first eight fields are integers

    def fields(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One int64 and one float32 tensor: two device-to-host copies instead of ten."""
        f = self.fields()
        return (torch.cat([t.reshape(-1) for t in f[:self.INTS]]), torch.cat([t.reshape(-1) for t in f[self.INTS:]]))

    @classmethod
    def unpack(cls, ints: torch.Tensor, floats: torch.Tensor, gamma: int, rows: int | None = None) -> "DecodeOut":
        """`pack`'s inverse on the host: numpy views of the two copies, of their first `rows` rows
        (the requests of a padded tier; all rows by default)."""
        i, f = ints.numpy(), floats.numpy()
        T = len(i) // (2 * gamma + 7)                  # the rows packed
        n = T if rows is None else rows
        fields, at = [], 0
        for width in (gamma + 1, gamma, None, None, None, None, None, None):    # None: one value per row
            size = T * (1 if width is None else width)
            a = i[at:at + size]
            fields.append(a[:n] if width is None else a.reshape(T, width)[:n])
            at += size
        conf, logits = f[:T * gamma].reshape(T, gamma)[:n], f[T * gamma:].reshape(T, gamma)[:n]
        return cls(*fields, conf, logits)


class SpecStep:
    def __init__(self, model: CausalLM, kv_cache: KVCache, state: DeviceState, ops: Ops, block_size: int,
                 mode: VerifyMode, drafter: Drafter | None = None, draft_cache: torch.Tensor | None = None,
                 tp=None):
        self.model, self.kv_cache, self.state, self.ops, self.block_size = model, kv_cache, state, ops, block_size
        self.tp = tp                    # the tensor-parallel group the target's forward reduces over
        self.mode, self.drafter, self.draft_cache = mode, drafter, draft_cache
        self.gamma = drafter.config.gamma if drafter is not None else 0
        self.capture = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        self.coupled = False            # coupled drafts and verification (verify.verify_batch)
        self.synthetic = None           # a benchmark's acceptance law on random weights (verify.SyntheticAcceptance)

    @torch.inference_mode()
    def __call__(self, b: DecodeBatch, tokens_tier: int, greedy_only: bool, truncates: bool,
                 draft: float = 1.0, upkeep: bool = True) -> DecodeOut:
        st, g, R = self.state, self.gamma, b.slots.shape[0]
        dev = b.slots.device
        anchors, anchor_pos = st.last_token[b.slots], st.seq_len[b.slots]
        room = st.limit_len[b.slots] - anchor_pos - 2           # drafts that fit before the limit
        active = (b.valid != 0) & (room >= 0)        # (computed here, inside the graph: the inputs are views)
        samp = None if greedy_only else st.sampling(b.slots, truncates)
        # draft: the first D rows (all of them, some, or none: a plain step); D is the tier's, static
        D = min(R, math.ceil(draft * R)) if self.drafter is not None else 0
        upkeep = upkeep or D > 0                    # only a plain step may let the context lapse
        drafts = torch.zeros(R, g, dtype=torch.long, device=dev)
        draft_probs, conf, conf_logits = None, torch.zeros(R, g, device=dev), torch.zeros(R, g, device=dev)
        if D:
            sl = slice(0, D)
            d = self.drafter.propose(anchors[sl], anchor_pos[sl], self.draft_cache, st.tables["draft"][b.slots[sl]],
                                     self.block_size, None if samp is None else samp.rows(sl), self.ops,
                                     STREAM_TARGET if self.coupled else STREAM_DRAFT, st.draft_start[b.slots[sl]])
            if D == R:
                drafts, draft_probs, conf, conf_logits = d.tokens, d.probs, d.confidence.float(), d.conf_logits.float()
            else:                        # the other rows: no draft, confidence 0 (no window under top-K)
                drafts[sl], conf[sl], conf_logits[sl] = d.tokens, d.confidence.float(), d.conf_logits.float()
                if d.probs is not None:
                    draft_probs = torch.cat([d.probs, d.probs.new_zeros(R - D, *d.probs.shape[1:])])
            if self.synthetic is not None:          # the law's rate is each draft's calibrated confidence
                law_rate = self.synthetic.rates(st.seed[b.slots])
                rate = law_rate[:, None].expand(R, g)
                conf, conf_logits = rate.contiguous(), torch.logit(rate)
        # the rows that drafted: ceil(draft * requests), as the host counted them (float64 on both
        # sides); a padded tier's drafter pass may have run for a few more, whose drafts are dropped
        drafted = b.valid != 0
        if self.drafter is not None and not D:     # a plain step: nobody drafted (conf is all 0)
            drafted = torch.zeros_like(drafted)
        elif D < R:                      # a row that did not draft: no draft, confidence 0
            drafted = drafted & (torch.arange(R, device=dev) < torch.ceil(draft * drafted.sum().double()))
            conf = torch.where(drafted[:, None], conf, 0.0)
            conf_logits = torch.where(drafted[:, None], conf_logits, 0.0)
        # choose windows
        if D:
            windows = choose_windows(conf, active, b.budget, b.trim != 0, b.window_cap)
            verified = torch.minimum(self.mode.verified(windows, torch.full_like(windows, g)), room.clamp(min=0))
            if D < R:                    # ... and no window, trimmed or not
                windows, verified = torch.where(drafted, windows, 0), torch.where(drafted, verified, 0)
            cap = torch.minimum(self.mode.cap(windows, torch.full_like(windows, g)), verified)
        else:                            # the anchor row alone: nothing to choose, verify or cap
            windows = verified = cap = torch.zeros(R, dtype=torch.long, device=dev)
        rows = torch.where(active, 1 + verified, 0)
        # verify: one ragged forward of [anchor, d_1 .. d_verified] per request
        lay = pack_rows(rows, tokens_tier)
        ids = anchors[lay.row_req]
        if D:                            # rows past the anchor read their drafts (none without a draft)
            off = lay.row_off.clamp(max=g) - 1
            ids = torch.where(lay.row_off == 0, ids, drafts[lay.row_req, off.clamp(min=0)])
        pos = anchor_pos[lay.row_req] + lay.row_off
        kv_lens = (anchor_pos + rows).to(torch.int32)
        groups = {}
        for name in self.kv_cache.groups:
            bt = st.tables[name][b.slots]
            kv_index = row_cache_index(bt, lay.row_req, pos, self.block_size)
            groups[name] = GroupMeta(bt, torch.where(lay.row_valid, kv_index, -1), kv_lens,
                                     st.kv_start[b.slots] if name == "sliding" else None)
        ctx = PagedAttentionContext(self.kv_cache, lay.cu_seqlens, 1 + g if D else 1, groups, self.ops, tp=self.tp)
        out = self.model(ids, pos, ctx, self.capture if upkeep else ())
        logits = self.model.compute_logits(out.hidden, self.ops)
        row_index = (lay.cu_seqlens[:-1, None].long()
                     + torch.minimum(torch.arange(g + 1, device=dev)[None, :], (rows - 1).clamp(min=0)[:, None]))
        # a NaN or inf in one request's rows fails that request alone (the engine finishes it)
        finite = torch.isfinite(logits).all(-1)[row_index.clamp(0, tokens_tier - 1)].all(1).long()
        if not D:                        # the anchor row only: the target's token
            verdict = verify_batch(drafts[:, :0], None, logits, row_index[:, :1].clamp(0, tokens_tier - 1), samp,
                                   anchor_pos, verified, cap, greedy_only, self.coupled)
        elif self.synthetic is not None:
            verdict = self.synthetic.verdict(drafts, logits, row_index.clamp(0, tokens_tier - 1), st.seed[b.slots],
                                             anchor_pos, verified, cap, law_rate)
        else:
            verdict = verify_batch(drafts, draft_probs, logits, row_index.clamp(0, tokens_tier - 1), samp,
                                   anchor_pos, verified, cap, greedy_only, self.coupled)
        # accept: the new anchor and length, on the device
        count = torch.where(active, verdict.accepted + 1, 0)
        bonus = verdict.tokens.gather(1, verdict.accepted[:, None])[:, 0]
        st.last_token[b.slots] = torch.where(active, bonus, anchors)
        st.seq_len[b.slots] = anchor_pos + count
        if self.drafter is not None and upkeep:     # context K/V of the committed positions
            committed = lay.row_valid & (lay.row_off < count[lay.row_req])
            kv_index = row_cache_index(st.tables["draft"][b.slots], lay.row_req, pos, self.block_size)
            self.drafter.inject(out.captured, pos, torch.where(committed, kv_index, -1), self.draft_cache, self.ops)
        elif self.drafter is not None:   # lapsed: the context starts again after this step's tokens
            st.draft_start[b.slots] = torch.where(active, st.seq_len[b.slots], st.draft_start[b.slots]).int()
        w = g if D else 0                # a plain step's result has no draft columns: less to copy and commit
        return DecodeOut(verdict.tokens, drafts[:, :w], count, windows, verified, verdict.ceiling, finite,
                         drafted.long(), conf[:, :w], conf_logits[:, :w])
