"""Triton grouped mixture-of-experts FFN that never syncs with the host (CUDA-graph safe).

The idea
    The eager MoE (nanodspark/model.py, `torch_experts`) groups the (token, expert) pairs by
    expert and loops over the experts on the host, which needs the count of each expert on the
    host: one device->host sync per MoE layer, and no CUDA graph can hold that. Here the
    grouping happens on the device and one launch covers every expert:

    1. `align_pairs` sorts the `T * top_k` (token, slot) pairs by expert and lays them out in
       blocks of `BLOCK_M` rows, every block holding pairs of one expert only (each expert's
       run is padded up to a multiple of `BLOCK_M` with a sentinel). The number of blocks is
       at most `ceil(T * top_k / BLOCK_M) + E`, a bound known on the host from shapes alone, so
       the grid never depends on the routing. `block_expert[b]` names the expert of block `b`
       (-1 past the last used block: that program returns at once).
    2. `_gate_up_kernel`: per block and column tile, `silu(x W_gate^T) * (x W_up^T)` for the
       block's tokens with the block's expert weights (two accumulators over one read of x).
    3. `_down_kernel`: per block and column tile, `h W_down^T`, times the pair's routing weight.
    4. The `top_k` rows of each token are summed in a fixed order (deterministic, no atomics).

    Rounding follows the eager reference: each GEMM's output, silu, the product and the
    weighting are rounded to the model dtype where the eager code rounds them.

Invariants
    * x [T, H]; ids [T, top_k] (int, values in [0, E)); weights [T, top_k] (x's dtype);
      w_gate, w_up [E, I, H]; w_down [E, H, I]; all with unit stride on the last dimension.
    * Every pair is computed exactly once; a sentinel row is never loaded or stored.
    * The result does not depend on how the pairs of one expert are ordered, nor on the other
      tokens of the batch (rows are independent), up to float32 accumulation order.

Tested against
    `nanodspark.model.torch_experts` in tests/test_fused_kernels.py (interpreter on CPU, natively
    on CUDA), with skewed routings (all pairs on one expert, experts with no pair).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    # The Triton interpreter computes bf16 dot products wrongly (kernels/paged_attention.py).
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the blocks `align_pairs` uses: sum_e ceil(c_e / BM) <= ceil(P / BM) + E."""
    return triton.cdiv(num_pairs, block_m) + num_experts


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair index per padded row [NB * BM] (sentinel = num_pairs), expert per block [NB] (-1 = unused)).

    Plain torch ops of fixed shapes, no host sync: safe inside a CUDA graph."""
    flat = ids.reshape(-1).long()
    P, dev = flat.numel(), flat.device
    nb = max_blocks(P, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts              # first sorted pair of expert e
    pad_start = torch.cumsum(padded, 0) - padded          # first padded row of expert e
    order = torch.sort(flat, stable=True).indices         # pairs grouped by expert
    e_sorted = flat[order]
    dest = pad_start[e_sorted] + torch.arange(P, device=dev) - start[e_sorted]
    rows = torch.full((nb * block_m,), P, dtype=torch.int32, device=dev)
    rows.scatter_(0, dest, order.to(torch.int32))
    block_end = torch.cumsum(padded // block_m, 0)        # blocks used by experts 0..e
    block_expert = torch.searchsorted(block_end, torch.arange(nb, device=dev), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


@triton.jit
def _align_kernel(ids_ptr, rows_ptr, bexp_ptr, P, NB, E: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """`align_pairs` in one program (two passes over the pairs): the same layout, in the same
    (stable) order, in one launch instead of a dozen small ones."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = tl.arange(0, BLOCK_P)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, P, BLOCK_P):
        e = tl.load(ids_ptr + p0 + offs_p, mask=p0 + offs_p < P, other=-1)
        counts += tl.sum((e[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    cursor = tl.cumsum(padded, axis=0) - padded              # first padded row of each expert
    block_end = tl.cumsum(padded // BLOCK_M, axis=0)         # blocks used by experts 0..e
    offs_b = tl.arange(0, BLOCK_B)
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + offs_b
        owner = tl.sum(((block_end[None, :] <= b[:, None]) & (offs_e[None, :] < E)).to(tl.int32), axis=1)
        tl.store(bexp_ptr + b, tl.where(owner < E, owner, -1), mask=b < NB)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + offs_p
        e = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hot = (e[:, None] == offs_e[None, :]).to(tl.int32)
        rank = tl.cumsum(hot, axis=0) - hot                  # earlier pairs of the same expert here
        dest = tl.sum(hot * (cursor[None, :] + rank), axis=1)
        tl.store(rows_ptr + dest, p, mask=p < P)
        cursor += tl.sum(hot, axis=0)


def align_pairs_fused(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` as one Triton kernel (plus the sentinel fill)."""
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    P, nb = flat.numel(), max_blocks(flat.numel(), num_experts, block_m)
    rows = torch.full((nb * block_m,), P, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](flat, rows, block_expert, P, nb, E=num_experts, BLOCK_M=block_m, BLOCK_P=64,
                        BLOCK_E=max(16, triton.next_power_of_2(num_experts)), BLOCK_B=64, num_warps=4)
    return rows, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, rows_ptr, bexp_ptr,
                    num_pairs, H, I, stride_x, stride_we, stride_wn, stride_h,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(bexp_ptr + pid_m)
    if e < 0:
        return
    pair = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_base = e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + offs_k) < H
        a = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(wg_ptr + w_base + (k0 + offs_k)[:, None], mask=w_mask, other=0.0)   # [K, N]
        wu = tl.load(wu_ptr + w_base + (k0 + offs_k)[:, None], mask=w_mask, other=0.0)
        if F32_DOT:
            acc_g += tl.dot(a.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
            acc_u += tl.dot(a.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
        else:
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(h_ptr + pair.to(tl.int64)[:, None] * stride_h + offs_n[None, :], (s * u).to(dt),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, wd_ptr, rw_ptr, out_ptr, rows_ptr, bexp_ptr,
                 num_pairs, H, I, stride_h, stride_we, stride_wn, stride_o,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 F32_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(bexp_ptr + pid_m)
    if e < 0:
        return
    pair = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    p64 = tl.where(valid, pair, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_base = e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = (k0 + offs_k) < I
        a = tl.load(h_ptr + p64[:, None] * stride_h + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(wd_ptr + w_base + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if F32_DOT:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    dt = out_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + p64, mask=valid, other=0.0).to(tl.float32)
    y = (acc.to(dt).to(tl.float32) * rw[:, None]).to(dt)
    tl.store(out_ptr + p64[:, None] * stride_o + offs_n[None, :], y, mask=valid[:, None] & n_ok[None, :])


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t; returns [T, H]."""
    T, H = x.shape
    top_k = ids.shape[1]
    E, I = w_gate.shape[0], w_gate.shape[1]
    P = T * top_k
    if T == 0:
        return torch.zeros_like(x)
    assert w_gate.stride(-1) == w_up.stride(-1) == w_down.stride(-1) == 1 and x.stride(-1) == 1
    block_m = block_m or (16 if P <= 1024 else 64)
    rows, block_expert = align_pairs_fused(ids, E, block_m)
    nb = block_expert.shape[0]
    f32 = x.dtype == torch.float32 or _interpreting()
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    bn, bk = 64, 64
    _gate_up_kernel[(nb, triton.cdiv(I, bn))](
        x, w_gate, w_up, h, rows, block_expert, P, H, I, x.stride(0), w_gate.stride(0), w_gate.stride(1),
        h.stride(0), TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=f32, num_warps=4)
    out_pairs = torch.empty(P, H, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1).to(x.dtype).contiguous()
    _down_kernel[(nb, triton.cdiv(H, bn))](
        h, w_down, rw, out_pairs, rows, block_expert, P, H, I, h.stride(0), w_down.stride(0), w_down.stride(1),
        out_pairs.stride(0), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=f32, num_warps=4)
    return out_pairs.view(T, top_k, H).float().sum(1).to(x.dtype)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    z = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    e = tl.exp(z - tl.max(z, 0))
    p = tl.where(ok, e / tl.sum(e, 0), -1.0)
    total = 0.0
    for j in tl.static_range(TOP_K):         # k times: the largest left (lowest index on ties)
        m = tl.max(p, 0)
        idx = tl.min(tl.where(p == m, offs, BLOCK_E), 0)
        idx = tl.minimum(idx, E - 1)         # a row of NaNs (a padding row's garbage) still names an expert
        tl.store(ids_ptr + t * TOP_K + j, idx.to(tl.int64))
        tl.store(w_ptr + t * TOP_K + j, m)
        total += m
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        for j in tl.static_range(TOP_K):
            w = tl.load(w_ptr + t * TOP_K + j)
            tl.store(w_ptr + t * TOP_K + j, w / total)


def route_topk(logits: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over experts (fp32), the top-k weights and ids, optionally renormalised to sum 1:
    the router of model.MoE.route in one launch. weights fp32 [T, k], ids int64 [T, k]."""
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, w, ids, E, logits.stride(0), TOP_K=top_k, RENORM=renorm,
                            BLOCK_E=max(16, triton.next_power_of_2(E)), num_warps=1)
    return w, ids
