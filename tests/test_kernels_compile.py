"""Every Triton kernel compiles for the H200 (sm_90), checked on any machine.

The CPU tests run the kernels under the Triton interpreter, which executes Python and forgives
what the compiler refuses (a variable bound to values of two types in two branches, for one).
Compiling each kernel's real launch signature for `cuda:90` here catches that before a GPU run
does (it once cost a whole GPU session). Skipped where Triton's CUDA backend cannot compile.
"""
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

I32 = "*i32"
PA = dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", part_cnt_ptr=I32, part_first_ptr=I32, bt_ptr=I32, cu_q_ptr=I32, kv_lens_ptr=I32,
          kv_start_ptr=I32)
CASES = [
    ("paged_attention", "_paged_attention_kernel", dict(HEAD_DIM=128, BLOCK_D=128, GROUP=2, PAGE=16, BLOCK_M=16,
     BLOCK_N=128, USE_WINDOW=False, HAS_KV_START=True, SPLIT=True, F32_DOT=False, CAUSAL=True, MIN_TILES=2, CHUNK=0), PA,
     ("qk_scale",)),
    ("paged_attention", "_paged_attention_kernel", dict(HEAD_DIM=64, BLOCK_D=64, GROUP=3, PAGE=16, BLOCK_M=32,
     BLOCK_N=128, USE_WINDOW=True, HAS_KV_START=False, SPLIT=False, F32_DOT=False, CAUSAL=False, MIN_TILES=2, CHUNK=0), PA,
     ("qk_scale",)),
    # the fixed schedule of batch invariance (kernels/batch_invariant.py), causal with a window and without
    ("paged_attention", "_paged_attention_kernel", dict(HEAD_DIM=64, BLOCK_D=64, GROUP=3, PAGE=16, BLOCK_M=32,
     BLOCK_N=64, USE_WINDOW=True, HAS_KV_START=True, SPLIT=False, F32_DOT=False, CAUSAL=True, MIN_TILES=1,
     CHUNK=256), PA, ("qk_scale",)),
    ("paged_attention", "_paged_attention_kernel", dict(HEAD_DIM=128, BLOCK_D=128, GROUP=4, PAGE=16, BLOCK_M=32,
     BLOCK_N=64, USE_WINDOW=False, HAS_KV_START=False, SPLIT=False, F32_DOT=False, CAUSAL=False, MIN_TILES=1,
     CHUNK=256), PA, ("qk_scale",)),
    ("paged_attention", "_merge_chunks_kernel", dict(HEAD_DIM=128, BLOCK_D=128), PA, ()),
    ("paged_attention", "_merge_splits_kernel", dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32), PA, ()),
    ("store_kv", "_store_kv_kernel", dict(HEAD_DIM=128, PAGE=16, BLOCK_H=8, BLOCK_D=128), dict(index_ptr="*i64"), ()),
    ("linear", "_skinny_kernel", dict(HAS_BIAS=True, DIRECT=True, BLOCK_N=32, BLOCK_K=128, F32_DOT=False), {}, ()),
    ("linear", "_skinny_kernel", dict(HAS_BIAS=False, DIRECT=False, BLOCK_N=16, BLOCK_K=256, F32_DOT=False),
     dict(out_ptr="*fp32"), ()),
    ("linear", "_sum_splits_kernel", dict(SPLITS=4, HAS_BIAS=True, BLOCK=1024), dict(part_ptr="*fp32"), ()),
    ("moe", "_align_kernel", dict(E=8, BLOCK_M=16, BLOCK_P=64, BLOCK_E=16, BLOCK_B=64),
     dict(ids_ptr=I32, rows_ptr=I32, bexp_ptr=I32), ()),
    ("moe", "_route_kernel", dict(TOP_K=2, RENORM=True, BLOCK_E=16), dict(w_ptr="*fp32", ids_ptr="*i64"), ()),
    ("moe", "_gate_up_kernel", dict(TOP_K=2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, F32_DOT=False),
     dict(rows_ptr=I32, bexp_ptr=I32), ()),
    ("moe", "_down_kernel", dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, F32_DOT=False),
     dict(rows_ptr=I32, bexp_ptr=I32, rw_ptr="*bf16"), ()),
    ("fused", "_add_rmsnorm_kernel", dict(HAS_RES=True, BLOCK=1024), {}, ("eps",)),
    ("fused", "_qk_norm_rope_store_kernel", dict(HQ=16, HKV=8, D=128, BLOCK_D=128, PAGE=16, QK_NORM=True),
     dict(index_ptr="*i64"), ("eps",)),
    ("fused", "_silu_mul_kernel", dict(BLOCK=1024), {}, ()),
    ("batch_invariant", "_matmul_kernel", dict(HAS_BIAS=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, F32_DOT=False),
     {}, ()),
    ("batch_invariant", "_matmul_kernel", dict(HAS_BIAS=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, F32_DOT=True),
     dict(x_ptr="*fp32", w_ptr="*fp32", b_ptr="*fp32", out_ptr="*fp32"), ()),
]


def compile_case(module, name, consts, ptrs, floats) -> str:
    """Compile one kernel for sm_90; '' on success, else the error (run with TRITON_INTERPRET=0)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(f"kernels.{module}"), name)
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "*bf16") if a.endswith("_ptr")
           else "fp32" if a in floats else "i32" for a in fn.arg_names}
    try:
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        return ""
    except Exception as e:
        return repr(e)[-600:]


@pytest.fixture(scope="module")
def results():
    """All cases in one subprocess: the kernels must be defined as compiled, not interpreted, functions."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    code = ("import json, sys; sys.path[:0] = [%r, %r]; import test_kernels_compile as t; "
            "print(json.dumps([t.compile_case(*c) for c in t.CASES]))" % (str(root), str(root / "tests")))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        pytest.skip(f"the compile subprocess failed: {out.stderr[-300:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}.{c[1]}.{i}" for i, c in enumerate(CASES)])
def test_kernel_compiles_for_sm90(results, i):
    err = results[i]
    if "ptxas" in err or "No such file" in err:
        pytest.skip(f"Triton's CUDA backend cannot compile here: {err[:120]}")
    assert not err, err
