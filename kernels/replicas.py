"""EPLB's routing to replicas and load count in one launch (graph safe; nanodspark/eplb.py).

The idea
    With redundant experts, each (token, logical expert) pair the router chose goes to one
    physical slot: replica `(t + step) mod logcnt[e]` of expert e, slot `log2phy[e, replica]`
    (t the token's row in the forward, `step` a device counter). The recorder then counts the
    pairs per slot, but only for rows below `cu_seqlens[-1]` (a graph tier's padding rows are
    computed, not traffic). In plain PyTorch that is about a dozen small kernels per MoE layer
    (`map_to_replicas_ref`); here it is one, with an integer atomic add per counted pair (exact,
    and independent of the order the pairs are counted in).

Invariants
    * ids [T, k] int64 with values in [0, N); log2phy [N, W] int64 (entries past logcnt[e] are
      never read); logcnt [N] int64 >= 1; step [] int64; load [P] int64 or None (no count);
      cu_seqlens [R + 1] int32 or None (every row counts).
    * The result equals `map_to_replicas_ref` exactly, and so do the counts.
    * No host sync: every input is read on the device (a CUDA graph can hold the launch).

Tested against
    `map_to_replicas_ref` in tests/test_eplb.py (interpreter on CPU, natively on CUDA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def map_to_replicas_ref(ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, step: torch.Tensor,
                        cu_seqlens: torch.Tensor | None = None, load: torch.Tensor | None = None) -> torch.Tensor:
    """The semantics, in PyTorch: physical slot ids [T, k]; counts the real rows' pairs into load."""
    row = torch.arange(ids.shape[0], device=ids.device)[:, None]
    phys = log2phy[ids, (row + step) % logcnt[ids]]
    if load is not None:
        real = torch.ones_like(phys) if cu_seqlens is None else (row < cu_seqlens[-1]).long().expand_as(phys)
        load.scatter_add_(0, phys.flatten(), real.flatten())
    return phys


@triton.jit
def _map_kernel(ids_ptr, out_ptr, log2phy_ptr, logcnt_ptr, step_ptr, cu_ptr, load_ptr, P, N, last,
                TOP_K: tl.constexpr, WIDTH: tl.constexpr, HAS_CU: tl.constexpr, RECORD: tl.constexpr,
                BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < P
    e = tl.load(ids_ptr + offs, mask=ok, other=0)
    e = tl.minimum(tl.maximum(e, 0), N - 1)    # never read outside the map, whatever a padding row holds
    row = offs // TOP_K
    cnt = tl.load(logcnt_ptr + e, mask=ok, other=1)
    replica = (row + tl.load(step_ptr)) % cnt
    phys = tl.load(log2phy_ptr + e * WIDTH + replica, mask=ok, other=0)
    tl.store(out_ptr + offs, phys, mask=ok)
    if RECORD:
        real = ok
        if HAS_CU:
            real = ok & (row < tl.load(cu_ptr + last))
        tl.atomic_add(load_ptr + phys, tl.full([BLOCK], 1, tl.int64), mask=real)


def map_to_replicas(ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, step: torch.Tensor,
                    cu_seqlens: torch.Tensor | None = None, load: torch.Tensor | None = None,
                    block: int = 256) -> torch.Tensor:
    """`map_to_replicas_ref` in one Triton launch."""
    T, k = ids.shape
    out = torch.empty_like(ids)
    P = T * k
    if P == 0:
        return out
    assert ids.is_contiguous() and log2phy.is_contiguous() and (load is None or load.is_contiguous())
    has_cu = cu_seqlens is not None
    _map_kernel[(triton.cdiv(P, block),)](
        ids, out, log2phy, logcnt, step, cu_seqlens if has_cu else ids,
        load if load is not None else out, P, log2phy.shape[0], (cu_seqlens.shape[0] - 1) if has_cu else 0,
        TOP_K=k, WIDTH=log2phy.shape[1], HAS_CU=has_cu, RECORD=load is not None, BLOCK=block, num_warps=4)
    return out
