"""Triton kernels that fuse the small ops of a decoder layer (walkthrough chapter 10).

The idea
    A decode step of a small model is a long list of tiny kernels: an RMSNorm alone is seven
    element-wise launches in eager PyTorch (cast, square, mean, add, rsqrt, multiply, cast),
    and q/k-norm + RoPE + the KV store is about thirty. Each launch costs microseconds of host
    and GPU time while the work inside is nanoseconds. Three kernels cover what a layer does
    between its matrix products:

    * `add_rmsnorm(x, residual, weight, eps)` -> (normed, x + residual): the residual add of
      the previous block and the next RMSNorm in one pass over the row;
    * `qk_norm_rope_store(qkv, ...)` -> q: splits the fused q/k/v projection, applies the
      per-head RMSNorm of Qwen3 (if any) and rotate-half RoPE to q and k, writes q out and
      stores k and v into the paged KV cache at `cache_index` (negative index = do not store);
    * `silu_mul(gate_up)` -> silu(gate) * up for the SwiGLU MLP (gate and up fused in one GEMM).

    Rounding follows the PyTorch reference op by op (kernels/reference.py): every value the
    eager code rounds to the model dtype is rounded here at the same point, so the kernels
    agree with the reference to within one rounding of a float32 reduction.

Invariants
    * Rows are independent: row t of every output depends only on row t of the inputs (so a
      padding row of a CUDA-graph batch cannot disturb a real one).
    * `qk_norm_rope_store` never reads `cache_index` for a q head; a row whose cache index
      is negative writes q but stores no K/V (a padding row, or a replay row of the full group).
    * Shapes: x, residual [T, H]; qkv [T, (Hq + 2 Hkv) * D] (q heads, then k, then v);
      cos, sin [T, D]; caches [num_blocks, block_size, Hkv, D] with unit stride on D.

Tested against
    `kernels.reference.add_rmsnorm_ref`, `qk_norm_rope_store_ref`, `silu_mul_ref` in
    tests/test_fused_kernels.py (interpreter on CPU, natively on CUDA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                        stride_x, stride_r, stride_o, stride_ro,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)   # eager: x + r in dtype
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty)                                  # eager: .to(dtype)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(rmsnorm(x + residual) * weight, x + residual); with residual None, (rmsnorm(x) * weight, x)."""
    T, H = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if T:
        _add_rmsnorm_kernel[(T,)](
            x, residual if residual is not None else x, weight, out, res_out, H, eps,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), res_out.stride(0),
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(H),
            num_warps=4 if H >= 1024 else 1)
    return out, res_out


@triton.jit
def _qk_norm_rope_store_kernel(
        qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, kc_ptr, vc_ptr, index_ptr, eps,
        stride_qkv, stride_cos, stride_sin, stride_qo_t, stride_qo_h,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, QK_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)                 # 0..HQ-1: a q head; HQ..HQ+HKV-1: a k head and its v head
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    half = D // 2
    partner = tl.where(offs < half, offs + half, offs - half)     # rotate-half: x[i +- D/2]
    base = qkv_ptr + t * stride_qkv + h * D
    x = tl.load(base + offs, mask=m, other=0.0)
    xp = tl.load(base + partner, mask=m, other=0.0)
    dt = x.dtype
    if QK_NORM:
        if h >= HQ:
            w = tl.load(kw_ptr + offs, mask=m, other=0.0).to(tl.float32)
            wp = tl.load(kw_ptr + partner, mask=m, other=0.0).to(tl.float32)
        else:
            w = tl.load(qw_ptr + offs, mask=m, other=0.0).to(tl.float32)
            wp = tl.load(qw_ptr + partner, mask=m, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)     # the row and its partner share it
        x = (w * (xf * rstd).to(dt).to(tl.float32)).to(dt)
        xp = (wp * (xp.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
    rot = tl.where(offs < half, -xp.to(tl.float32), xp.to(tl.float32))
    c = tl.load(cos_ptr + t * stride_cos + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + offs, mask=m, other=0.0).to(tl.float32)
    # eager: x * cos + rotated * sin, each product and the sum rounded to the dtype
    y = ((x.to(tl.float32) * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)).to(dt)
    if h >= HQ:
        idx = tl.load(index_ptr + t)
        if idx >= 0:
            kvh = h - HQ
            blk = idx // PAGE
            off = idx % PAGE
            tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + kvh * stride_kch + offs,
                     y.to(kc_ptr.dtype.element_ty), mask=m)
            v = tl.load(qkv_ptr + t * stride_qkv + (HQ + HKV + kvh) * D + offs, mask=m, other=0.0)
            tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + kvh * stride_vch + offs,
                     v.to(vc_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(q_out_ptr + t * stride_qo_t + h * stride_qo_h + offs, y, mask=m)


def qk_norm_rope_store(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, cache_index: torch.Tensor, n_heads: int, n_kv: int,
                       head_dim: int) -> torch.Tensor:
    """q [T, Hq, D] after norm + RoPE; k (after norm + RoPE) and v stored at `cache_index`."""
    T = qkv.shape[0]
    q = torch.empty(T, n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    assert qkv.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert head_dim % 2 == 0
    norm = q_norm is not None
    _qk_norm_rope_store_kernel[(T, n_heads + n_kv)](
        qkv, q_norm if norm else qkv, k_norm if norm else qkv, cos, sin, q, k_cache, v_cache, cache_index, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=n_heads, HKV=n_kv, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=k_cache.shape[1], QK_NORM=norm, num_warps=1)
    return q


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_cols
    g = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)            # eager: F.silu rounds to the dtype
    tl.store(out_ptr + row * stride_o + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> silu(gate) * up [T, I]."""
    T, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(T, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                     BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out
