"""The fused small-op kernels (kernels/fused.py) and the graph-safe MoE (kernels/moe.py) against
the model's own PyTorch code, which is their reference.

Outputs are poisoned with NaN first (an unwritten element shows); caches are NaN except where
the kernel must write, and the test checks that negative slots stay untouched. bf16 agrees to
within a rounding of the float32 reductions, fp32 to float32 rounding. Runs under the Triton
interpreter on CPU and natively on CUDA.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kernels  # noqa: E402,F401
from kernels.fused import add_rmsnorm, qk_norm_rope_store, silu_mul  # noqa: E402
from kernels.linear import CANDIDATES, SkinnyLinear, skinny_linear  # noqa: E402
from kernels.moe import align_pairs, align_pairs_fused, fused_moe  # noqa: E402
from nanodspark.config import ModelConfig  # noqa: E402
from nanodspark.model import Attention, RMSNorm, TORCH_OPS, rope_cos_sin, torch_experts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:     # the interpreter truncates float -> bf16 casts (the GPU rounds to nearest)
    TOL[torch.bfloat16] = 5e-2


def close(a, b, dtype):
    assert not torch.isnan(a).any(), "unwritten (NaN) output"
    err = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item() + 1e-6
    assert err <= TOL[dtype] * scale, f"max error {err} (scale {scale})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    T, H = 7, 96
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    r = torch.randn(T, H, generator=g).to(DEV, dtype) if with_residual else None
    norm = RMSNorm(H, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
        want_h, want_r = TORCH_OPS.add_rmsnorm(x, r, norm)
    h, res = add_rmsnorm(x, r, norm.weight, norm.eps)
    close(h, want_h, dtype)
    if with_residual and not (INTERPRETED and dtype == torch.bfloat16):
        assert torch.equal(res, want_r), "the residual add must round exactly as x + residual"
    elif with_residual:     # the interpreter's float -> bf16 casts do not round to nearest
        close(res, want_r, dtype)
    else:
        assert res is x


def _attention(dtype, qk_norm: bool, hq=4, hkv=2, d=32):
    cfg = ModelConfig(architecture="qwen3" if qk_norm else "llama", vocab_size=16, hidden_size=64,
                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=hq,
                      num_key_value_heads=hkv, head_dim=d, qk_norm=qk_norm)
    attn = Attention(cfg, 0).to(DEV, dtype)
    if qk_norm:
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    return attn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_matches_reference(dtype, qk_norm):
    torch.manual_seed(1)
    hq, hkv, d, page, nb = 4, 2, 32, 8, 6
    attn = _attention(dtype, qk_norm, hq, hkv, d)
    T = 9
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=DEV).to(dtype)
    pos = torch.tensor([0, 5, 17, 3, 40, 41, 42, 100, 7], device=DEV)
    cos, sin = rope_cos_sin(pos, d, 10000.0, dtype)
    slots = torch.tensor([3, -1, 10, 11, 47, -1, 20, 0, 30], device=DEV)
    caches = [torch.full((nb, page, hkv, d), float("nan"), device=DEV, dtype=dtype) for _ in range(4)]
    with torch.no_grad():
        want_q = TORCH_OPS.norm_rope_store(attn, qkv, cos, sin, caches[0], caches[1], slots)
    q = qk_norm_rope_store(qkv, attn.q_norm.weight if qk_norm else None, attn.k_norm.weight if qk_norm else None,
                           attn.q_norm.eps if qk_norm else 0.0, cos, sin, caches[2], caches[3], slots, hq, hkv, d)
    close(q, want_q, dtype)
    for want, got in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(torch.isnan(want), torch.isnan(got)), "stored into the wrong slots"
        stored = ~torch.isnan(want)
        close(got[stored], want[stored], dtype)


def test_qk_norm_rope_store_without_q_heads_stores_kv_only():
    """The drafter's injection stores context K/V with no query heads (n_heads = 0)."""
    torch.manual_seed(2)
    hkv, d = 2, 16
    kv = torch.randn(3, 2 * hkv * d, device=DEV)
    pos = torch.tensor([4, 5, 6], device=DEV)
    cos, sin = rope_cos_sin(pos, d, 10000.0, torch.float32)
    kc = torch.full((2, 4, hkv, d), float("nan"), device=DEV)
    vc = torch.full((2, 4, hkv, d), float("nan"), device=DEV)
    w = torch.rand(d, device=DEV) + 0.5
    q = qk_norm_rope_store(kv, w, w, 1e-6, cos, sin, kc, vc, torch.tensor([0, 1, 7], device=DEV), 0, hkv, d)
    assert q.shape == (3, 0, d)
    assert torch.isnan(kc).sum() == kc.numel() - 3 * hkv * d
    assert torch.allclose(vc[1, 3], kv[2, hkv * d:].view(hkv, d))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    x = torch.randn(5, 2 * 80, device=DEV).to(dtype)
    close(silu_mul(x), TORCH_OPS.silu_mul(x), dtype)


def test_align_pairs_groups_every_pair_once_by_expert():
    g = torch.Generator().manual_seed(3)
    E, k, T, bm = 6, 2, 23, 4
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    ids[:10] = torch.tensor([5, 0])          # skew: expert 5 gets many pairs, some experts may get none
    rows, block_expert = align_pairs(ids, E, bm)
    flat = ids.flatten().cpu()
    rows, block_expert = rows.cpu(), block_expert.cpu()
    real = rows[rows < T * k]
    assert sorted(real.tolist()) == list(range(T * k)), "each pair exactly once"
    for b, e in enumerate(block_expert.tolist()):
        pairs = rows[b * bm:(b + 1) * bm]
        pairs = pairs[pairs < T * k]
        if e < 0:
            assert pairs.numel() == 0
        else:
            assert (flat[pairs] == e).all(), "a block holds pairs of its own expert only"
    rows2, be2 = align_pairs_fused(ids, E, bm)          # the one-kernel version: the same layout
    assert torch.equal(rows2.cpu(), rows) and torch.equal(be2.cpu(), block_expert)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (13, 8, 2), (40, 16, 4)])
def test_fused_moe_matches_reference(dtype, T, E, k):
    torch.manual_seed(4)
    H, I = 48, 40
    x = torch.randn(T, H, device=DEV).to(dtype)
    wg, wu = (torch.randn(E, I, H, device=DEV).to(dtype) * 0.2 for _ in range(2))
    wd = (torch.randn(E, H, I, device=DEV) * 0.2).to(dtype)
    probs = torch.softmax(torch.randn(T, E, device=DEV), -1)
    probs[:, 1] += 1.0 * (torch.arange(T, device=DEV) % 2 == 0)     # skewed toward expert 1
    weights, ids = torch.topk(probs, k, -1)
    weights = weights.to(dtype)
    want = torch_experts(x, ids, weights, wg, wu, wd)
    got = fused_moe(x, ids, weights, wg, wu, wd)
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", [CANDIDATES[0], CANDIDATES[3], CANDIDATES[5]])
def test_skinny_linear_matches_the_library(dtype, cfg):
    torch.manual_seed(5)
    for M, N, K in ((1, 48, 200), (6, 70, 96), (16, 33, 300)):
        x = torch.randn(M, K, device=DEV).to(dtype)
        w = (torch.randn(N, K, device=DEV) * 0.1).to(dtype)
        b = torch.randn(N, device=DEV).to(dtype)
        close(skinny_linear(x, w, None, cfg), torch.nn.functional.linear(x, w), dtype)
        close(skinny_linear(x, w, b, cfg), torch.nn.functional.linear(x, w, b), dtype)


def test_skinny_linear_dispatch_records_shapes_and_keeps_the_library_by_default():
    lin = SkinnyLinear()
    lin.recording = set()
    x, w = torch.randn(3, 32, device=DEV), torch.randn(40, 32, device=DEV)
    assert torch.equal(lin(x, w), torch.nn.functional.linear(x, w))      # no choice yet: the library
    lin(torch.randn(40, 32, device=DEV), w)                               # too many rows: not recorded
    assert lin.recording == {(3, 40, 32, torch.float32)}
    lin.choice[(3, 40, 32, torch.float32)] = CANDIDATES[3]
    close(lin(x, w), torch.nn.functional.linear(x, w), torch.float32)


def test_one_kernel_alignment_equals_the_torch_one_on_many_pairs():
    """128 experts, top-8, 40 tokens: the pairs cross several of the kernel's 64-pair chunks."""
    g = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(40)]).to(DEV)
    ids[:20, 0] = 7                                   # one hot expert
    for bm in (16, 64):
        a, b = align_pairs(ids, 128, bm)
        c, d = align_pairs_fused(ids, 128, bm)
        assert torch.equal(a, c) and torch.equal(b, d)


@pytest.mark.parametrize("renorm", [False, True])
def test_route_topk_matches_the_torch_router(renorm):
    from kernels.moe import route_topk
    torch.manual_seed(7)
    for E, k in ((8, 2), (128, 8), (60, 4)):
        logits = torch.randn(9, E, device=DEV)
        probs = torch.softmax(logits.float(), -1)
        w, ids = torch.topk(probs, k, -1)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
        gw, gids = route_topk(logits, k, renorm)
        assert torch.equal(gids, ids)
        torch.testing.assert_close(gw, w, atol=1e-6, rtol=1e-5)


def test_route_topk_names_a_real_expert_on_a_row_of_nans():
    """A graph tier's padding rows hold whatever the buffers held, NaNs included; their ids go
    to the EPLB map and the expert kernels as addresses, so they must stay in [0, E) (on the
    H200 an out-of-range id read past the replica map: an illegal memory access)."""
    from kernels.moe import route_topk
    logits = torch.randn(3, 60, device=DEV)
    logits[1] = float("nan")
    _, ids = route_topk(logits, 4, True)
    assert ((ids >= 0) & (ids < 60)).all()
