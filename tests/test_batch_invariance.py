"""Batch invariance (`EngineConfig.batch_invariant`, kernels/batch_invariant.py): a request's
logits are bit-identical whatever else is in the batch, however its prompt is chunked, whether
it decodes one token or a verify window, and with padding rows of a graph tier beside it.

On the CPU: the PyTorch path (torch-bi) and the Triton kernels under the interpreter
(triton-bi, tiny shapes); on CUDA (skipped elsewhere): the Triton kernels natively and the
real engine at batch 1, 8 and 64."""
import os
import random

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import batch_invariant as bi
from kernels import paged_attention as pa_fn
from kernels.reference import paged_attention_ref
from nanodspark import LLM, SamplingParams
from nanodspark.loader import load_model
from nanodspark.model import GroupMeta, KVCache, PagedAttentionContext, ops_for

from conftest import make_hf_model
from test_engine import check_no_leak, prompts

pa_mod = __import__("importlib").import_module("kernels.paged_attention")
CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The per-row PyTorch path is thousands of tiny ops; on a loaded 2-core machine, intra-op
    threads make each ten times slower (measured: 1.0 s against 9.9 s for the engine test's
    generate), so this file runs them on one thread, and restores the count after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- a packed-batch harness
class Harness:
    """Runs a model over hand-packed ragged batches with its own paged cache: request r owns
    the blocks [r * width, (r + 1) * width). `forward([(r, tokens, start), ...], pad_rows,
    pad_requests)` returns each listed request's logits; padding rows (no request, slot -1)
    and empty padding requests are what a CUDA-graph tier adds."""

    def __init__(self, model, ops, n_requests, width=16, block=4):
        self.model, self.ops, self.block, self.width = model, ops, block, width
        cfg, dev, dt = model.config, model.lm_head.weight.device, model.lm_head.weight.dtype
        n = n_requests * width + 1                      # the last block: the padding requests'
        self.cache = KVCache(cfg, {"full": n, "sliding": n}, block, dt, dev)
        self.tables = torch.arange(n_requests * width, dtype=torch.int32, device=dev).view(n_requests, width)
        self.pad_table = torch.full((1, width), n - 1, dtype=torch.int32, device=dev)
        self.dev = dev

    @torch.inference_mode()
    def forward(self, items, pad_rows=0, pad_requests=0):
        ids, pos, slots, cu, lens, tables = [], [], [], [0], [], []
        for r, toks, start in items:
            ids += toks
            pos += range(start, start + len(toks))
            slots += [int(self.tables[r, p // self.block]) * self.block + p % self.block
                      for p in range(start, start + len(toks))]
            cu.append(cu[-1] + len(toks))
            lens.append(start + len(toks))
            tables.append(self.tables[r:r + 1])
        for _ in range(pad_requests):                   # empty requests (a tier's spare slots)
            cu.append(cu[-1])
            lens.append(0)
            tables.append(self.pad_table)
        ids += [1] * pad_rows                           # rows of no request (a tier's spare tokens)
        pos += [0] * pad_rows
        slots += [-1] * pad_rows
        t = lambda v, dt: torch.tensor(v, dtype=dt, device=self.dev)  # noqa: E731
        bt, kv_lens = torch.cat(tables), t(lens, torch.int32)
        groups = {g: GroupMeta(bt, t(slots, torch.long), kv_lens,
                               torch.zeros_like(kv_lens) if g == "sliding" else None) for g in self.cache.groups}
        ctx = PagedAttentionContext(self.cache, t(cu, torch.int32), max(len(x[1]) for x in items), groups, self.ops)
        out = self.model(t(ids, torch.long), t(pos, torch.long), ctx)
        logits = self.model.compute_logits(out.hidden, self.ops)
        return [logits[cu[i]:cu[i + 1]].clone() for i in range(len(items))]


def three_ways(model, ops, a, others, gamma=3, decode_from=5):
    """Request 0's logits at every position of `a`, computed (1) alone in one prefill chunk,
    (2) in two chunks beside other prefills, (3) prefilled to `decode_from` tokens, then one
    row per step beside a verify window of `gamma + 1` rows and a tier's padding."""
    n = len(others) + 1
    alone = Harness(model, ops, n).forward([(0, a, 0)])[0]
    h = Harness(model, ops, n)
    cut = len(a) // 2 - 1
    first = h.forward([(1, others[0][:9], 0), (0, a[:cut], 0)] + [(i + 1, o[:3], 0) for i, o in enumerate(others[1:], 1)])
    second = h.forward([(0, a[cut:], cut), (1, others[0][9:], 9)], pad_rows=5, pad_requests=2)
    chunked = torch.cat([first[1], second[0]])
    h = Harness(model, ops, n)
    rows = [h.forward([(0, a[:decode_from], 0), (1, others[0][:4], 0)])[0]]
    b_len = 4
    for p in range(decode_from, len(a)):
        w = others[0][b_len:b_len + gamma + 1]
        got = h.forward([(1, w, b_len), (0, a[p:p + 1], p)], pad_rows=3, pad_requests=1)
        rows.append(got[1])
        b_len += 1                                   # "one accepted": the window slides by one
    decoded = torch.cat(rows)
    return alone, chunked, decoded


def tiny_model(tmp_path, dtype=torch.float32, device="cpu", **kw):
    d, _ = make_hf_model("qwen3_moe", tmp_path / "m", window=8, seed=5, **kw)
    return load_model(d, dtype=dtype, device=device).fuse()


def rand_ids(n, seed, vocab=320):
    g = random.Random(seed)
    return [g.randrange(3, vocab) for _ in range(n)]


def test_torch_bi_logits_bit_identical_across_batches_chunks_and_padding(tmp_path):
    model = tiny_model(tmp_path)
    a, others = rand_ids(16, 0), [rand_ids(20, 1), rand_ids(6, 2), rand_ids(5, 3)]
    alone, chunked, decoded = three_ways(model, ops_for("torch", batch_invariant=True), a, others)
    assert torch.equal(alone, chunked) and torch.equal(alone, decoded)
    # and it computes the reference's logits (only the order of summation is fixed)
    ref = Harness(model, ops_for("torch"), 1).forward([(0, a, 0)])[0]
    torch.testing.assert_close(alone, ref, rtol=1e-4, atol=1e-4)


@pytest.fixture
def in_order_dot(monkeypatch):
    """Under the interpreter `tl.dot` is numpy's matmul, and its BLAS (OpenBLAS 0.3.31 here)
    sums an output row in an order that depends on the row's place in the tile, which a GPU's
    tensor-core instruction does not. This swaps in a dot that sums every output element over
    k in order, so that an interpreted test checks the kernels' own schedules (tiling, K loop,
    splits, merges): what this code controls. The GPU tests run the real instruction."""
    from triton.runtime import interpreter as ti

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        dt = d.data.dtype
        prod = a.data.astype(dt)[:, :, None] * b.data.astype(dt)[None, :, :]
        return ti.TensorHandle(prod.sum(axis=1) + d.data, d.dtype.scalar)
    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter variant; CUDA runs test_gpu_*")
def test_triton_bi_logits_bit_identical_under_the_interpreter(tmp_path, monkeypatch, in_order_dot):
    """The same with the Triton kernels (interpreted), the attention cut into chunks of 32 keys
    so that the last rows of the 34-token prompt span two and go through the merge."""
    monkeypatch.setattr(pa_mod, "FIXED_CHUNK", 32)
    model = tiny_model(tmp_path, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    a, others = rand_ids(34, 0), [rand_ids(16, 1)]
    alone, chunked, decoded = three_ways(model, ops_for("triton", batch_invariant=True), a, others, gamma=1,
                                         decode_from=32)
    assert torch.equal(alone, chunked) and torch.equal(alone, decoded)
    ref = Harness(model, ops_for("torch"), 1).forward([(0, a, 0)])[0]
    torch.testing.assert_close(alone, ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the kernels alone
DEV = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_linear_rows_do_not_depend_on_the_batch(dtype, in_order_dot):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(150, 72, generator=g).to(DEV, dtype), torch.randn(150, generator=g).to(DEV, dtype)
    x = torch.randn(200, 72, generator=g).to(DEV, dtype)
    full = bi.linear(x, w, b)
    for rows in (slice(0, 1), slice(3, 9), slice(61, 200), slice(130, 131)):
        assert torch.equal(bi.linear(x[rows].clone(), w, b), full[rows])
        assert torch.equal(bi.linear_ref(x[rows], w, b), bi.linear_ref(x, w, b)[rows])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=tol, atol=tol)
    torch.testing.assert_close(bi.linear_ref(x, w, b), F.linear(x, w, b), rtol=tol, atol=tol)


def test_experts_rows_do_not_depend_on_the_batch(in_order_dot):
    from nanodspark.model import torch_experts
    g = torch.Generator().manual_seed(1)
    T, H, I, E, k = 40, 32, 24, 6, 3
    x = torch.randn(T, H, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    wts = torch.rand(T, k, generator=g).to(DEV)
    wg, wu, wd = (torch.randn(E, a, c, generator=g).to(DEV) * 0.2 for a, c in ((I, H), (I, H), (H, I)))
    want = torch_experts(x, ids, wts, wg, wu, wd)
    for fn in (bi.experts, bi.experts_ref):
        full = fn(x, ids, wts, wg, wu, wd)
        torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)
        for rows in (slice(0, 1), slice(5, 12), slice(20, 40)):
            assert torch.equal(fn(x[rows], ids[rows], wts[rows], wg, wu, wd), full[rows])


def attention_rows(groups, q, kc, vc, table, kv_start, window, fn, pad_rows=3):
    """One launch over `groups` [(first row, rows)] of one request's rows (a prefill chunk or a
    decode row each; request j at kv_len first + rows), padding rows after; returns the rows."""
    cu, lens, order = [0], [], []
    for first, n in groups:
        cu.append(cu[-1] + n)
        lens.append(first + n)
        order += range(first, first + n)
    qq = torch.cat([q[order], torch.zeros(pad_rows, *q.shape[1:], dtype=q.dtype, device=q.device)])
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=q.device)  # noqa: E731
    B = len(groups)
    out = fn(qq, kc, vc, table.expand(B, -1).contiguous(), t(cu), t(lens), scale=0.3, sliding_window=window,
             kv_start=None if kv_start is None else t([kv_start] * B), max_q_len=max(n for _, n in groups))
    got = torch.empty_like(q[:len(order)])
    got[torch.tensor(order, device=q.device) - min(order)] = out[:len(order)]
    return got


@pytest.mark.parametrize("window,kv_start", [(0, None), (24, 5)])
def test_attention_rows_do_not_depend_on_chunking_or_neighbours(window, kv_start, monkeypatch, in_order_dot):
    """Rows of one request over 72 keys (chunks of 32: rows span up to 3): computed as one
    prefill, as chunks of 13 (each a request of the launch), and one row per request."""
    monkeypatch.setattr(pa_mod, "FIXED_CHUNK", 32)
    g = torch.Generator().manual_seed(2)
    n, page, hq, hkv, d = 72, 8, 4, 2, 16
    kc, vc = (torch.randn(n // page + 2, page, hkv, d, generator=g).to(DEV) for _ in range(2))
    table = torch.randperm(n // page + 2, generator=g).to(DEV, torch.int32)[None, :]
    q = torch.randn(n, hq, d, generator=g).to(DEV)
    for fn in (bi.attention, bi.attention_ref):
        whole = attention_rows([(0, n)], q, kc, vc, table, kv_start, window, fn)
        chunked = attention_rows([(c, min(13, n - c)) for c in range(0, n, 13)], q, kc, vc, table, kv_start,
                                 window, fn)
        rows = attention_rows([(p, 1) for p in range(56, n)], q, kc, vc, table, kv_start, window, fn)
        assert torch.equal(whole, chunked) and torch.equal(whole[56:], rows)
        want = attention_rows([(0, n)], q, kc, vc, table, kv_start, window, paged_attention_ref)
        torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)


def test_fixed_schedule_matches_the_reference_on_ragged_batches(monkeypatch):
    """The fixed schedule computes the reference's attention: ragged q_len, GQA, a window,
    kv_start, -1 pages, a row without keys, the drafter's non-causal block."""
    from test_kernels import make_batch, run_ref, run_triton
    monkeypatch.setattr(pa_mod, "FIXED_CHUNK", 64)
    mod = __import__("importlib").import_module("kernels.paged_attention")
    monkeypatch.setattr(mod, "POISON_SCRATCH", True)
    for window, ks, causal in ((0, [0, 5, 0], True), (40, None, True), (0, None, False)):
        b = make_batch(q_lens=[1, 7, 20], kv_lens=[150, 90, 20], hq=4, hkv=2, d=16, page=8,
                       dtype=torch.float32, device=DEV, window=window, kv_start=ks, seed=3)
        cfg = mod.fixed_config(torch.float32, 16)
        got = run_triton(b, scale=0.25, sliding_window=window, config=cfg, causal=causal)
        want = run_ref(b, scale=0.25, sliding_window=window, causal=causal)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


# ----------------------------------------------------------------------------- the engine
def seeded(n, max_tokens, seed0=100):
    kinds = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=20)]
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed0 + i, **kinds[i % 3]) for i in range(n)]


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_engine_bi_coupled_spec_equals_target_only_in_any_batch(tiny_dir, mode):
    """Seeded sampled requests (T = 1, top-p, top-k) with batch_invariant and coupled sampling:
    the target alone, the target beside 7 others with chunked prefills, and speculation (random
    windows) beside them give the same tokens."""
    from test_verify import force_windows, make_drafter
    ddir = tiny_dir.parent / f"bi_drafter_{mode}"
    if not ddir.exists():
        make_drafter(tiny_dir, ddir)
    kw = dict(use_tqdm=False, batch_invariant=True, block_size=4)
    ps, params = prompts(8, 8192, seed=41, lo=4, hi=30), seeded(8, 10)
    alone = LLM(str(tiny_dir), drafter_path="none", **kw).generate(ps[:1], params[:1])[0].token_ids
    base = LLM(str(tiny_dir), drafter_path="none", max_num_batched_tokens=16, **kw)
    want = [o.token_ids for o in base.generate(ps, params)]
    assert want[0] == alone
    spec = LLM(str(tiny_dir), drafter_path=str(ddir), verify_mode=mode, coupled_sampling=True, **kw)
    rng = random.Random(mode)
    force_windows(spec.engine, lambda reqs: [rng.randint(0, spec.engine.gamma) for _ in reqs])
    assert spec.engine.ops.name == ("triton-bi" if torch.cuda.is_available() else "torch-bi")
    assert spec.generate(ps[:1], params[:1])[0].token_ids == alone
    got = spec.generate(ps, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec["accepted"] for o in got) > 0
    check_no_leak(spec)


def test_batch_invariant_is_refused_with_tensor_parallel():
    from nanodspark.config import EngineConfig
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)


# ----------------------------------------------------------------------------- on the GPU
def gpu_batches(model, ops, a, others, gamma=5):
    """Request 0's logits at every position of `a`, with len(others) requests beside it: in two
    prefill chunks beside the others' prompts, then one decode row per step beside their verify
    windows and a tier's padding rows."""
    h = Harness(model, ops, len(others) + 1, width=64, block=16)
    cut = len(a) - 8
    first = h.forward([(i + 1, o[:40], 0) for i, o in enumerate(others)] + [(0, a[:cut], 0)])[-1]
    second = h.forward([(0, a[cut:cut + 4], cut)] + [(i + 1, o[40:50], 40) for i, o in enumerate(others)],
                       pad_rows=7, pad_requests=3)[0]
    rows = [first, second]
    done = 50
    for p in range(cut + 4, len(a)):
        items = [(i + 1, o[done:done + gamma + 1], done) for i, o in enumerate(others)] + [(0, a[p:p + 1], p)]
        rows.append(h.forward(items, pad_rows=5, pad_requests=2)[-1])
        done += 1
    return torch.cat(rows)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_logits_bit_identical_at_batch_1_8_64():
    """The default model in bf16 with the batch-invariant Triton kernels: a 300-token request's
    logits (its late rows span two 256-key chunks) are bit-identical alone and beside 7 and 63
    others, in prefill chunks, decode rows and padded tiers."""
    model = load_model(None, dtype=torch.bfloat16, device="cuda").fuse()
    ops = ops_for("triton", batch_invariant=True)
    V = model.config.vocab_size
    a = rand_ids(300, 0, V)
    alone = Harness(model, ops, 1, width=64, block=16).forward([(0, a, 0)])[0]
    for n in (7, 63):
        others = [rand_ids(70, 10 + i, V) for i in range(n)]
        assert torch.equal(gpu_batches(model, ops, a, others), alone), n
    ref = Harness(model, ops_for("torch"), 1, width=64, block=16).forward([(0, a, 0)])[0]
    assert (alone.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95    # the same function, in bf16


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_engine_bi_coupled_spec_equals_target_only_at_batch_1_8_64():
    """The real engine (default model and drafter, CUDA graphs, overlapped loop), seeded T = 1:
    request 0 gives the same tokens alone and beside 7 and 63 random requests, with and without
    speculation, and every request of a batch equals its target-only twin."""
    kw = dict(use_tqdm=False, batch_invariant=True, max_num_seqs=64)
    base = LLM(None, drafter_path="none", **kw)
    spec = LLM(None, coupled_sampling=True, **kw)
    assert spec.engine.executor.graphs.use_graphs and spec.engine.ops.name == "triton-bi"
    V = base.engine.model_config.vocab_size
    ps = [rand_ids(20 + 7 * i % 200, 50 + i, V) for i in range(64)]
    params = seeded(64, 48)
    alone = base.generate(ps[:1], params[:1])[0].token_ids
    for n in (1, 8, 64):
        want = [o.token_ids for o in base.generate(ps[:n], params[:n])]
        got = spec.generate(ps[:n], params[:n])
        assert want[0] == alone, n
        assert [o.token_ids for o in got] == want, n
    assert sum(o.spec["accepted"] for o in got) > 0
