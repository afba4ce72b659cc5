"""Tests of the KV kernels (kernels/): Triton kernels against the PyTorch reference, and the
reference against a naive dense attention.

The idea
    * `paged_attention_ref` is checked independently: K/V are gathered token by token through
      the slot formula into a dense tensor and attended with torch SDPA in float64 under an
      explicit boolean mask built from the contract's three rules (causal, window, kv_start).
    * The Triton `paged_attention` and `store_kv` are checked against the reference on ragged
      batches chosen to cross page boundaries, window edges and split boundaries: q_len 1..16
      and longer prefill chunks, GQA ratios 1/2/4/8, kv_len up to ~2000, page sizes 8..128,
      head dims 16/24/32, bf16/fp16/fp32, an empty request, forced split counts (including
      more splits than key tiles, so some splits are empty), and a max_q_len larger than needed.
    * Tests can fail: outputs are poisoned with NaN before each call (and the split-KV scratch
      too, `POISON_SCRATCH`), so an unwritten element shows; every cache slot that no query
      row may read (before the window / kv_start, past kv_len, unused pages) is filled with
      NaN and the pages wholly outside the window / before kv_start are released (-1), so a
      kernel that reads them, or dereferences a -1 entry, produces NaN.

Invariants
    On a machine without CUDA the Triton kernels run under the Triton interpreter
    (TRITON_INTERPRET=1, which must be set before the kernels are defined; `kernels/__init__`
    sets it too). With CUDA the same tests run natively on the GPU. The whole file runs in
    well under 3 minutes on 2 CPU cores.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from kernels import (AttentionConfig, attention_backend_available, paged_attention,  # noqa: E402
                     paged_attention_ref, store_kv, store_kv_ref)

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


@pytest.fixture(autouse=True)
def _poison_scratch():
    mod = importlib.import_module("kernels.paged_attention")
    old = mod.POISON_SCRATCH
    mod.POISON_SCRATCH = True
    yield
    mod.POISON_SCRATCH = old


# ------------------------------------------------------------------------------------------------
# A random paged batch
# ------------------------------------------------------------------------------------------------

def make_batch(*, q_lens, kv_lens, hq, hkv, d, page, dtype, device, window=0, kv_start=None,
               seed=0, extra_cols=2, holes=()):
    """Random q and a shuffled paged cache holding each request's kv_len tokens.

    Slots no query row may read are NaN; pages wholly below the first readable key are
    released (-1) in the block table. `holes` [(request, page index)] are released too (a -1
    inside the readable range, beyond the contract: both implementations must skip it)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(q_lens)
    need = [math.ceil(n / page) for n in kv_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"))
    v_cache = torch.full((num_blocks, page, hkv, d), float("nan"))
    tables = torch.full((B, max(need) + extra_cols), -1, dtype=torch.int32)
    nxt = 0
    for r in range(B):
        L, n = q_lens[r], kv_lens[r]
        lo = kv_start[r] if kv_start is not None else 0
        if window:
            lo = max(lo, n - L - window + 1)
        lo = max(lo, 0)
        for b in range(need[r]):
            phys = int(perm[nxt])
            nxt += 1
            if (b + 1) * page <= lo:
                continue                          # released: wholly before the first readable key
            tables[r, b] = phys
            for s in range(page):
                p = b * page + s
                if lo <= p < n:
                    k_cache[phys, s] = torch.randn(hkv, d, generator=gen)
                    v_cache[phys, s] = torch.randn(hkv, d, generator=gen)
    for r, b in holes:
        tables[r, b] = -1
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=gen)
    cu = torch.tensor([0] + list(itertools_accumulate(q_lens)), dtype=torch.int32)
    kvl = torch.tensor(kv_lens, dtype=torch.int32)
    ks = torch.tensor(kv_start, dtype=torch.int32) if kv_start is not None else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(q=q.to(dtype).to(device), k_cache=k_cache.to(dtype).to(device),
                v_cache=v_cache.to(dtype).to(device), block_tables=to(tables),
                cu_seqlens_q=to(cu), kv_lens=to(kvl), kv_start=to(ks))


def itertools_accumulate(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def dense_attention(b, *, scale, window):
    """Naive float64 attention over K/V gathered token by token through the slot formula."""
    q, kc, vc, bt = b["q"], b["k_cache"], b["v_cache"], b["block_tables"]
    page, hkv = kc.shape[1], kc.shape[2]
    hq, d = q.shape[1], q.shape[2]
    cu, kvl = b["cu_seqlens_q"].tolist(), b["kv_lens"].tolist()
    ks = b["kv_start"].tolist() if b["kv_start"] is not None else None
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for r in range(len(kvl)):
        L, n = cu[r + 1] - cu[r], kvl[r]
        if L == 0:
            continue
        pos = torch.arange(n - L, n, device=q.device)
        j = torch.arange(n, device=q.device)
        mask = j[None, :] <= pos[:, None]
        if window:
            mask &= pos[:, None] - j[None, :] < window
        if ks is not None:
            mask &= j[None, :] >= ks[r]
        # Unreadable slots hold NaN (or nothing): zero them; the mask keeps them out anyway.
        k = torch.zeros(n, hkv, d, dtype=torch.float64, device=q.device)
        v = torch.zeros_like(k)
        for p in range(n):
            blk = int(bt[r, p // page])
            if blk >= 0 and bool(mask[:, p].any()):
                k[p] = kc[blk, p % page].double()
                v[p] = vc[blk, p % page].double()
        qq = q[cu[r]:cu[r + 1]].double().transpose(0, 1)                     # [Hq, L, D]
        kk = k.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)           # [Hq, n, D]
        vv = v.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
        out[cu[r]:cu[r + 1]] = o.transpose(0, 1)
    return out


def run_ref(b, **kw):
    return paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                               b["cu_seqlens_q"], b["kv_lens"], kv_start=b["kv_start"], **kw)


def run_triton(b, **kw):
    out = torch.full_like(b["q"], float("nan"))
    res = paged_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                          b["cu_seqlens_q"], b["kv_lens"], kv_start=b["kv_start"], out=out, **kw)
    assert res is out
    return out


def random_case(seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 4, 8])
    B = rng.randint(1, 4)
    q_lens = [rng.choice([1, 1, 2, 3, 4, 8, 16]) for _ in range(B)]
    kv_lens = [ql + rng.randint(0, 300) for ql in q_lens]
    window = rng.choice([0, 0, rng.randint(1, 100)])
    kv_start = None
    if rng.random() < 0.3:
        kv_start = [rng.randint(0, n - ql) for n, ql in zip(kv_lens, q_lens)]
    return dict(q_lens=q_lens, kv_lens=kv_lens, hq=hkv * group, hkv=hkv, d=rng.choice([16, 32]),
                page=rng.choice([8, 16, 32]), window=window, kv_start=kv_start)


# ------------------------------------------------------------------------------------------------
# The reference against naive dense attention
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_dense(device, seed):
    case = random_case(seed)
    window = case.pop("window")
    b = make_batch(**case, window=window, dtype=torch.float32, device=device, seed=seed)
    scale = case["d"] ** -0.5
    want = dense_attention(b, scale=scale, window=window)
    got = run_ref(b, scale=scale, sliding_window=window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_reference_matches_dense_long_window_gqa8(device):
    case = dict(q_lens=[16, 3], kv_lens=[700, 300], hq=16, hkv=2, d=16, page=16)
    b = make_batch(**case, window=129, kv_start=[0, 50], dtype=torch.float32, device=device)
    want = dense_attention(b, scale=0.3, window=129)
    got = run_ref(b, scale=0.3, sliding_window=129)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_reference_row_without_keys_is_zero():
    """kv_start past a row's position leaves it nothing to read: output 0, not NaN."""
    b = make_batch(q_lens=[3], kv_lens=[20], hq=2, hkv=1, d=16, page=8, kv_start=[19],
                   dtype=torch.float32, device="cpu")
    o = run_ref(b, scale=0.25)
    assert torch.equal(o[:2], torch.zeros_like(o[:2]))
    assert torch.isfinite(o).all() and o[2].abs().sum() > 0


# ------------------------------------------------------------------------------------------------
# Triton paged attention against the reference
# ------------------------------------------------------------------------------------------------

CASES = {
    # name: (batch spec, dtype, config or None, extra kwargs)
    "decode_gqa4": (dict(q_lens=[1] * 5, kv_lens=[1, 16, 17, 130, 300], hq=8, hkv=2, d=32,
                         page=16), torch.bfloat16, None, {}),
    "verify_mixed_gqa1": (dict(q_lens=[1, 3, 8, 16, 5], kv_lens=[9, 33, 64, 200, 5], hq=4, hkv=4,
                               d=16, page=16), torch.float16, None, {}),
    "verify_gqa8_window": (dict(q_lens=[4, 16, 2], kv_lens=[400, 257, 40], hq=16, hkv=2, d=16,
                                page=8, window=37), torch.bfloat16, None, {}),
    "gqa2_kv_start_fp32": (dict(q_lens=[7, 1, 12], kv_lens=[100, 61, 250], hq=4, hkv=2, d=32,
                                page=16, kv_start=[33, 0, 130]), torch.float32, None, {}),
    "long_split_gqa8": (dict(q_lens=[1, 4], kv_lens=[2000, 1500], hq=8, hkv=1, d=32, page=16),
                        torch.bfloat16, AttentionConfig(16, 64, 5), {}),
    "long_window_split": (dict(q_lens=[8, 1], kv_lens=[1999, 700], hq=8, hkv=4, d=16, page=16,
                               window=300), torch.float16, AttentionConfig(16, 32, 3), {}),
    "prefill_chunk_d24_empty_req": (dict(q_lens=[40, 0, 70], kv_lens=[100, 5, 70], hq=4, hkv=2,
                                         d=24, page=32), torch.float32, None, {}),
    "page128_window": (dict(q_lens=[3, 1], kv_lens=[300, 129], hq=4, hkv=1, d=16, page=128,
                            window=50), torch.bfloat16, None, {}),
    "more_splits_than_tiles": (dict(q_lens=[2, 2], kv_lens=[100, 3], hq=4, hkv=2, d=16, page=16),
                               torch.float16, AttentionConfig(16, 16, 16), {}),
    "max_q_len_oversized": (dict(q_lens=[2, 5], kv_lens=[50, 90], hq=8, hkv=2, d=16, page=16),
                            torch.bfloat16, None, dict(max_q_len=20)),
    "hole_in_table": (dict(q_lens=[3, 1], kv_lens=[90, 70], hq=4, hkv=2, d=16, page=16,
                           holes=[(0, 2), (1, 0)]), torch.float32, AttentionConfig(16, 32, 2), {}),
    "prefill_split_kv_start_window": (dict(q_lens=[33], kv_lens=[600], hq=4, hkv=2, d=16, page=16,
                                           window=200, kv_start=[420]),
                                      torch.float32, AttentionConfig(32, 32, 4), {}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_reference(device, name):
    spec, dtype, config, kw = CASES[name]
    spec = dict(spec)
    window = spec.pop("window", 0)
    b = make_batch(**spec, window=window, dtype=dtype, device=device, seed=len(name))
    scale = spec["d"] ** -0.5
    want = run_ref(b, scale=scale, sliding_window=window)
    got = run_triton(b, scale=scale, sliding_window=window, config=config, **kw)
    assert torch.isfinite(got).all(), "unwritten rows or a read of an unreadable slot"
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_non_causal_blocks_read_from_kv_start_as_the_reference(device):
    """The drafter's block pass (causal=False): every row of a request reads all its keys in
    [kv_start, kv_len), and nothing below kv_start (NaN there, as in every case here)."""
    b = make_batch(q_lens=[4, 4, 4], kv_lens=[40, 21, 90], hq=4, hkv=2, d=16, page=16, kv_start=[0, 17, 33],
                   dtype=torch.float32, device=device, seed=5)
    want = run_ref(b, scale=0.25, causal=False)
    got = run_triton(b, scale=0.25, causal=False)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    causal = run_ref(b, scale=0.25)
    assert not torch.allclose(causal[:3], want[:3])      # the first row reads its block's later keys


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_random(device, seed):
    case = random_case(100 + seed)
    window = case.pop("window")
    dtype = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16][seed]
    b = make_batch(**case, window=window, dtype=dtype, device=device, seed=seed)
    scale = case["d"] ** -0.5
    splits = [None, AttentionConfig(16, 32, 2), None, AttentionConfig(32, 64, 3)][seed]
    want = run_ref(b, scale=scale, sliding_window=window)
    got = run_triton(b, scale=scale, sliding_window=window, config=splits)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_split_and_single_pass_agree(device):
    """The split-KV path (partials + merge) computes the same function as one pass."""
    b = make_batch(q_lens=[1, 8], kv_lens=[900, 333], hq=8, hkv=2, d=32, page=16,
                   dtype=torch.float32, device=device, seed=7)
    one = run_triton(b, scale=0.2, config=AttentionConfig(32, 64, 1))
    many = run_triton(b, scale=0.2, config=AttentionConfig(32, 64, 7))
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# store_kv
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hkv,d,page,dtype", [(2, 16, 16, torch.bfloat16), (3, 24, 8, torch.float32),
                                              (8, 128, 16, torch.float16)])
def test_store_kv_matches_reference(device, hkv, d, page, dtype):
    gen = torch.Generator().manual_seed(hkv * 100 + d)
    num_blocks, T = 9, 37
    # The caches are views cache[i, 0] / cache[i, 1] of a group tensor, as in the engine.
    group = torch.full((2, 2, num_blocks, page, hkv, d), float("nan"), dtype=dtype)
    slots = torch.randperm(num_blocks * page, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:6]] = -1                 # skipped tokens
    k = torch.randn(T, hkv, d, generator=gen).to(dtype)
    v = torch.randn(T, hkv, d, generator=gen).to(dtype)
    want = group.clone()
    store_kv_ref(k, v, want[1, 0], want[1, 1], slots)
    group, k, v, slots = group.to(device), k.to(device), v.to(device), slots.to(device)
    store_kv(k, v, group[1, 0], group[1, 1], slots)
    torch.testing.assert_close(group.cpu(), want, equal_nan=True, atol=0, rtol=0)
    # the reference itself: written slots hold k / v, all others are still NaN
    flat_k = want[1, 0].reshape(-1, hkv, d)
    keep = slots.cpu() >= 0
    assert torch.equal(flat_k[slots.cpu()[keep]], k.cpu()[keep])
    assert int(torch.isnan(flat_k[:, 0, 0]).sum()) == num_blocks * page - int(keep.sum())
    assert torch.isnan(want[0]).all()


def test_backend_availability():
    assert attention_backend_available("torch")
    assert attention_backend_available("triton") == torch.cuda.is_available()
    with pytest.raises(ValueError):
        attention_backend_available("nope")
    assert kernels.paged_attention is paged_attention


def test_split_count_fills_whole_waves():
    """The split rule the H200 sweep supports: fewest splits whose programs fill the waves."""
    pa = importlib.import_module("kernels.paged_attention")
    slots = pa.PROGRAMS_PER_SM * 132
    # batch 8 x 8 KV heads = 64 programs: 4 splits fill one wave (256 of 264 slots); 9 (the old
    # heuristic) fill two waves and spill 48 programs into a third, nearly empty one.
    assert pa.choose_num_splits(64, kv_tiles=64, sms=132) == 4
    assert pa.wave_efficiency(64 * 4, slots) > 0.95 > 0.75 > pa.wave_efficiency(64 * 9, slots)
    # one wave or more already: no split (the sweep: 1 split beat 3-4 at batch 64, q_len 8)
    assert pa.choose_num_splits(512, kv_tiles=256, sms=132) == 1
    # short contexts cap the split count (>= MIN_TILES_PER_SPLIT key tiles per split)
    assert pa.choose_num_splits(8, kv_tiles=8, sms=132) == 8 // pa.MIN_TILES_PER_SPLIT
    assert pa.choose_num_splits(1, kv_tiles=4096, sms=132) == pa.MAX_SPLITS   # as full as it gets
    for programs in (8, 40, 64, 100, 192, 300, 700):
        s = pa.choose_num_splits(programs, kv_tiles=4096, sms=132)
        assert pa.wave_efficiency(programs * s, slots) >= pa.MIN_WAVE_EFFICIENCY
        # and it is the fewest such count
        assert all(pa.wave_efficiency(programs * t, slots) < pa.MIN_WAVE_EFFICIENCY for t in range(1, s))


def test_pick_config_uses_wide_key_tiles_for_decode_and_verify_only():
    pa = importlib.import_module("kernels.paged_attention")
    kw = dict(num_kv_heads=8, group=4, head_dim=128, max_kv_len=8192, dtype=torch.bfloat16,
              device=torch.device("cpu"))
    for q in (1, 4, 8):
        c = pa.pick_config(batch=8, max_q_len=q, **kw)
        assert (c.block_n, c.num_stages, c.num_warps) == (128, 2, 4) and c.block_m <= 32
    prefill = pa.pick_config(batch=1, max_q_len=512, **kw)
    assert prefill.block_m == 64 and prefill.block_n == 64
    assert pa.pick_config(batch=8, max_q_len=1, **{**kw, "dtype": torch.float32}).block_n == 32
