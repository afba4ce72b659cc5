"""Triton skinny GEMM: `x @ w.T (+ b)` for the few rows of a decode step (M <= 16).

The idea
    At batch 1 a decode step multiplies one row (or 1 + gamma rows) by every weight matrix of the
    model: the work is reading the weights, and a GEMM library's kernels for such shapes leave
    much of the memory bandwidth unused (measured on the H200: about 1 TB/s of 4.8 for the
    4-12 MB matrices of a Qwen3-0.6B layer, walkthrough/10_ragged_graphs.md). This kernel gives
    each program a slab of `BLOCK_N` output columns and, when the matrix has few columns, one of
    `SPLIT_K` slices of the reduction: every program streams its part of the weight once, with
    16-byte loads along K, and the M <= 16 input rows ride along in one tensor-core tile. Split
    partials (fp32) are summed by a second small kernel in a fixed order (deterministic).

    Which shapes take this path is measured, not guessed: `SkinnyLinear.tune` times each
    (M, N, K) the engine will replay against the library's GEMM and a few launch configurations,
    once at start-up (before CUDA graphs are captured), and keeps the library wherever it is as
    fast. So the fast path is never slower than the reference by more than timing noise.

Invariants
    * x [M, K] (M <= 16), w [N, K], b [N] or None, unit stride on K; output [M, N] in x's dtype;
      fp32 accumulation, rounded once (as the library's GEMM).
    * Row m of the output depends only on row m of x (padding rows cannot disturb real ones).

Tested against
    `torch.nn.functional.linear` in tests/test_fused_kernels.py (interpreter on CPU, CUDA natively).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_os,
                   HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   F32_DOT: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        kk = k + offs_k
        k_ok = kk < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if F32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    mask = m_ok[:, None] & n_ok[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_ps, stride_pm, stride_om,
                       SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):                  # a fixed order: deterministic
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4


CANDIDATES = [SkinnyConfig(16, 256, 1), SkinnyConfig(32, 128, 1), SkinnyConfig(64, 128, 1),
              SkinnyConfig(16, 256, 4), SkinnyConfig(32, 128, 4), SkinnyConfig(16, 128, 8),
              SkinnyConfig(32, 256, 2)]


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: SkinnyConfig) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    assert M <= MAX_ROWS and x.stride(-1) == 1 and w.stride(-1) == 1
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    f32 = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET", "0") == "1"
    k_per = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(K, k_per)
    grid = (triton.cdiv(N, cfg.block_n), splits)
    if splits == 1:
        _skinny_kernel[grid](x, w, b if b is not None else w, out, M, N, K, k_per, x.stride(0), w.stride(0),
                             out.stride(0), 0, HAS_BIAS=b is not None, DIRECT=True, BLOCK_N=cfg.block_n,
                             BLOCK_K=cfg.block_k, F32_DOT=f32, num_warps=cfg.num_warps)
        return out
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    _skinny_kernel[grid](x, w, w, part, M, N, K, k_per, x.stride(0), w.stride(0), part.stride(1), part.stride(0),
                         HAS_BIAS=False, DIRECT=False, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, F32_DOT=f32,
                         num_warps=cfg.num_warps)
    block = min(1024, triton.next_power_of_2(N))
    _sum_splits_kernel[(M, triton.cdiv(N, block))](part, b if b is not None else w, out, M, N, part.stride(0),
                                                   part.stride(1), out.stride(0), SPLITS=splits,
                                                   HAS_BIAS=b is not None, BLOCK=block, num_warps=4)
    return out


class SkinnyLinear:
    """`linear(x, w, b)` that takes the skinny kernel for the shapes `tune` found it faster on,
    and the library's GEMM for everything else. `recording` collects the shapes a warm-up sees."""

    def __init__(self):
        self.choice: dict[tuple, SkinnyConfig] = {}
        self.recording: set | None = None
        self.report: list[dict] = []

    def __call__(self, x, w, b=None):
        key = (x.shape[0], w.shape[0], w.shape[1], x.dtype)
        if self.recording is not None and x.shape[0] <= MAX_ROWS and x.dim() == 2:
            self.recording.add(key)
        cfg = self.choice.get(key)
        if cfg is None or x.dim() != 2 or x.stride(-1) != 1:
            return F.linear(x, w, b)
        return skinny_linear(x, w, b, cfg)

    def tune(self, shapes, device, reps: int = 20, min_gain: float = 0.03) -> None:
        """Time the library and each candidate on every (M, N, K, dtype); keep the fastest when it
        beats the library by more than `min_gain`."""
        def timed(fn):
            for _ in range(3):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / reps
        for M, N, K, dt in sorted(shapes, key=lambda s: (s[1], s[2], s[0])):
            x = torch.randn(M, K, device=device, dtype=dt)
            w = torch.randn(N, K, device=device, dtype=dt) * 0.02
            base = timed(lambda: F.linear(x, w))
            best, best_t = None, base * (1 - min_gain)
            for cfg in CANDIDATES:
                try:
                    t = timed(lambda: skinny_linear(x, w, None, cfg))
                except Exception:            # a configuration that does not compile here
                    continue
                if t < best_t:
                    best, best_t = cfg, t
            if best is not None:
                self.choice[(M, N, K, dt)] = best
            self.report.append({"M": M, "N": N, "K": K, "library_us": round(1e3 * base, 2),
                                "chosen": None if best is None else vars(best),
                                "chosen_us": round(1e3 * (best_t if best else base), 2)})
