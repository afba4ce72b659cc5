"""The prefill forward: host-known chunks of prompt (and recomputed) tokens, one ragged batch.

A step hands the runner a list of `Chunk`s, one per request that still has tokens without KV:
the token ids it feeds this step and the position of the first one. The runner packs them into
one ragged batch (`input_ids`, `positions`, `cu_seqlens_q`), addresses the paged cache through
the device block tables of the requests' slots (device_state.py), runs the model, injects the
target features of every row into the drafter's context cache, and, for each chunk that reaches
the end of its request's tokens, samples the next token on the device and makes it the
request's anchor there (`last_token`, `seq_len`), so the next decode step can start without
the host. Decode and verify rows never come here: they are built on the device
(speculative.py, ragged_graphs.py).

Graphs. Run eagerly, a prefill of a 30-layer model launches hundreds of kernels and costs the
host ~20 ms whatever its tokens, so at load the prefill waves, not the decode steps, set the
pace. With `cuda_graph_prefill` a prefill is padded to a *tier* (chunks, tokens, longest chunk;
`prefill_tier`) and replayed from a CUDA graph captured the first time that tier runs (the
first run is eager, on the same padded buffers, then the capture). Everything the forward reads
is one int64 buffer at a fixed address (`PrefillLayout`), written by one host-to-device copy;
padding rows belong to no chunk and store nothing, padding chunks are empty.

Invariants: the KV of positions `< chunk.start` is already in the cache (or, for SWA replay
rows, in the full-attention group only); a chunk's cache entries were reserved by the scheduler before
the forward (checked here: a row past the reservation would write into another request's
block); rows below `chunk.replay_until` do not store into the prefix-cached `full` group, nor
into the drafter's context (both already hold them); a replayed prefill equals its eager run on
the same padded buffers (same kernels, same shapes).
"""
from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .device_state import DeviceState
from .drafter import Drafter
from .model import CausalLM, GroupMeta, KVCache, Ops, PagedAttentionContext
from .paged_kv import row_cache_index
from .sampling import STREAM_TARGET, sample_from_probs, probs_from_logits

MAX_PREFILL_GRAPHS = 64      # tiers captured at most; a prefill of any other tier runs eagerly


@dataclass
class Chunk:
    slot: int                          # the request's device-state slot
    start: int                         # position of token_ids[0]
    token_ids: list[int]
    sample: bool = False               # the chunk ends the request's tokens: sample the next one
    replay_until: int = 0              # SWA replay: rows before this position skip the full group
    reserved: int | None = None        # positions reserved in the request's tables (checked)


def _pow2(n: int, lo: int) -> int:
    return max(lo, 1 << (max(1, n) - 1).bit_length())


def prefill_tier(chunks: int, tokens: int, longest: int) -> tuple[int, int, int]:
    """(chunk slots, token rows, longest chunk) a prefill pads to: powers of two, tokens past 512
    in steps of 512 (a padded row costs its FLOPs), the longest chunk at most the tokens."""
    t = _pow2(tokens, 16) if tokens <= 512 else -(-tokens // 512) * 512
    return _pow2(chunks, 1), t, min(t, _pow2(longest, 16))


class PrefillLayout:
    """The int64 input buffer of one prefill: [ids | positions | chunk of each row | stores into
    the full group and the drafter (1) or not (replay rows, padding) | stores at all (padding: 0)],
    T entries each, then [cu_seqlens (C + 1) | kv_lens | slots | rows sampled | their slots] (C
    each, the sampled chunks first) and the number sampled. Padding: rows past the chunks' end
    (chunk 0, position 0, no store), empty chunks (the scratch slot), sample entries of row 0 on
    the scratch slot (masked: they write nothing)."""

    def __init__(self, C: int, T: int):
        self.C, self.T = C, T
        self.size = 5 * T + 5 * C + 2

    def pack(self, chunks: list[Chunk], scratch: int, out: np.ndarray) -> int:
        """Write `chunks` into `out` (at least `size` int64); returns the number sampled."""
        T, C = self.T, self.C
        lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, len(chunks))
        n = int(lens.sum())
        cu = np.zeros(C + 1, np.int64)
        np.cumsum(lens, out=cu[1:len(chunks) + 1])
        cu[len(chunks) + 1:] = n
        ids, pos, req, full, store = (out[i * T:(i + 1) * T] for i in range(5))
        ids[n:] = pos[n:] = req[n:] = full[n:] = store[n:] = 0
        store[:n] = 1
        for i, c in enumerate(chunks):
            a, b = cu[i], cu[i + 1]
            ids[a:b] = c.token_ids
            pos[a:b] = np.arange(c.start, c.start + b - a)
            req[a:b] = i
            full[a:b] = pos[a:b] >= c.replay_until
        o = 5 * T
        out[o:o + C + 1] = cu
        kv, slots, rows, sslots = (out[o + C + 1 + i * C:o + C + 1 + (i + 1) * C] for i in range(4))
        kv[:] = 0
        slots[:] = scratch
        rows[:] = 0
        sslots[:] = scratch
        sampled = [i for i, c in enumerate(chunks) if c.sample]
        for i, c in enumerate(chunks):
            kv[i] = c.start + lens[i]
            slots[i] = c.slot
        for j, i in enumerate(sampled):
            rows[j] = cu[i + 1] - 1
            sslots[j] = chunks[i].slot
        out[o + 5 * C + 1] = len(sampled)
        return len(sampled)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, state: DeviceState, ops: Ops, block_size: int,
                 drafter: Drafter | None = None, draft_cache: torch.Tensor | None = None, tp=None):
        self.model, self.kv_cache, self.state, self.ops, self.tp = model, kv_cache, state, ops, tp
        self.block_size, self.drafter, self.draft_cache = block_size, drafter, draft_cache
        self.capture = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        self.cuda = torch.device(state.device).type == "cuda"
        self.pad = self.use_graphs = False
        self.graphs: dict[tuple, tuple] = {}      # (C, T, Q, truncates) -> (graph, its outputs)
        self.failed: set[tuple] = set()           # tiers whose capture failed: eager from then on
        self.pool = self.buf = None
        self.capture_seconds = 0.0                # host time spent capturing prefill graphs

    def set_tiers(self, max_tokens: int, graphs: bool) -> None:
        """Pad every prefill of at most `max_tokens` tokens to its tier; with `graphs` (CUDA, one
        process) replay it from a graph captured on the tier's first run. Without `graphs` the
        padded buffers run eagerly (how the CPU tests hold padding equal to no padding)."""
        C, T, _ = prefill_tier(self.state.scratch, max(16, max_tokens), 16)
        size = PrefillLayout(C, T).size
        self.pad, self.use_graphs = True, graphs and self.cuda and self.tp is None
        self.buf = torch.zeros(size, dtype=torch.long, device=self.state.device)
        # two pinned host copies used in turn (a copy may still be queued behind the step in flight)
        self.hosts = [torch.zeros(size, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self.turn = 0

    @torch.inference_mode()
    def prefill(self, chunks: list[Chunk], truncates: bool = False) -> torch.Tensor:
        """Run the chunks; returns the tokens sampled for the chunks with `sample` (device, in order),
        followed by one flag per sampled chunk: 1 if its logits were finite."""
        for c in chunks:
            # Writing past the reservation would land in a block another request may own.
            assert c.reserved is None or c.start + len(c.token_ids) <= c.reserved, (
                f"positions up to {c.start + len(c.token_ids) - 1} on a table reserved for {c.reserved}")
        C, T, Q = len(chunks), sum(len(c.token_ids) for c in chunks), max(len(c.token_ids) for c in chunks)
        tier = prefill_tier(C, T, Q) if self.pad else None
        if tier is not None and PrefillLayout(*tier[:2]).size <= self.buf.numel():
            C, T, Q = tier
            self.turn ^= 1
            h, buf = self.hosts[self.turn], self.buf
        else:                                     # unpadded (or past the tiers): a buffer of its own
            h = torch.zeros(PrefillLayout(C, T).size, dtype=torch.long, pin_memory=self.cuda)
            buf = None
        lay = PrefillLayout(C, T)
        n = lay.pack(chunks, self.state.scratch, h.numpy())
        if buf is None:
            buf = h.to(self.state.device, non_blocking=self.cuda)
        else:
            buf[:lay.size].copy_(h[:lay.size], non_blocking=self.cuda)
        key = (C, T, Q, truncates)
        entry = self.graphs.get(key) if buf is self.buf else None
        if entry is not None:
            entry[0].replay()
            tok, ok = entry[1]
        else:
            tok, ok = self._forward(buf, T, C, Q, truncates)
            if buf is self.buf and self.use_graphs and key not in self.failed and len(self.graphs) < MAX_PREFILL_GRAPHS:
                self._capture(key)
        return torch.cat([tok[:n], ok[:n]])       # a fresh tensor: the next replay may reuse the graph's

    def _capture(self, key) -> None:
        """Record the prefill of tier `key` on the buffer (already holding this step's inputs; the
        eager run before it compiled every kernel). Nothing runs while capturing."""
        C, T, Q, truncates = key
        t0 = time.perf_counter()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        was_enabled = gc.isenabled()
        gc.disable()                              # freeing CUDA memory is forbidden while capturing
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                out = self._forward(self.buf, T, C, Q, truncates)
            self.graphs[key] = (g, out)
        except RuntimeError as e:                 # e.g. a kernel that syncs: that tier stays eager
            self.failed.add(key)
            warnings.warn(f"prefill tier {key} runs eagerly: its capture failed ({e})")
        finally:
            if was_enabled:
                gc.enable()
            self.capture_seconds += time.perf_counter() - t0

    def _forward(self, buf: torch.Tensor, T: int, C: int, Q: int, truncates: bool):
        """The prefill on a `PrefillLayout` buffer: (tokens sampled [C], finite flags [C]); entries
        past the number sampled are padding. Reads no device value on the host (graph-safe)."""
        st, bs = self.state, self.block_size
        ids, pos, req, full, store = (buf[i * T:(i + 1) * T] for i in range(5))
        o = 5 * T
        cu = buf[o:o + C + 1].to(torch.int32)
        kv_lens, slots, rows, sslots = (buf[o + C + 1 + i * C:o + C + 1 + (i + 1) * C] for i in range(4))
        n = buf[o + 5 * C + 1]
        keep, keep_full = store.bool(), (store & full).bool()
        kv_lens = kv_lens.to(torch.int32)
        groups = {}
        for name in self.kv_cache.groups:
            bt = st.tables[name][slots]
            idx = torch.where(keep_full if name == "full" else keep, row_cache_index(bt, req, pos, bs), -1)
            groups[name] = GroupMeta(bt, idx, kv_lens, st.kv_start[slots] if name == "sliding" else None)
        ctx = PagedAttentionContext(self.kv_cache, cu, Q, groups, self.ops, tp=self.tp)
        out = self.model(ids, pos, ctx, self.capture)
        if self.drafter is not None:
            idx = row_cache_index(st.tables["draft"][slots], req, pos, bs)
            self.drafter.inject(out.captured, pos, torch.where(keep_full, idx, -1), self.draft_cache, self.ops)
        samp = st.sampling(sslots, truncates)
        nxt_pos = pos[rows] + 1
        logits = self.model.compute_logits(out.hidden[rows], self.ops)
        tok = sample_from_probs(probs_from_logits(logits, samp), samp, nxt_pos, STREAM_TARGET)
        real = torch.arange(C, device=buf.device) < n       # padding entries write nothing
        st.last_token[sslots] = torch.where(real, tok, st.last_token[sslots])
        st.seq_len[sslots] = torch.where(real, nxt_pos, st.seq_len[sslots])
        return tok, torch.isfinite(logits).all(-1).long()
