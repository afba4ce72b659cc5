"""Triton paged attention for a packed ragged batch (prefill chunks, decode, verify windows).

The idea (walkthrough chapter 03 walks through each part)
    One program computes, for one request `r`, one KV head `kvh` and one *query tile*, the
    attention output of a `BLOCK_M`-row tile of queries over that request's keys:
    1. GQA packing: the `G = Hq // Hkv` query heads that share `kvh` fill the tile's M dimension
       (row `m` = query token `m // G`, head `kvh * G + m % G`), so one K/V load feeds them all.
    2. Paging: keys are walked in `BLOCK_N` tiles through `block_tables[r, j // PAGE]`, from
       the first key any row may read (window, `kv_start`) to the last (causality); `-1`
       entries are masked off.
    3. Online softmax in base 2 (running max, denominator, fp32 accumulator); the max starts
       finite, so a row that has seen only masked keys gets weights of exactly 0 and a row
       with no key outputs zeros.
    4. Split-KV (flash-decoding): at small batch the key range is cut into `num_splits` chunks
       whose partial outputs and log-sum-exps a second kernel merges exactly; `pick_config`
       takes the fewest splits that fill whole waves of resident programs.

    CUDA-graph friendly: the grid `(q_tiles, Hkv * num_splits, B)` depends only on host ints
    (`max_q_len`, batch size, block-table width, device); per-request lengths are read in the
    kernel, and a program whose tile lies past its request's rows returns at once.

Invariants (see walkthrough/00_design.md)
    * q: [T, Hq, D]; caches [num_blocks, PAGE, Hkv, D] (unit stride on D); block_tables int32
      [B, max_blocks]; cu_seqlens_q int32 [B + 1]; kv_lens int32 [B] (including the new tokens,
      whose K/V are already stored); kv_start int32 [B] or None.
    * Row i of request r is at position p = kv_lens[r] - q_len[r] + i and reads key j iff
      j <= p, p - j < sliding_window (if > 0), j >= kv_start[r] (if given).
    * fp32 accumulation; output dtype = q.dtype; bf16 / fp16 / fp32 inputs (fp32 uses IEEE
      dot products, not tf32; the probabilities are rounded to the input dtype for the P.V
      product, as in FlashAttention). Rows that may read nothing get zeros.
    * Rows of q beyond cu_seqlens_q[B] belong to no request; their output is unspecified.

Tested against `kernels.reference.paged_attention_ref` in tests/test_kernels.py (interpreter on
CPU, natively on CUDA): ragged batches across block and window edges, GQA ratios 1/2/4/8, -1
table entries, forced split counts, NaN-poisoned outputs. Speed: `python -m nanodspark.bench kernels`.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Tests set this to fill the split-KV scratch with NaN, so an unwritten partial shows.
POISON_SCRATCH = False


# Integers that change with the batch (split count, block-table width, scratch strides) are not
# specialised on: Triton would otherwise compile a new variant whenever one of them becomes 1 or
# a multiple of 16, which shows up as a latency spike the first time a batch shape is seen.
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt", "stride_ps", "stride_ls"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, part_o_ptr, part_lse_ptr, part_cnt_ptr, part_first_ptr,
    bt_ptr, cu_q_ptr, kv_lens_ptr, kv_start_ptr,
    qk_scale, window, num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, HAS_KV_START: tl.constexpr, SPLIT: tl.constexpr,
    F32_DOT: tl.constexpr, CAUSAL: tl.constexpr, MIN_TILES: tl.constexpr, CHUNK: tl.constexpr,
):
    tile = tl.program_id(0)
    head_split = tl.program_id(1)
    r = tl.program_id(2)
    kvh = head_split // num_splits
    split = head_split % num_splits

    # ---- which query rows: tile `tile` of the request's (q_len * GROUP) packed rows ----------
    q_start = tl.load(cu_q_ptr + r)
    q_len = tl.load(cu_q_ptr + r + 1) - q_start
    row0 = tile * BLOCK_M
    if row0 >= q_len * GROUP:
        return
    kv_len = tl.load(kv_lens_ptr + r)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP                     # query token within the request
    head = kvh * GROUP + offs_m % GROUP      # query head
    row_ok = qi < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # ---- which keys: [lo, hi) covers every key some row of this tile may read -----------------
    # BEGIN STUDENT kernel key-range
    first_pos = kv_len - q_len               # position of the request's first query row
    if CAUSAL:
        pos = first_pos + qi                 # position of each row
        last_row = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
        hi = tl.minimum(kv_len, first_pos + last_row + 1)
    else:                                    # every row reads every key < kv_len
        pos = qi * 0 + kv_len - 1
        hi = kv_len
    lo = kv_len * 0
    if HAS_KV_START:
        lo = tl.load(kv_start_ptr + r)
    if USE_WINDOW:
        lo = tl.maximum(lo, first_pos + row0 // GROUP - window + 1)
    lo = tl.maximum(lo, 0)
    # END STUDENT kernel

    # ---- this program's share of the key tiles (split-KV) -------------------------------------
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    n_tiles = tl.maximum(tl.cdiv(hi - lo_tile, BLOCK_N), 0)
    # The launch has `num_splits` programs per tile (sized from shapes: graph-safe); a short
    # range uses fewer of them, at least MIN_TILES key tiles each, and the rest return at once.
    # With one split left the program writes the output itself and the merge skips the row.
    # (MIN_TILES 1 keeps a short range spread over programs: at batch 1 on the H200, two tiles
    # in one program instead of two took 7.5 us instead of 5.7, walkthrough chapter 10.)
    eff = 1
    if SPLIT:
        eff = tl.minimum(num_splits, tl.maximum(tl.cdiv(n_tiles, MIN_TILES), 1))
        if split >= eff:
            return
    per_split = tl.cdiv(n_tiles, eff)
    s_lo = lo_tile + split * per_split * BLOCK_N
    s_hi = tl.minimum(hi, s_lo + per_split * BLOCK_N)
    if CHUNK > 0:
        # The fixed schedule (batch invariance, `fixed_config`): split s of this tile walks the
        # keys of the absolute chunk c0 + s, [c * CHUNK, (c + 1) * CHUNK), c0 the chunk of the
        # tile's first key; which chunks a row's keys fall in depends on that row alone.
        c0 = lo_tile // CHUNK
        s_lo = tl.maximum(lo_tile, (c0 + split) * CHUNK)
        s_hi = tl.minimum(hi, (c0 + split + 1) * CHUNK)
        if (split > 0) & (s_lo >= s_hi):
            return

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + r.to(tl.int64) * stride_bt
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh

    # BEGIN STUDENT kernel key-tiles
    for start in range(s_lo, s_hi, BLOCK_N):
        offs_n = start + offs_n0
        in_range = (offs_n >= lo) & (offs_n < s_hi)
        page = tl.load(bt_row + offs_n // PAGE, mask=in_range, other=-1)
        key_ok = in_range & (page >= 0)                       # never dereference a -1 entry
        page = tl.where(key_ok, page, 0).to(tl.int64)
        in_page = offs_n % PAGE
        kv_mask = key_ok[:, None] & d_ok[None, :]

        k = tl.load(k_head + (page * stride_kb + in_page * stride_ks)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        allowed = key_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if USE_WINDOW:
            allowed = allowed & ((pos[:, None] - offs_n[None, :]) < window)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_head + (page * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # END STUDENT kernel

    # ---- epilogue ------------------------------------------------------------------------------
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    st_mask = row_ok[:, None] & d_ok[None, :]
    part = part_o_ptr + split * stride_ps + q_rows[:, None] * stride_pt + head[:, None] * stride_ph
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    dst = o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
    if CHUNK > 0:
        # Each row's own chunks [first, first + n) (as splits of this tile), from its own keys
        # [r_lo, pos + 1): causal rows read up to their position, the others (pos = kv_len - 1)
        # all of kv_len. One chunk: the output is written here; more: partials for the merge.
        r_lo = qi * 0
        if HAS_KV_START:
            r_lo += tl.load(kv_start_ptr + r)
        if USE_WINDOW:
            r_lo = tl.maximum(r_lo, pos - window + 1)
        r_lo = tl.maximum(r_lo, 0)
        n_chunks = tl.where(pos + 1 > r_lo, pos // CHUNK - r_lo // CHUNK + 1, 0)
        first = r_lo // CHUNK - c0
        sp = qi * 0 + split                      # per row (the interpreter mis-types scalar & vector masks)
        mine = row_ok & (sp >= first) & (sp < first + n_chunks)
        # one record per row: by its first chunk's program (split 0 for a row with no key)
        writer = row_ok & (((n_chunks > 0) & (sp == first)) | ((n_chunks == 0) & (sp == 0)))
        tl.store(part_cnt_ptr + q_rows * stride_lt + head, n_chunks, mask=writer)
        tl.store(part_first_ptr + q_rows * stride_lt + head, first, mask=writer)
        direct = (mine & (n_chunks == 1)) | (writer & (n_chunks == 0))         # no key: zeros
        tl.store(dst + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=direct[:, None] & d_ok[None, :])
        many = mine & (n_chunks > 1)
        tl.store(part + offs_d[None, :], out, mask=many[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=many)
    else:
        if SPLIT:
            if split == 0:                       # how many partials the merge must combine
                tl.store(part_cnt_ptr + q_rows * stride_lt + head, eff + qi * 0, mask=row_ok)
        if eff > 1:
            tl.store(part + offs_d[None, :], out, mask=st_mask)
            tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)
        else:
            tl.store(dst + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=st_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ls"])
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, part_cnt_ptr, o_ptr, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    cnt = tl.load(part_cnt_ptr + t * stride_lt + h)
    if cnt <= 1:                             # one split: the attention program wrote the row
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < tl.minimum(cnt, num_splits)
    d_ok = offs_d < HEAD_DIM
    # BEGIN STUDENT kernel merge
    lse = tl.load(part_lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)     # every split empty: all weights 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    part = tl.load(part_o_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph
                   + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    # An empty split has w = 0 and a written zero partial, so no 0 * garbage here.
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=d_ok)
    # END STUDENT kernel


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ls"])
def _merge_chunks_kernel(
    part_o_ptr, part_lse_ptr, part_cnt_ptr, part_first_ptr, o_ptr, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The fixed schedule's merge: a row's chunk partials combined left to right (the same
    order whatever the batch), o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    cnt = tl.load(part_cnt_ptr + t * stride_lt + h)
    if cnt <= 1:                             # written by the attention program
        return
    # a padding row (no request) has no record: whatever is there, stay inside the scratch
    cnt = tl.minimum(cnt, num_splits)
    first = tl.minimum(tl.maximum(tl.load(part_first_ptr + t * stride_lt + h), 0), num_splits - cnt)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse_row = part_lse_ptr + t * stride_lt + h
    part_row = part_o_ptr + t * stride_pt + h * stride_ph + offs_d
    # BEGIN STUDENT kernel merge-chunks
    m = tl.load(lse_row + first * stride_ls)
    for i in range(1, cnt):
        m = tl.maximum(m, tl.load(lse_row + (first + i) * stride_ls))
    m = tl.where(m == float("-inf"), 0.0, m)     # every chunk empty (-1 pages): all weights 0
    w = tl.exp2(tl.load(lse_row + first * stride_ls) - m)
    total = w
    acc = w * tl.load(part_row + first * stride_ps, mask=d_ok, other=0.0)
    for i in range(1, cnt):
        w = tl.exp2(tl.load(lse_row + (first + i) * stride_ls) - m)
        total += w
        acc += w * tl.load(part_row + (first + i) * stride_ps, mask=d_ok, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)
    # END STUDENT kernel


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of `paged_attention`; `pick_config` chooses them from shapes."""
    block_m: int
    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2
    chunk: int = 0           # > 0: the fixed split schedule, keys cut every `chunk` positions


def _interpreting() -> bool:
    # The Triton interpreter (CPU tests) computes bf16 dot products wrongly (seen with Triton
    # 3.6 and 3.9): under it, bf16 dot operands are upcast to fp32 (the GPU path is unchanged).
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Measured on an H200 (bench kernels sweep, walkthrough/03_kernels.md): the decode/verify tile
# (BLOCK_N 128, 4 warps, 2 stages) compiles to 168-228 registers per thread, so two programs stay
# resident per SM; a launch of fewer programs than that leaves SMs idle, a launch that spills a
# little past a whole number of waves leaves them idle in the last wave.
PROGRAMS_PER_SM = 2
MIN_WAVE_EFFICIENCY = 0.9    # accept a split count once this share of the last wave is busy
MIN_TILES_PER_SPLIT = 2      # a split shorter than this costs more in merge than it gains
MAX_SPLITS = 64


def wave_efficiency(programs: int, slots: int) -> float:
    """Share of the launched waves' program slots that hold a program."""
    return programs / (triton.cdiv(programs, slots) * slots)


def choose_num_splits(programs: int, kv_tiles: int, sms: int) -> int:
    """Fewest KV splits whose programs fill the GPU's waves to >= MIN_WAVE_EFFICIENCY.

    Each extra split adds a partial output to write and merge, so fewer splits are better
    whenever the waves are (nearly) full; if no count reaches the bar, the fullest one wins."""
    slots = PROGRAMS_PER_SM * sms
    cap = max(1, min(MAX_SPLITS, kv_tiles // MIN_TILES_PER_SPLIT))
    best, best_eff = 1, 0.0
    for s in range(1, cap + 1):
        eff = wave_efficiency(programs * s, slots)
        if eff >= MIN_WAVE_EFFICIENCY:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def pick_config(*, batch: int, num_kv_heads: int, group: int, head_dim: int, max_q_len: int,
                max_kv_len: int, dtype: torch.dtype, device: torch.device) -> AttentionConfig:
    """Tile sizes and split count from host-known shapes only (never from device data).

    * block_m: the packed rows (max_q_len * group) rounded up to a power of two, in [16, 64].
    * block_n: 128 keys per step for decode/verify tiles (block_m <= 32) with 2 pipeline
      stages, the fastest configuration of the H200 sweep at every goal shape; 64 keys with 3
      stages for prefill tiles (block_m 64, registers); 32 for fp32 or head_dim > 128.
    * num_splits: `choose_num_splits` (whole waves of PROGRAMS_PER_SM programs per SM).
    """
    rows = max(1, max_q_len) * group
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if dtype == torch.float32 or head_dim > 128:
        block_n, num_stages = 32, 2
    elif block_m <= 32:
        block_n, num_stages = 128, 2
    else:
        block_n, num_stages = 64, (3 if device.type == "cuda" else 2)
    q_tiles = triton.cdiv(rows, block_m)
    programs = batch * num_kv_heads * q_tiles
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    kv_tiles = triton.cdiv(max(1, max_kv_len), block_n)
    num_splits = choose_num_splits(programs, kv_tiles, sms)
    return AttentionConfig(block_m=block_m, block_n=block_n, num_splits=num_splits,
                           num_warps=4, num_stages=num_stages)


# The fixed schedule of batch-invariant attention (kernels/batch_invariant.py): one tile shape for
# every batch, and keys split on an absolute grid of FIXED_CHUNK positions.
FIXED_CHUNK = 256


def fixed_config(dtype: torch.dtype, head_dim: int, chunk: int | None = None) -> AttentionConfig:
    """The launch configuration of the fixed schedule: it depends on the dtype and head size
    only (never on the batch, q_len or context); the split count follows at launch from the
    shapes (`chunk_splits`). `chunk` must be a multiple of the tile's keys."""
    chunk = chunk or FIXED_CHUNK
    block_n = 32 if dtype == torch.float32 or head_dim > 128 else 64
    assert chunk % block_n == 0, f"chunk {chunk} must be a multiple of {block_n} keys"
    return AttentionConfig(block_m=32, block_n=block_n, num_splits=0, num_warps=4, num_stages=2, chunk=chunk)


def chunk_splits(chunk: int, block_n: int, max_kv: int, window: int, max_q_len: int) -> int:
    """Splits per tile under the fixed schedule: the most chunks one tile's keys can span
    (host shapes only, so graph-safe). A full layer's tile reads at most max_kv keys from 0;
    a sliding one fewer than window + max_q_len, starting up to block_n - 1 keys into a tile."""
    n = triton.cdiv(max(1, max_kv), chunk)
    if window > 0:
        n = min(n, (window + max_q_len + block_n) // chunk + 2)
    return max(1, n)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                    *, scale: float, sliding_window: int = 0, kv_start: torch.Tensor | None = None,
                    max_q_len: int | None = None, out: torch.Tensor | None = None,
                    config: AttentionConfig | None = None, stats: dict | None = None,
                    causal: bool = True) -> torch.Tensor:
    """Attention of a packed ragged batch over a paged KV cache; returns o [T, Hq, D].

    Semantics: walkthrough/00_design.md (and `kernels.reference.paged_attention_ref`).
    `max_q_len` (host int) sizes the grid; if None it is read from `cu_seqlens_q` (one
    device-to-host sync). `out` may be passed (e.g. a CUDA-graph buffer). `config` overrides
    the tile sizes / split count that `pick_config` would choose. If `stats` is a dict, the
    compiled kernel's registers per thread, spilled registers and shared memory are put in it
    (the benchmark's configuration sweep records them). `causal=False`: every row of a request
    reads all its keys below `kv_lens` (the drafter's bidirectional block; no window)."""
    T, Hq, D = q.shape
    B = cu_seqlens_q.shape[0] - 1
    PAGE, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    assert block_tables.dtype == torch.int32 and cu_seqlens_q.dtype == torch.int32
    assert kv_lens.dtype == torch.int32
    G = Hq // Hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    max_q_len = max(1, max_q_len)

    if config is None:
        max_kv = block_tables.shape[1] * PAGE
        if sliding_window > 0:
            max_kv = min(max_kv, sliding_window + max_q_len)
        config = pick_config(batch=B, num_kv_heads=Hkv, group=G, head_dim=D, max_q_len=max_q_len,
                             max_kv_len=max_kv, dtype=q.dtype, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    q_tiles = triton.cdiv(max_q_len * G, config.block_m)
    chunk = config.chunk
    S = chunk_splits(chunk, config.block_n, block_tables.shape[1] * PAGE, sliding_window, max_q_len) \
        if chunk else config.num_splits
    split = S > 1 or chunk > 0                     # scratch and a merge (the fixed schedule: always)
    if split:
        part_o = torch.empty((S, T, Hq, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((S, T, Hq), dtype=torch.float32, device=q.device)
        # rows of no request (padding) get no count from the attention kernel; their output is
        # unspecified (contract), so their count may be anything: no fill kernel for it
        part_cnt = torch.empty((T, Hq), dtype=torch.int32, device=q.device)
        part_first = torch.empty((T, Hq), dtype=torch.int32, device=q.device) if chunk else part_cnt
        if POISON_SCRATCH:
            part_o.fill_(float("nan"))
            part_lse.fill_(float("nan"))
    else:
        part_o = part_lse = part_cnt = part_first = out   # unused (SPLIT=False); any tensor will do
    kv_start_arg = kv_start if kv_start is not None else kv_lens   # unused when HAS_KV_START=False

    grid = (q_tiles, Hkv * S, B)
    compiled = _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse, part_cnt, part_first,
        block_tables, cu_seqlens_q, kv_lens, kv_start_arg,
        scale * LOG2E, int(sliding_window), S,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        part_o.stride(0) if split else 0, part_o.stride(1) if split else 0,
        part_o.stride(2) if split else 0,
        part_lse.stride(0) if split else 0, part_lse.stride(1) if split else 0,
        HEAD_DIM=D, BLOCK_D=BLOCK_D, GROUP=G, PAGE=PAGE,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        USE_WINDOW=sliding_window > 0, HAS_KV_START=kv_start is not None, SPLIT=split and not chunk,
        F32_DOT=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreting()),
        CAUSAL=causal, MIN_TILES=1, CHUNK=chunk, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if stats is not None:
        meta = getattr(compiled, "metadata", None)       # Triton keeps `shared` there in 3.x
        stats.update({k: getattr(compiled, k, None) if getattr(compiled, k, None) is not None
                      else getattr(meta, k, None) for k in ("n_regs", "n_spills", "shared")})
    if chunk:
        _merge_chunks_kernel[(T, Hq)](
            part_o, part_lse, part_cnt, part_first, out, S,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), HEAD_DIM=D, BLOCK_D=BLOCK_D, num_warps=4 if BLOCK_D >= 128 else 1)
    elif split:
        _merge_splits_kernel[(T, Hq)](
            part_o, part_lse, part_cnt, out, S,
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_S=max(2, triton.next_power_of_2(S)),
            num_warps=4 if BLOCK_D >= 128 else 1,
        )
    return out
