"""The engine's two KV kernels and their plain-PyTorch references.

The idea
    * `store_kv(k, v, k_cache, v_cache, cache_index)` writes new tokens' K/V into the paged
      cache (kernels/store_kv.py).
    * `paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, *, scale,
      sliding_window=0, kv_start=None, max_q_len=None)` attends a packed ragged batch over the
      paged cache (kernels/paged_attention.py).
    * `store_kv_ref` / `paged_attention_ref` (kernels/reference.py) define the semantics and
      are the CPU engine's attention path.
    * kernels/batch_invariant.py: fixed-order versions of the matmul, MoE and attention (with
      `paged_attention.fixed_config`) for `EngineConfig.batch_invariant`.
    Contracts: walkthrough/00_design.md. Walkthrough: walkthrough/03_kernels.md.

Invariants
    * On a machine without CUDA, importing this package sets `TRITON_INTERPRET=1` (unless the
      variable is already set) before it imports Triton: `triton.jit` decides at decoration
      time whether a function is compiled or interpreted, and that includes Triton's own
      helpers (`tl.max`, `tl.sum`, `tl.cdiv`), so the variable must be set before Triton is
      first imported; import `kernels` before `triton` (a warning says when that was not so).
      The Triton kernels then run (slowly) on CPU tensors, which is what the tests use.
    * `kernels.paged_attention` is the function (it shadows the submodule of the same name);
      reach the module with `importlib.import_module("kernels.paged_attention")`.
    * `attention_backend_available("triton")` is True only where the kernels run natively
      (Triton importable and CUDA available); "torch" (the reference) is always available.
    * Without Triton installed the package still imports; calling a Triton kernel raises.

Tested against
    tests/test_kernels.py.
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton.language" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    # else: Triton's own @jit helpers (tl.max, tl.sum, ...) were already defined as compiled
    # functions and the interpreter cannot call them; the engine refuses the triton backend on
    # CPU then (engine.py), and the torch reference path is unaffected.

from .reference import paged_attention_ref, store_kv_ref  # noqa: E402

try:
    import triton  # noqa: F401
    _TRITON_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - platforms without Triton (macOS, Windows)
    _TRITON_ERROR = e

if _TRITON_ERROR is None:
    from .paged_attention import AttentionConfig, paged_attention, pick_config  # noqa: E402
    from .store_kv import store_kv  # noqa: E402
else:  # pragma: no cover
    def _unavailable(*args, **kwargs):
        raise RuntimeError(f"Triton kernels unavailable: {_TRITON_ERROR!r}")

    paged_attention = store_kv = pick_config = _unavailable
    AttentionConfig = None


def attention_backend_available(name: str) -> bool:
    """Can the attention backend `name` ("torch" or "triton") run natively here?"""
    if name in ("torch", "reference"):
        return True
    if name == "triton":
        return _TRITON_ERROR is None and torch.cuda.is_available()
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["store_kv", "paged_attention", "store_kv_ref", "paged_attention_ref",
           "attention_backend_available", "AttentionConfig", "pick_config"]
