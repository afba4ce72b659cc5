"""Triton kernel `store_kv`: write the new tokens' K/V rows into the paged cache.

The idea
    One program per new token. It reads the token's cache index, splits it into (block, offset) and
    copies the token's `[Hkv, D]` K and V rows into `k_cache[block, offset]` and
    `v_cache[block, offset]`. A negative index (a token whose K/V is already cached, or a padding
    row of a CUDA-graph batch) turns every load and store of the program off, so the grid never
    depends on how many tokens are really stored and nothing is read back to the host.

Invariants
    * k, v: [T, Hkv, D] with unit stride on D; caches: [num_blocks, block_size, Hkv, D] with
      unit stride on D (any other strides, e.g. the views `cache[i, 0]` of a group tensor).
    * cache_index: int64 [T] (int32 accepted); `index < 0` => token skipped.
    * Cache offsets are computed in int64: a cache may hold more than 2**31 elements.
    * Values are cast to the cache's dtype on store.

Tested against
    `kernels.reference.store_kv_ref` in tests/test_kernels.py (interpreter on CPU, native on
    CUDA), with the cache poisoned with NaN so that a missing or misplaced write shows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, index_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    idx = tl.load(index_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # The skip flag as a per-head vector (a scalar & tensor mask trips the Triton interpreter).
    keep = (offs_h * 0 + idx) >= 0
    idx = tl.maximum(idx, 0)
    block = idx // PAGE
    offset = idx % PAGE
    mask = (keep & (offs_h < num_kv_heads))[:, None] & (offs_d[None, :] < HEAD_DIM)

    src = t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    dst = block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    k = tl.load(k_ptr + src, mask=mask)
    tl.store(kc_ptr + dst, k, mask=mask)

    src = t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    v = tl.load(v_ptr + src, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             cache_index: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; cache_index int64 [T].

    Writes k[t], v[t] at `cache_index[t]`; negative indices are skipped. In place."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    assert cache_index.shape[0] == T
    BLOCK_H = triton.next_power_of_2(Hkv)
    BLOCK_D = triton.next_power_of_2(D)
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, cache_index,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Hkv,
        HEAD_DIM=D, PAGE=k_cache.shape[1], BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
        num_warps=4 if BLOCK_H * BLOCK_D >= 1024 else 1,
    )
