"""Plain-PyTorch reference for the two KV kernels: `store_kv_ref` and `paged_attention_ref`.

The idea
    These functions *define* what the Triton kernels compute (contract: walkthrough/00_design.md,
    section "Kernels"), in the most direct PyTorch we could write while staying usable as the
    CPU engine's attention path:

    * `store_kv_ref` scatters each new token's K/V row at its cache index
      (`index = block * block_size + offset`); a negative index means "do not store".
    * `paged_attention_ref` walks the requests of a packed ragged batch one by one. For request
      `r` it gathers only the cache blocks that some of its query rows may read (through its
      block table), lays them out densely, builds the mask (causal, sliding window, `kv_start`)
      and runs an ordinary softmax attention in float32, grouped-query style (query head `h`
      reads KV head `h // (Hq // Hkv)`), vectorised over heads and rows.

Invariants
    * Row `i` of request `r` sits at position `p = kv_lens[r] - q_len[r] + i` and attends key `j`
      iff `j <= p`, `p - j < sliding_window` (when `sliding_window > 0`) and `j >= kv_start[r]`
      (when given).
    * Block-table entries of blocks that no row may read (wholly outside the window, wholly
      before `kv_start`) may be `-1`; they are never dereferenced: the gather starts at the
      first block a row may read, and any `-1` that still shows up is clamped to block 0 for the
      gather and masked out of the softmax.
    * A row that may read no key at all gets an output of zeros (never NaN); the Triton kernel
      does the same.
    * Accumulation is float32; the result has `q.dtype`.
    * Rows of `q` beyond `cu_seqlens_q[-1]` (padding) belong to no request and are left as
      they are in `out` (uninitialised when `out` is not passed).

Tested against
    tests/test_kernels.py checks this file against a naive dense attention (torch SDPA in
    float64 over the K/V gathered token by token, with an explicit boolean mask), and the
    Triton kernels against this file.
"""
from __future__ import annotations

import torch

# Bound on the float32 score tensor of one query chunk (elements), to keep long prefills on
# the CPU from allocating [Hq, q_len, kv_len] all at once.
_MAX_SCORE_ELEMS = 1 << 24


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache_index: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; cache_index: int [T].

    Writes k[t] / v[t] at `cache_index[t]`; negative indices are skipped. In place."""
    block_size = k_cache.shape[1]
    keep = cache_index >= 0
    idx = cache_index[keep].long()
    blocks, offsets = idx // block_size, idx % block_size
    # Two-index advanced assignment writes in place whatever the caches' strides are.
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        kv_lens: torch.Tensor, *, scale: float, sliding_window: int = 0,
                        kv_start: torch.Tensor | None = None, max_q_len: int | None = None,
                        out: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """Attention of a packed ragged batch over a paged KV cache. Returns o [T, Hq, D].

    See the module docstring and walkthrough/00_design.md for the exact semantics.
    `max_q_len` is accepted for interface parity with the Triton kernel and ignored.
    `causal=False`: every row of a request reads all its keys below `kv_lens` (no window)."""
    del max_q_len
    T, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    starts = kv_start.tolist() if kv_start is not None else None
    dev = q.device

    for r in range(len(cu) - 1):
        q0, q1 = cu[r], cu[r + 1]
        L = q1 - q0
        if L <= 0:
            continue
        kv_len = lens[r]
        first = kv_len - L                       # position of the request's first query row
        lo = starts[r] if starts is not None else 0
        if sliding_window > 0:
            lo = max(lo, first - sliding_window + 1)
        lo = max(lo, 0)
        hi = kv_len
        if hi <= lo:                             # no row may read anything
            out[q0:q1] = 0
            continue

        # Gather the blocks covering keys [lo, hi) into a dense [S, Hkv, D] slab.
        b0, b1 = lo // block_size, (hi - 1) // block_size + 1
        pages = block_tables[r, b0:b1].long()
        present = (pages >= 0).repeat_interleave(block_size)
        safe = pages.clamp_min(0)
        cut = slice(lo - b0 * block_size, hi - b0 * block_size)
        k = k_cache[safe].reshape(-1, Hkv, D)[cut].float()
        v = v_cache[safe].reshape(-1, Hkv, D)[cut].float()
        present = present[cut]
        key_pos = torch.arange(lo, hi, device=dev)

        # Query rows in chunks so the score tensor stays bounded.
        chunk = max(1, _MAX_SCORE_ELEMS // max(1, Hq * (hi - lo)))
        for c0 in range(0, L, chunk):
            c1 = min(L, c0 + chunk)
            pos = (torch.arange(first + c0, first + c1, device=dev) if causal   # [l]
                   else torch.full((c1 - c0,), kv_len - 1, device=dev))
            mask = (key_pos[None, :] <= pos[:, None]) & present[None, :]   # [l, S]
            if sliding_window > 0:
                mask &= (pos[:, None] - key_pos[None, :]) < sliding_window
            qf = q[q0 + c0:q0 + c1].float().view(c1 - c0, Hkv, G, D)
            s = torch.einsum("lkgd,skd->kgls", qf, k) * scale             # [Hkv, G, l, S]
            s = s.masked_fill(~mask, float("-inf"))
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))     # fully masked rows
            p = torch.exp(s - m)
            denom = p.sum(dim=-1, keepdim=True)
            p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
            o = torch.einsum("kgls,skd->lkgd", p, v)                       # [l, Hkv, G, D]
            out[q0 + c0:q0 + c1] = o.reshape(c1 - c0, Hq, D).to(out.dtype)
    return out


def paged_attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            kv_lens: torch.Tensor, *, scale: float, sliding_window: int = 0,
                            kv_start: torch.Tensor | None = None, max_q_len: int | None = None,
                            out: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """`paged_attention_ref`'s result computed for every request at once: the requests padded
    to the longest query run and key span, one masked softmax. The CPU engine's path, since a
    loop per request costs Python per request (a decode step of 1,024 requests made 1,024
    attention calls per layer). Falls back to the loop when the padded scores would be large
    (a long prefill), where the loop's per-request cost is nothing beside the work."""
    T, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G, R, dev = Hq // Hkv, cu_seqlens_q.shape[0] - 1, q.device
    cu = cu_seqlens_q.long()
    q_lens, lens = cu[1:] - cu[:-1], kv_lens.long()
    first = lens - q_lens
    lo = kv_start.long().clone() if kv_start is not None else torch.zeros_like(lens)
    if sliding_window > 0:
        lo = torch.maximum(lo, first - sliding_window + 1)
    lo = lo.clamp(min=0)
    Lq, S = int(q_lens.max()) if R else 0, int((lens - lo).clamp(min=0).max()) if R else 0
    if out is None:
        out = torch.empty_like(q)
    if R == 0 or Lq == 0:
        return out
    if R * Hq * Lq * max(S, 1) > _MAX_SCORE_ELEMS:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, scale=scale,
                                   sliding_window=sliding_window, kv_start=kv_start, out=out, causal=causal)
    S = max(S, 1)
    key_pos = lo[:, None] + torch.arange(S, device=dev)[None, :]                  # [R, S]
    col = (key_pos // block_size).clamp(max=block_tables.shape[1] - 1)
    pages = block_tables.long().gather(1, col)
    present = (pages >= 0) & (key_pos < lens[:, None])
    idx = pages.clamp(min=0) * block_size + key_pos % block_size
    keep = present[:, :, None, None]                  # a padded key may hold anything (NaN): zero it
    k = torch.where(keep, k_cache.reshape(-1, Hkv, D)[idx].float(), 0.0)       # [R, S, Hkv, D]
    v = torch.where(keep, v_cache.reshape(-1, Hkv, D)[idx].float(), 0.0)
    i = torch.arange(Lq, device=dev)
    row_ok = i[None, :] < q_lens[:, None]                                          # [R, Lq]
    rows = (cu[:-1, None] + i[None, :]).clamp(max=max(T - 1, 0))
    qf = q[rows].float().view(R, Lq, Hkv, G, D)
    pos = first[:, None] + i[None, :] if causal else (lens - 1)[:, None].expand(R, Lq)
    mask = (key_pos[:, None, :] <= pos[:, :, None]) & present[:, None, :]         # [R, Lq, S]
    if sliding_window > 0:
        mask &= (pos[:, :, None] - key_pos[:, None, :]) < sliding_window
    s = torch.einsum("rlkgd,rskd->rkgls", qf, k) * scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    o = torch.einsum("rkgls,rskd->rlkgd", p, v).reshape(R, Lq, Hq, D)
    out[rows[row_ok]] = o[row_ok].to(out.dtype)
    return out
