"""The prefill forward: host-known chunks of prompt (and recomputed) tokens, run eagerly.

A step hands the runner a list of `Chunk`s, one per request that still has tokens without KV:
the token ids it feeds this step and the position of the first one. The runner packs them into
one ragged batch (`input_ids`, `positions`, `cu_seqlens_q`), addresses the paged cache through
the device block tables of the requests' slots (device_state.py), runs the model, injects the
target features of every row into the drafter's context cache, and, for each chunk that reaches
the end of its request's tokens, samples the next token on the device and makes it the
request's anchor there (`last_token`, `seq_len`), so the next decode step can start without
the host. Decode and verify rows never come here: they are built on the device
(speculative.py, ragged_graphs.py).

Invariants: the KV of positions `< chunk.start` is already in the cache (or, for SWA replay
rows, in the full-attention group only); a chunk's cache entries were reserved by the scheduler before
the forward (checked here: a row past the reservation would write into another request's
block); rows below `chunk.replay_until` do not store into the prefix-cached `full` group, nor
into the drafter's context (both already hold them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .device_state import DeviceState, h2d
from .drafter import Drafter
from .model import CausalLM, GroupMeta, KVCache, Ops, PagedAttentionContext
from .paged_kv import row_cache_index
from .sampling import STREAM_TARGET, sample_from_probs, probs_from_logits


@dataclass
class Chunk:
    slot: int                          # the request's device-state slot
    start: int                         # position of token_ids[0]
    token_ids: list[int]
    sample: bool = False               # the chunk ends the request's tokens: sample the next one
    replay_until: int = 0              # SWA replay: rows before this position skip the full group
    reserved: int | None = None        # positions reserved in the request's tables (checked)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, state: DeviceState, ops: Ops, block_size: int,
                 drafter: Drafter | None = None, draft_cache: torch.Tensor | None = None, tp=None):
        self.model, self.kv_cache, self.state, self.ops, self.tp = model, kv_cache, state, ops, tp
        self.block_size, self.drafter, self.draft_cache = block_size, drafter, draft_cache
        self.capture = tuple(drafter.config.target_layer_ids) if drafter is not None else ()

    @torch.inference_mode()
    def prefill(self, chunks: list[Chunk], truncates: bool = False) -> torch.Tensor:
        """Run the chunks; returns the tokens sampled for the chunks with `sample` (device, in order),
        followed by one flag per sampled chunk: 1 if its logits were finite."""
        ids, pos, row_req, skip, cu = [], [], [], [], [0]
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            # Writing past the reservation would land in a block another request may own.
            assert c.reserved is None or c.start + n <= c.reserved, (
                f"positions up to {c.start + n - 1} on a table reserved for {c.reserved}")
            ids += c.token_ids
            pos += range(c.start, c.start + n)
            row_req += [i] * n
            skip += [p < c.replay_until for p in range(c.start, c.start + n)]
            cu.append(cu[-1] + n)
        dev, st = self.state.device, self.state
        ids_d, pos_d, req_d = h2d(ids, torch.long, dev), h2d(pos, torch.long, dev), h2d(row_req, torch.long, dev)
        skip_d = h2d(skip, torch.bool, dev)
        slots_d = h2d([c.slot for c in chunks], torch.long, dev)
        kv_lens = h2d([c.start + len(c.token_ids) for c in chunks], torch.int32, dev)
        groups = {}
        for name in self.kv_cache.groups:
            bt = st.tables[name][slots_d]
            kv_index = row_cache_index(bt, req_d, pos_d, self.block_size)
            if name == "full":
                kv_index = torch.where(skip_d, -1, kv_index)
            groups[name] = GroupMeta(bt, kv_index, kv_lens, st.kv_start[slots_d] if name == "sliding" else None)
        ctx = PagedAttentionContext(self.kv_cache, h2d(cu, torch.int32, dev), max(len(c.token_ids) for c in chunks),
                                    groups, self.ops, tp=self.tp)
        out = self.model(ids_d, pos_d, ctx, self.capture)
        if self.drafter is not None:
            kv_index = row_cache_index(st.tables["draft"][slots_d], req_d, pos_d, self.block_size)
            self.drafter.inject(out.captured, pos_d, torch.where(skip_d, -1, kv_index), self.draft_cache, self.ops)
        last = [cu[i + 1] - 1 for i, c in enumerate(chunks) if c.sample]
        if not last:
            return torch.zeros(0, dtype=torch.long, device=dev)
        rows = h2d(last, torch.long, dev)
        ss = h2d([c.slot for c in chunks if c.sample], torch.long, dev)
        samp = st.sampling(ss, truncates)
        nxt_pos = pos_d[rows] + 1
        logits = self.model.compute_logits(out.hidden[rows], self.ops)
        tok = sample_from_probs(probs_from_logits(logits, samp), samp, nxt_pos, STREAM_TARGET)
        st.last_token[ss] = tok
        st.seq_len[ss] = nxt_pos
        return torch.cat([tok, torch.isfinite(logits).all(-1).long()])   # tokens, then finite flags
