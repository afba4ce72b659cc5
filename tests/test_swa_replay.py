"""SWA replay and snapshots (swa_replay.py, walkthrough chapter 13).

After a prefix hit on a hybrid model: exact replay equals a cold prefill; a bounded replay is an
approximation whose drift is measured; the suffix rule (window + look-back) gives 140 for
DeepInfer's setting; a snapshot hit equals a cold prefill and replays nothing; snapshots are
evicted (pool full, TTL, KV pressure) without leaking a block, also across preemption; greedy
speculative output equals target-only decoding with the same replay mode on multi-turn traffic.
"""
import json
import random
from pathlib import Path

import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.config import EngineConfig, ModelConfig
from nanodspark.paged_kv import BlockManager, BlockTable
from nanodspark.scheduler import Scheduler
from nanodspark.swa_replay import (ReplayPlan, SnapshotPool, bounded_suffix, exact_replay_tokens, look_back,
                                   plan_replay, replay_tokens)

from test_engine import check_no_leak
from test_verify import make_drafter

WINDOW = 16  # the tiny_dir fixture: 2 full + 2 sliding layers, window 16
DEFAULT = Path(__file__).resolve().parents[1] / "nanodspark" / "assets" / "default"


# ---- the suffix rule ------------------------------------------------------------------------
def test_plan_replay():
    assert plan_replay(0, 128, 3) == plan_replay(0, 128, 3, 140) == ReplayPlan(0, 0, 0)
    assert plan_replay(64, 128, 0) == ReplayPlan(64, 64, 64)             # no sliding layers: no replay
    assert exact_replay_tokens(128, 3) == 381
    assert plan_replay(1024, 128, 3) == ReplayPlan(1024 - 381, 1024, 1024 - 381)
    assert plan_replay(1024, 128, 3, keep_tokens=140).start == 884       # DeepSeek-V4.1's 140 = 128 + 12
    assert plan_replay(100, 128, 3, keep_tokens=140).start == 0
    assert plan_replay(1024, 128, 3, keep_tokens=1000) == plan_replay(1024, 128, 3)   # never beyond exact


@pytest.mark.parametrize("window, gamma, windows, suffix", [
    (128, 5, 2, 140),     # DeepInfer / V4.1: 5 draft tokens, async scheduling (2 windows): 128 + 12; ours on CUDA
    (128, 5, 1, 134),     # ours with the synchronous loop (CPU): one verify window ahead
    (128, 0, 1, 129),     # no drafter: only the decode row itself
    (128, 3, 2, 136),
    (4096, 7, 2, 4112),
    (16, 4, 1, 21),       # the tiny test model with a gamma-4 drafter
])
def test_suffix_is_the_window_plus_the_look_back(window, gamma, windows, suffix):
    assert bounded_suffix(window, look_back(gamma, windows)) == suffix
    n = 40                                       # enough sliding layers that exact is longer
    assert replay_tokens("auto", window, n, look_back(gamma, windows)) == suffix
    assert replay_tokens(0, window, n, 12) == n * (window - 1)
    assert replay_tokens(1, window, 1, 12) == 1
    assert replay_tokens("auto", window, 1, look_back(gamma, windows)) == window - 1   # exact is shorter


def test_auto_for_the_default_pair():
    """The default pair (window 128, gamma 5, 3 sliding layers): 140 with the overlapped loop
    (CUDA), 134 with the synchronous one; exact would replay 381."""
    mc = ModelConfig.from_json(DEFAULT)
    gamma = json.loads((DEFAULT / "drafter" / "config.json").read_text())["gamma"]
    cfg = EngineConfig(swa_replay_tokens="auto")
    keep = {k: Scheduler(cfg, mc, {}, look_back(gamma, k)).replay_keep for k in (1, 2)}
    assert (mc.sliding_window, gamma, keep) == (128, 5, {1: 134, 2: 140})
    assert Scheduler(EngineConfig(), mc, {}, 12).replay_keep == 381


def test_engine_config_replay_settings():
    assert EngineConfig(swa_replay_tokens="140").swa_replay_tokens == 140     # a command-line flag
    assert EngineConfig(swa_replay_tokens="auto").swa_replay_tokens == "auto"
    for bad in ({"swa_replay_tokens": -1}, {"swa_replay_tokens": "most"}, {"swa_snapshots": -1},
                {"swa_snapshot_ttl_s": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def windows_in_flight(llm) -> int:
    """Verify windows a request can have in flight: two under the overlapped loop (CUDA's
    default), one under the synchronous one."""
    return 2 if llm.engine.overlap else 1


def test_auto_in_the_engine_follows_its_drafter(tiny_dir, tmp_path):
    drafter = make_drafter(tiny_dir, tmp_path / "d", gamma=4)
    llm = LLM(str(tiny_dir), use_tqdm=False, drafter_path=str(drafter), swa_replay_tokens="auto")
    windows = windows_in_flight(llm)
    assert llm.engine.scheduler.replay_keep == WINDOW + (1 + 4) * windows
    assert LLM(str(tiny_dir), use_tqdm=False, swa_replay_tokens="auto").engine.scheduler.replay_keep == WINDOW + windows


# ---- exactness ------------------------------------------------------------------------------
def first_logits(llm, prompt, params=None):
    """Logits of the first sampled position (captured from the model's logits head)."""
    eng = llm.engine
    seen = []
    orig = eng.model.compute_logits

    def spy(hidden, ops=None):
        res = orig(hidden, ops)
        seen.append(res.clone())
        return res
    eng.model.compute_logits = spy
    req = eng.add_request(prompt, params or SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    del eng.model.compute_logits
    eng.release(req.request_id)
    return seen[0][-1], req


def kl(p_logits, q_logits) -> float:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def test_exact_replay_equals_cold_prefill_and_bounded_replay_drift_is_measured(tiny_dir):
    torch.manual_seed(0)
    shared = torch.randint(0, 300, (96,)).tolist()
    prompt = shared + [5, 6, 7]
    cold = LLM(str(tiny_dir), use_tqdm=False, block_size=4, enable_prefix_cache=False)
    want, _ = first_logits(cold, prompt)

    exact = LLM(str(tiny_dir), use_tqdm=False, block_size=4)
    exact.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))
    full = exact.engine.kv_cache.tensors["full"].clone()
    cached_before = sorted(exact.engine.scheduler.managers["full"].cache.values())
    got, req = first_logits(exact, prompt)
    assert req.replay_until == 96 and req.kv_start == req.admitted_at == 96 - exact_replay_tokens(WINDOW, 2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    exact_kl = kl(want, got)
    assert exact_kl < 1e-11
    # replay rows stored nothing into the (shared, prefix-cached) full-attention blocks
    cached = torch.tensor(sorted(exact.engine.scheduler.managers["full"].cache.values()))
    assert len(cached) == 24 and cached.tolist() == cached_before
    assert torch.equal(exact.engine.kv_cache.tensors["full"][:, :, cached], full[:, :, cached])

    # Bounded: the drift, measured. The figures are this random tiny model's (a regression
    # check of the mechanism, not a claim about real text; chapter 13 has the default pair's).
    # (Measured at commit time: KL 1.6e-7 at 18 tokens, 1.3e-8 at 24, 3e-16 at 29; exact 30.)
    drift, max_abs = {}, {}
    for keep in (WINDOW + 2, 24, 29):
        bounded = LLM(str(tiny_dir), use_tqdm=False, block_size=4, swa_replay_tokens=keep)
        bounded.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))
        approx, req = first_logits(bounded, prompt)
        assert req.kv_start == 96 - keep
        drift[keep], max_abs[keep] = kl(want, approx), (approx - want).abs().max().item()
    print(f"tiny model, next-token KL vs a cold prefill: exact {exact_kl:.1e}, bounded {drift}")
    assert 1e-9 < drift[WINDOW + 2] < 1e-4 and max_abs[WINDOW + 2] > 1e-4, (drift, max_abs)
    assert drift[WINDOW + 2] > drift[24] > drift[29], "a replay nearer the exact length drifts less"


def run_to_end(eng, req):
    while req.status.value != "finished":
        eng.step()
    return req


def test_snapshot_hit_equals_cold_prefill_and_replays_nothing(tiny_dir):
    torch.manual_seed(1)
    p1 = torch.randint(0, 300, (60,)).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = LLM(str(tiny_dir), use_tqdm=False, block_size=4, enable_prefix_cache=False)
    snap = LLM(str(tiny_dir), use_tqdm=False, block_size=4, swa_snapshots=4)
    pool = snap.engine.scheduler.snapshots
    out1 = snap.generate([p1], params)[0].token_ids
    assert out1 == cold.generate([p1], params)[0].token_ids
    # 60 + 12 tokens, 71 with K/V: the full group publishes 68; the snapshot holds [53, 68)
    assert pool.stats["saved"] == 1 and pool.num_blocks == 4 and pool.tables()[0].blocks[:13] == [-1] * 13
    p2 = p1 + out1 + [5, 6, 7]
    want, _ = first_logits(cold, p2)
    got, req = first_logits(snap, p2)
    tol = 2e-5 if snap.engine.dtype == torch.float32 else 3e-2    # up to kernel order (bf16 on CUDA)
    torch.testing.assert_close(got, want, atol=tol, rtol=5 * tol)
    assert pool.stats["hits"] == 1
    assert (req.admitted_at, req.replay_until, req.kv_start) == (68, 68, 68 - WINDOW + 1)   # nothing replayed
    # the answer itself, through decode steps that read the snapshot's blocks
    p3 = p2 + [9, 10]
    a = cold.generate([p3], params)[0].token_ids
    snap.generate([p2], SamplingParams(temperature=0, max_tokens=1))       # leaves a snapshot ending in p2
    b = run_to_end(snap.engine, snap.engine.add_request(p3, params))
    assert b.admitted_at == b.replay_until == 72 and b.output_ids == a
    pool.clear()
    check_no_leak(snap)


# ---- the pool: eviction, TTL, pressure ------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def finished_table(bm: BlockManager, n: int) -> BlockTable:
    t = BlockTable()
    bm.ensure_capacity(t, n)
    return t


def test_snapshot_pool_eviction_ttl_and_coverage():
    bm, clock = BlockManager(64, 4), Clock()
    pool = SnapshotPool(bm, window=8, capacity=2, ttl_s=10.0, clock=clock)
    tables = [finished_table(bm, 21) for _ in range(3)]              # 6 blocks each
    assert pool.save(111, 20, tables[0])                             # keeps [13, 20): blocks 3, 4
    assert tables[0].blocks[3:5] == [-1, -1] and pool.num_blocks == 2
    bm.free(tables[0])
    bm.check_invariants(pool.tables() + tables[1:])
    clock.t = 1.0
    assert pool.save(222, 20, tables[1]) and pool.save(333, 16, tables[2])    # full: 111 (oldest) goes
    assert list(pool.entries) == [222, 333] and pool.stats["evicted"] == 1
    for t in tables[1:]:
        bm.free(t)
    bm.check_invariants(pool.tables())
    assert pool.num_blocks == 4 and bm.num_used_blocks == 4
    assert pool.take(111, 20) is None and pool.take(222, 16) is None     # gone; wrong end
    snap = pool.take(333, 16)
    assert snap.table.blocks == [-1, -1, 2 * 6 + 2, 2 * 6 + 3] and 333 not in pool.entries
    pool.put_back(333, snap)
    clock.t = 11.5                                                     # 222 was saved at 1.0: expired
    assert pool.take(222, 20) is None and pool.stats["expired"] == 2 and not pool.entries
    assert bm.num_used_blocks == 0
    # a table whose window was already released cannot be snapshotted
    t = finished_table(bm, 21)
    bm.release_outside_window(t, 4, 21)
    assert not pool.save(444, 20, t) and pool.stats["uncovered"] == 1
    bm.free(t)
    bm.check_invariants([])
    # a pool over no sliding group (prefix cache off, or no sliding layers) is inert
    off = SnapshotPool(None, 8, 4, 10.0)
    assert off.capacity == 0 and not off.save(1, 20, BlockTable()) and off.take(1, 20) is None


def conversations(n, rng, lo=30, hi=50):
    return [[rng.randrange(300) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def multi_turn(llm, prompts, turns, params, rng, on_step=None):
    """Turns of n concurrent conversations: each turn's prompt is the last prompt + its answer +
    a few new tokens. Returns every answer, in order."""
    eng, answers = llm.engine, []
    for _ in range(turns):
        reqs = [eng.add_request(p, params) for p in prompts]
        while any(r.status.value != "finished" for r in reqs) or eng.in_flight:
            eng.step()
            if on_step:
                on_step()
        answers.append([r.output_ids for r in reqs])
        prompts = [p + r.output_ids + [rng.randrange(300) for _ in range(rng.randint(2, 9))]
                   for p, r in zip(prompts, reqs)]
        for r in reqs:
            eng.release(r.request_id)
    return answers


def check_invariants_with_pool(eng):
    sched = eng.scheduler
    live = [r.tables for r in sched.running]
    assert all(not r.tables for r in sched.waiting)
    for g, bm in sched.managers.items():
        extra = sched.snapshots.tables() if g == "sliding" else []
        bm.check_invariants([t[g] for t in live if g in t] + extra)


def test_no_block_leaks_across_snapshot_reuse_pressure_and_preemption(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ps = conversations(6, random.Random(3))
    ref = LLM(str(tiny_dir), use_tqdm=False, block_size=4)        # exact replay, a roomy cache
    want = multi_turn(ref, ps, 3, params, random.Random(4))
    # 80 blocks of 4 tokens for 6 conversations of 40-90 tokens: preemption, snapshots taken by
    # follow-ups, and snapshots that give their blocks back under pressure (at 72 blocks none
    # survives to its follow-up, at 96 none is reclaimed).
    small = LLM(str(tiny_dir), use_tqdm=False, block_size=4, num_kv_blocks=80, swa_snapshots=16)
    eng = small.engine
    preempted = []
    orig = eng.scheduler.preempt
    eng.scheduler.preempt = lambda r: (preempted.append(r.request_id), orig(r))
    got = multi_turn(small, ps, 3, params, random.Random(4), on_step=lambda: check_invariants_with_pool(eng))
    assert got == want
    stats = eng.scheduler.snapshots.stats
    assert preempted and stats["hits"] > 0 and stats["reclaimed"] > 0, (preempted, stats)
    held = eng.scheduler.snapshots.num_blocks
    assert eng.kv_usage()["sliding"]["used"] == held and eng.kv_usage()["full"]["used"] == 0
    eng.scheduler.snapshots.clear()
    check_no_leak(small)


# ---- lossless speculative decoding with the same replay mode --------------------------------
@pytest.mark.parametrize("mode", ["exact", "bounded", "snapshot"])
def test_greedy_spec_equals_target_only_with_the_same_replay_mode(tiny_dir, tmp_path, mode):
    drafter = make_drafter(tiny_dir, tmp_path / "d", gamma=4)
    kw = dict(use_tqdm=False, block_size=4)
    kw.update({"exact": {}, "bounded": {"swa_replay_tokens": "auto"}, "snapshot": {"swa_snapshots": 8}}[mode])
    spec = LLM(str(tiny_dir), drafter_path=str(drafter), **kw)
    if mode == "bounded":      # "auto" follows the drafter: give the target-only engine the same length
        kw["swa_replay_tokens"] = spec.engine.scheduler.replay_keep
        windows = windows_in_flight(spec)
        assert kw["swa_replay_tokens"] == WINDOW + 5 * windows
    base = LLM(str(tiny_dir), **kw)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ps = conversations(4, random.Random(5), lo=40, hi=70)
    want = multi_turn(base, ps, 3, params, random.Random(6))
    got = multi_turn(spec, ps, 3, params, random.Random(6))
    assert got == want
    sched = spec.engine.scheduler
    if mode == "snapshot":
        assert sched.snapshots.stats["hits"] >= 8           # turns 2 and 3 of every conversation
        sched.snapshots.clear()
    if mode == "bounded":   # the follow-ups did replay a bounded suffix (the hits are > 21)
        assert sched.replay_keep < exact_replay_tokens(WINDOW, 2)
    check_no_leak(spec)


def test_an_admission_undone_gives_its_snapshot_back(tiny_dir, monkeypatch):
    """_allocate took a snapshot, then the request did not fit this step (here: its window could
    not grow): the snapshot goes back to the pool, untouched, and a later admission takes it."""
    from nanodspark.paged_kv import NoFreeBlocks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tiny_dir), use_tqdm=False, block_size=4, swa_snapshots=4)
    eng, p1 = llm.engine, list(range(10, 50))
    out = llm.generate([p1], params)[0].token_ids
    sched = eng.scheduler
    blocks = list(sched.snapshots.tables()[0].blocks)
    orig, calls = sched._grow, []

    def refuse_once(req, n):
        calls.append(n)
        if len(calls) == 1:
            raise NoFreeBlocks("test")
        return orig(req, n)
    monkeypatch.setattr(sched, "_grow", refuse_once)
    req = eng.add_request(p1 + out + [7, 8], params)
    assert not eng.schedule() and req.tables == {} and req.num_computed == 0
    assert sched.snapshots.stats["hits"] == 0 and sched.snapshots.tables()[0].blocks == blocks
    check_invariants_with_pool(eng)
    run_to_end(eng, req)
    assert sched.snapshots.stats["hits"] == 1 and req.admitted_at == 44
    sched.snapshots.clear()
    check_no_leak(llm)
