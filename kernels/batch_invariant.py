"""Batch-invariant kernels: a row's numbers do not depend on the rows beside it.

The idea
    Floating-point addition is not associative, so a sum's value depends on the order of its
    terms. A GEMM library chooses its algorithm (tile shape, split-K, which tensor-core
    instruction) by the shape of the call, and the shape is the batch: the same row multiplied
    as one of 6 rows and as one of 1536 is summed in different orders and can come out one
    rounding apart. That is enough to flip a sampled token (a near tie under Gumbel noise),
    after which two runs of one request diverge. Here every reduction a row goes through has
    an order fixed by the *weights' shape* alone:

    * `linear(x, w, b)`: a Triton matmul with one launch configuration for every M (tile
      BLOCK_M x BLOCK_N, the K loop in BLOCK_K steps from 0 up, no split-K): output (m, n)
      is the same sequence of tensor-core steps whatever M is and wherever row m lands in
      its tile. `linear_ref` is the PyTorch version: one library call per row, every call
      of shape [1, K], so the library sees the same problem whatever the batch.
    * `experts(...)`: the fused MoE of kernels/moe.py with a fixed pair-block size and the
      `top_k` expert outputs of a token added in the router's order (`experts_ref`: per pair).
    * attention: kernels/paged_attention.py with `fixed_config`, which cuts each row's keys on
      an absolute grid of `chunk` positions (split s holds keys [s*chunk, (s+1)*chunk)) and
      merges a row's chunks left to right; which chunks a row has follows from its own
      position, window and `kv_start`, never from the batch, its q_len or the tile it shares.
      `attention_ref` computes each row alone, over exactly its own keys.
    * RMSNorm, q/k-norm + RoPE, SiLU: one program per row already (kernels/fused.py); routing:
      `route_topk_ref` (softmax and top-k per row) for the PyTorch path.

Invariants
    * For each function here, row t of the output is a function of row t of the input (and
      of the weights, the cache and row t's own position, window and kv_start) — bit for bit,
      for any number of rows, any rows beside it, padding rows, and any split of a prompt
      into chunks or a decode into verify windows.
    * Values agree with the library path (F.linear, torch_experts, paged_attention_ref) to
      within float32 accumulation order; only the order is fixed, not improved.
    * Batch invariance holds on one device with one software stack: another GPU, another
      Triton or another torch may choose other instructions and give other (fixed) numbers.

Tested against: tests/test_batch_invariance.py (bit-identical rows across batch compositions,
padding and chunking; equal to the library path within tolerance).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# One configuration for every M (see the module docstring): changing any of these changes the
# numbers (every row's, the same way), never their independence from the batch.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


def _interpreting() -> bool:
    # The interpreter computes bf16 dot products wrongly (kernels/paged_attention.py): upcast.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# M is the batch: never specialised on, so M = 1 and M = 16 run the same compiled kernel.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):             # the one reduction order: K tiles from 0 up
        kk = k + offs_k
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if F32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K].T (+ b): fp32 accumulation in a fixed K order, rounded once."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    M, N = x2.shape[0], w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _matmul_kernel[grid](x2, w, b if b is not None else w, out, M, N, K, x2.stride(0), w.stride(0),
                             out.stride(0), HAS_BIAS=b is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             BLOCK_K=BLOCK_K, F32_DOT=x.dtype == torch.float32 or _interpreting(),
                             num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out.view(*lead, N)


def linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch path: each row alone through the library, as a fresh [1, K] tensor (the
    same shape and alignment whatever the batch, so the library takes the same algorithm)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for i in range(x2.shape[0]):
        out[i] = F.linear(x2[i:i + 1].clone(), w, b)[0]
    return out.view(*lead, w.shape[0])


# ----------------------------------------------------------------------------- mixture of experts
MOE_BLOCK_M = 16       # pair rows per block of the fused MoE, for every batch


def sum_in_order(pairs: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H]: the k terms of each token added left to right in fp32 (a library
    reduction over k may change its order with T), rounded once."""
    acc = pairs[:, 0].float()
    for j in range(1, pairs.shape[1]):
        acc = acc + pairs[:, j].float()
    return acc.to(pairs.dtype)


def experts(x, ids, weights, w_gate, w_up, w_down) -> torch.Tensor:
    """kernels.moe.fused_moe with a fixed block size and a fixed order over a token's experts."""
    from .moe import fused_moe
    return fused_moe(x, ids, weights, w_gate, w_up, w_down, block_m=MOE_BLOCK_M, reduce=sum_in_order)


def experts_ref(x, ids, weights, w_gate, w_up, w_down) -> torch.Tensor:
    """model.torch_experts' semantics, each (token, expert) pair alone: out[t] = sum_j w[t,j] *
    expert_{ids[t,j]}(x[t]), the j in the router's order."""
    T, k = ids.shape
    ids_h = ids.tolist()
    pairs = torch.empty(T, k, x.shape[1], dtype=x.dtype, device=x.device)
    for t in range(T):
        xt = x[t:t + 1]
        for j in range(k):
            e = ids_h[t][j]
            h = F.silu(linear_ref(xt, w_gate[e])) * linear_ref(xt, w_up[e])
            pairs[t, j] = (linear_ref(h, w_down[e]) * weights[t, j])[0]
    return sum_in_order(pairs)


def route_topk_ref(logits: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """model.MoE.route's rule on router logits (softmax in fp32, top-k, optional renorm), as
    kernels.moe.route_topk returns it: (weights fp32 [T, k], ids int64 [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


# ----------------------------------------------------------------------------- attention
def attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, **kw) -> torch.Tensor:
    """kernels.paged_attention with the fixed split schedule (paged_attention.fixed_config)."""
    from .paged_attention import fixed_config, paged_attention
    return paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens,
                           config=fixed_config(q.dtype, q.shape[-1]), **kw)


def attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, *, scale, sliding_window=0,
                  kv_start=None, max_q_len=None, out=None, causal=True) -> torch.Tensor:
    """kernels.reference.paged_attention_ref's semantics, each query row alone: row i of request
    r, at position p, reads exactly its own keys [lo, p + 1) (causal) or [lo, kv_len) (lo from
    kv_start and the window), so every reduction has that row's length, whatever the batch."""
    del max_q_len
    out = torch.empty_like(q) if out is None else out
    T, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    cu, lens = cu_seqlens_q.tolist(), kv_lens.tolist()
    starts = kv_start.tolist() if kv_start is not None else None
    for r in range(len(cu) - 1):
        q_len = cu[r + 1] - cu[r]
        for i in range(q_len):
            t = cu[r] + i
            pos = lens[r] - q_len + i if causal else lens[r] - 1
            lo = max(starts[r] if starts is not None else 0, pos - sliding_window + 1 if sliding_window else 0, 0)
            if pos + 1 <= lo:
                out[t] = 0
                continue
            b0, b1 = lo // page, pos // page + 1
            pages = block_tables[r, b0:b1].long()
            cut = slice(lo - b0 * page, pos + 1 - b0 * page)
            present = (pages >= 0).repeat_interleave(page)[cut]      # -1 pages: masked, never read
            k = k_cache[pages.clamp_min(0)].reshape(-1, Hkv, D)[cut].float()
            v = v_cache[pages.clamp_min(0)].reshape(-1, Hkv, D)[cut].float()
            qf = q[t].float().view(Hkv, Hq // Hkv, D)
            s = torch.bmm(qf, k.permute(1, 2, 0)) * scale            # [Hkv, G, keys]
            s = s.masked_fill(~present, float("-inf"))
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
            denom = p.sum(-1, keepdim=True)
            p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
            out[t] = torch.bmm(p, v.permute(1, 0, 2)).reshape(Hq, D).to(out.dtype)
    return out
