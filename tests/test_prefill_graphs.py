"""Prefill padded to tiers and replayed from CUDA graphs (runner.py).

The tiers and the buffer layout are plain functions, checked by hand; a padded prefill is run
eagerly on the CPU and must equal the unpadded one — the same tokens, and the same KV in the
target's and the drafter's caches (a padding row that stored would overwrite a real row's
entry); on the GPU, replayed prefills must give what eager ones give.
"""
import numpy as np
import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.runner import Chunk, PrefillLayout, prefill_tier

from test_engine import check_no_leak, prompts
from test_verify import make_drafter


def test_tiers_hold_the_prefill_and_grow_in_steps():
    assert prefill_tier(1, 5, 5) == (1, 16, 16)
    assert prefill_tier(3, 700, 300) == (4, 1024, 512)          # past 512 tokens: steps of 512
    assert prefill_tier(12, 1500, 256) == (16, 1536, 256)
    assert prefill_tier(2, 20, 20) == (2, 32, 32)                # the longest chunk never above the tokens
    for c, t, q in [(1, 1, 1), (5, 513, 100), (64, 8192, 8000), (7, 100, 90)]:
        C, T, Q = prefill_tier(c, t, q)
        assert C >= c and T >= t and q <= Q <= T
        assert prefill_tier(C, T, Q) == (C, T, Q)                # a tier is its own tier


def test_layout_packs_rows_chunks_and_padding():
    lay = PrefillLayout(4, 16)
    h = np.full(lay.size, 99, np.int64)                          # stale values must all be overwritten
    n = lay.pack([Chunk(0, 0, [5, 6, 7], sample=True), Chunk(2, 4, [8, 9], replay_until=5),
                  Chunk(3, 0, [4], sample=True)], scratch=9, out=h)
    T = 16
    ids, pos, req, full, store = (h[i * T:(i + 1) * T] for i in range(5))
    assert n == 2
    assert ids[:7].tolist() == [5, 6, 7, 8, 9, 4, 0] and not ids[6:].any()
    assert pos[:6].tolist() == [0, 1, 2, 4, 5, 0] and req[:6].tolist() == [0, 0, 0, 1, 1, 2]
    assert full[:6].tolist() == [1, 1, 1, 0, 1, 1]               # position 4 is below replay_until
    assert store.tolist() == [1] * 6 + [0] * 10                   # padding rows store nothing
    rest = h[5 * T:]
    assert rest[:5].tolist() == [0, 3, 5, 6, 6]                  # cu_seqlens; the padding chunk is empty
    assert rest[5:9].tolist() == [3, 6, 1, 0]                    # kv_lens
    assert rest[9:13].tolist() == [0, 2, 3, 9]                   # slots (padding: scratch)
    assert rest[13:17].tolist() == [2, 5, 0, 0]                  # the sampled chunks' last rows first
    assert rest[17:21].tolist() == [0, 3, 9, 9]
    assert rest[21] == 2


def _pair(tiny_dir, tmp_path, **kw):
    drafter = make_drafter(tiny_dir, tmp_path / "drafter", gamma=3)
    return LLM(str(tiny_dir), drafter_path=str(drafter), use_tqdm=False, **kw)


def test_padded_prefill_equals_unpadded(tiny_dir, tmp_path):
    """The tiny pair (full and sliding layers, MoE, a drafter) on the CPU, one engine padding its
    prefills to tiers (buffers for up to 64 tokens: larger prefills take the unpadded path), the
    other not: equal tokens, equal caches after the prompts, nothing leaked. Prefix hits make
    SWA replay rows (stored in the sliding group only)."""
    kw = dict(device="cpu", max_num_batched_tokens=96, block_size=4, enable_prefix_cache=True)
    plain, padded = _pair(tiny_dir, tmp_path, **kw), _pair(tiny_dir, tmp_path, **kw)
    runner = padded.engine.runner
    runner.set_tiers(64, graphs=False)
    shapes, forward = [], runner._forward
    runner._forward = lambda buf, T, C, Q, tr: (shapes.append((buf is runner.buf, T, C)), forward(buf, T, C, Q, tr))[1]
    vocab = plain.engine.model_config.vocab_size
    ps = prompts(6, vocab, seed=3, lo=5, hi=70)
    ps += [ps[0] + [7, 8, 9], ps[1][:30] + [11] * 20]              # prefix hits: replayed rows
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = [o.token_ids for o in plain.generate(ps, params)]
    b = [o.token_ids for o in padded.generate(ps, params)]
    assert a == b
    assert any(on_buf for on_buf, *_ in shapes) and not all(on_buf for on_buf, *_ in shapes)   # both paths ran
    # the caches after one prefill wave (both engines run the same schedule, so the same blocks):
    # every real row's K/V equal, no padding row written anywhere
    p2 = prompts(3, vocab, seed=4, lo=9, hi=20)
    for llm in (plain, padded):
        for p in p2:
            llm.engine.add_request(p, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        llm.engine.step()
    for g, x in plain.engine.kv_cache.tensors.items():
        torch.testing.assert_close(x, padded.engine.kv_cache.tensors[g], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain.engine.runner.draft_cache, padded.engine.runner.draft_cache, atol=1e-5, rtol=1e-5)
    for llm in (plain, padded):
        while llm.engine.has_unfinished():
            llm.engine.step()
        check_no_leak(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replayed_prefill_equals_eager_on_the_gpu(tiny_dir, tmp_path):
    """Greedy output with prefill graphs equals output without them (the decode graphs in both),
    over waves of several tiers; the graphs were captured and replayed."""
    kw = dict(dtype="float32", max_num_batched_tokens=256)
    eager = _pair(tiny_dir, tmp_path, cuda_graph_prefill=False, **kw)
    graphed = _pair(tiny_dir, tmp_path, **kw)
    ps = prompts(24, eager.engine.model_config.vocab_size, seed=5, lo=5, hi=120)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for _ in range(2):                                             # the second round replays
        a, b = eager.generate(ps, params), graphed.generate(ps, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        # the drafter's context came from the prefill: its drafts are accepted as often
        acc = [sum(o.spec["accepted"] for o in x) for x in (a, b)]
        assert abs(acc[0] - acc[1]) <= 0.02 * max(acc) + 2, acc
    assert graphed.engine.runner.graphs and not eager.engine.runner.graphs
    check_no_leak(graphed)
