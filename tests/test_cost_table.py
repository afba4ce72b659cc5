"""Tests of nanodspark/cost_table.py (the additive fit, the staircase the scheduler reads,
monotone forcing (isotonic and running max), JSON persistence) and of the profiling statistics
in nanodspark/lab/profile_stats.py (the round-adjusted estimate, the trend gate, the profiler's
rounds, settling and untimed prepare); walkthrough chapter 07 §4."""

import json

import numpy as np
import pytest

from nanodspark.cost_table import CostTable, force_monotone
from nanodspark.lab.profile_stats import gate_by_trend, profile_step_cost, round_adjusted, trend_z


BIAS = 1e-3


def alpha_true(bs):
    return 5e-5 * (bs - 1)


def theta_true(m):
    return 1e-5 * (m - 1) + 2e-4 * (m > 12)          # a cliff: a graph tier


def synthetic_table(noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    meas = {}
    for bs in (1, 2, 4, 8):
        for k in (0, 1, 2, 4, 8, 16):
            t = BIAS + alpha_true(bs) + theta_true(bs + k)
            meas[(bs, k)] = t * (1 + noise * rng.standard_normal())
    return CostTable(meas, model_name="tiny", dtype="float32", device="cpu", graph_tiers=(8, 16, 32))


def test_cost_table_fit_recovers_bias_alpha_theta():
    model = synthetic_table().fit_additive()
    assert model.bias == pytest.approx(BIAS, abs=1e-9)
    for b, a in zip(model.bs_knots, model.alpha):
        assert a == pytest.approx(alpha_true(b), abs=1e-9)
    for m, th in zip(model.m_knots, model.theta):
        assert th == pytest.approx(theta_true(m) - theta_true(1), abs=1e-9)


def test_cost_table_fit_with_noise_predicts_within_tolerance_and_is_monotone():
    table = synthetic_table(noise=0.01)
    model = table.fit_additive()
    for (bs, k) in table.measurements:
        assert model(bs, k) == pytest.approx(BIAS + alpha_true(bs) + theta_true(bs + k), rel=0.05)
    for k in (0, 5, 20):
        assert all(model(b, k) <= model(b + 1, k) for b in range(1, 12))
    for bs in (1, 3, 8, 12):
        curve = model.curve(bs, np.arange(41))
        assert np.all(np.diff(curve) >= 0)                 # non-decreasing in K, extrapolates upward
    assert not table.is_flat()


def test_staircase_keeps_cliffs_and_is_what_the_scheduler_reads():
    """Ceiling lookup at a measured bs (a cliff is charged from the last point below it on),
    interpolation between batch sizes at the same drafts per request, non-decreasing in K."""
    table = force_monotone({(4, 0): 10.0, (4, 4): 10.0, (4, 8): 14.0, (4, 12): 14.5, (4, 20): 15.0,
                            (8, 0): 20.0, (8, 8): 20.0, (8, 16): 30.0, (8, 24): 31.0, (8, 40): 32.0})
    t = CostTable(table)
    assert [t.predict(4, k) for k in (0, 3, 4, 5, 8, 9, 20, 30)] == [10.0, 10.0, 10.0, 14.0, 14.0, 14.5, 15.0, 15.0]
    assert t.predict(6, 0) == pytest.approx(15.0) and t.predict(6, 12) == pytest.approx(0.5 * 14.0 + 0.5 * 30.0)
    assert t.predict(16, 16) == t.predict(8, 8) == 20.0         # beyond the grid: nearest bs, same drafts/request
    assert t.curve(4, 20).tolist() == [t.predict(4, k) for k in range(21)]
    for bs in (4, 5, 6, 8):
        assert np.all(np.diff(t.curve(bs, 5 * bs)) >= 0)
    # the additive fit smooths the cliff at K = 8 (bs 8) away; the staircase keeps it
    assert t.model()(8, 8) > 20.5 and t.predict(8, 8) == 20.0


def test_force_monotone():
    m = force_monotone({(1, 0): 1.0, (1, 4): 0.9, (2, 0): 0.8, (2, 4): 2.0}, method="max")
    assert m == {(1, 0): 1.0, (1, 4): 1.0, (2, 0): 0.8, (2, 4): 2.0}     # along K only
    m = force_monotone({(1, 0): 1.0, (1, 4): 0.9, (2, 0): 0.8, (2, 4): 2.0})
    assert m == pytest.approx({(1, 0): 0.95, (1, 4): 0.95, (2, 0): 0.8, (2, 4): 2.0})
    # one stalled point: the running maximum makes it a cliff, the isotonic fit a small step
    spike = {(4, k): v for k, v in zip((0, 4, 8, 12), (10.0, 20.0, 11.0, 12.0))}
    assert list(force_monotone(spike, method="max").values()) == [10.0, 20.0, 20.0, 20.0]
    assert list(force_monotone(spike).values()) == pytest.approx([10.0, 43 / 3, 43 / 3, 43 / 3])
    # the isotonic fit is the least-squares non-decreasing one: no non-decreasing grid beats it
    rng = np.random.default_rng(0)
    y = rng.normal(size=7).cumsum() + rng.normal(size=7)
    fit = np.array(list(force_monotone({(1, k): float(v) for k, v in enumerate(y)}).values()))
    assert np.all(np.diff(fit) >= -1e-12)
    sse = ((fit - y) ** 2).sum()
    for _ in range(2000):
        cand = np.sort(rng.normal(size=7) * 2 + y.mean())
        assert ((cand - y) ** 2).sum() >= sse - 1e-9
    with pytest.raises(ValueError):
        force_monotone(spike, method="median")


def test_round_adjusted_removes_slow_rounds_that_fool_the_median():
    """Three of seven rounds run 50 % slow (as on the H200): the per-K median jumps between the
    fast and the slow level, the round-adjusted estimate recovers the true costs."""
    mu = np.array([10.0, 10.2, 10.4, 10.6, 10.8, 11.0])
    rng = np.random.default_rng(1)
    slow = np.array([1.5, 1.0, 1.0, 1.5, 1.5, 1.0, 1.0])
    grid = mu[:, None] * slow[None, :] * (1 + 0.005 * rng.standard_normal((6, 7)))
    grid[2, 1] = grid[2, 2] = 15.0                          # and two samples of one K stalled
    est = np.array(round_adjusted(grid.tolist()))
    assert np.allclose(est, mu, rtol=0.02)
    med = np.median(grid, axis=1)
    assert abs(med[2] - mu[2]) / mu[2] > 0.3               # the median of that K is in the slow mode
    # the profiler uses it by default on its samples (one per K per round); "median" keeps the median
    clock, n = {"t": 0.0}, {"i": 0}

    def run_step(bs, k):
        n["i"] += 1
        clock["t"] += (1.0 + 0.01 * k) * (1.5 if n["i"] % 7 in (1, 2, 3) else 1.0)
    t = profile_step_cost(run_step, [1], list(range(6)), repeats=5, warmup=0, settle=0, shuffle=False,
                          timer=lambda: clock["t"], verbose=False)
    assert [t.raw[(1, k)] for k in range(6)] == pytest.approx(round_adjusted([t.samples[(1, k)] for k in range(6)]))
    t = profile_step_cost(run_step, [1], list(range(6)), repeats=5, warmup=0, settle=0, shuffle=False,
                          timer=lambda: clock["t"], verbose=False, estimator="median")
    assert [t.raw[(1, k)] for k in range(6)] == [float(np.median(t.samples[(1, k)])) for k in range(6)]
    with pytest.raises(ValueError):
        profile_step_cost(run_step, [1], [0, 1], repeats=2, warmup=0, verbose=False, estimator="mean")


def test_cost_table_json_roundtrip_and_keyed_file(tmp_path):
    table = synthetic_table()
    table.fit_additive()
    back = CostTable.from_json(json.loads(json.dumps(table.to_json())))
    assert back.measurements == table.measurements and back.additive == table.additive
    assert back.key == "tiny|float32|cpu|tiers=8,16,32"
    path = tmp_path / "cost.json"
    table.save(path)
    CostTable({(1, 0): 1.0}, model_name="other").save(path)
    loaded = CostTable.load(path, "tiny", "float32", "cpu", (8, 16, 32))
    assert loaded is not None and loaded.predict(4, 4) == pytest.approx(table.predict(4, 4))
    assert CostTable.load(path, "tiny", "bfloat16", "cpu", (8, 16, 32)) is None
    assert CostTable.load(tmp_path / "missing.json", "tiny", "float32", "cpu") is None


def test_profile_step_cost_with_a_fake_clock(capsys):
    clock, calls = {"t": 0.0}, []
    jitter = [0.0, 5e-4, -1e-4, 0.0, 9e-3]                 # one outlier per 5 repeats: the median ignores it

    def run_step(bs, k):
        clock["t"] += BIAS + alpha_true(bs) + theta_true(bs + k) + jitter[calls.count((bs, k)) % 5]
        calls.append((bs, k))

    table = profile_step_cost(run_step, [1, 2, 4], lambda bs: range(0, 4 * bs + 1, 2),
                              repeats=5, warmup=0, timer=lambda: clock["t"], model_name="fake", settle=0,
                              shuffle=False)
    assert len(calls) == 5 * len(table.measurements)
    # rounds over each batch size's K grid (not five calls in a row per point)
    assert calls[:15] == [(1, k) for k in (0, 2, 4)] * 5 and calls[15:20] == [(2, k) for k in range(0, 9, 2)]
    # with a warm-up round and one settling step of the same shape before each timed step
    calls.clear()
    profile_step_cost(run_step, [1], [0, 2], repeats=2, warmup=1, timer=lambda: clock["t"], verbose=False, settle=1,
                      shuffle=False)
    assert calls == [(1, 0), (1, 2)] + [(1, 0), (1, 0), (1, 2), (1, 2)] * 2
    # an optional prepare(bs, K) runs before each point (warm-up included), outside the timer
    prepared = []

    def run_prepared(bs, k):
        run_step(bs, k)
    run_prepared.prepare = lambda bs, k: (prepared.append((bs, k)), clock.update(t=clock["t"] + 100.0))
    t2 = profile_step_cost(run_prepared, [1], [0, 2], repeats=2, warmup=1, timer=lambda: clock["t"], verbose=False,
                           settle=1, shuffle=False)
    assert prepared == [(1, 0), (1, 2)] * 3 and max(t2.raw.values()) < 1.0
    # shuffled rounds: each round visits every K once, not always in the same order
    calls.clear()
    profile_step_cost(run_step, [4], list(range(8)), repeats=4, warmup=0, timer=lambda: clock["t"], verbose=False,
                      settle=0)
    rounds = [[k for _, k in calls[i:i + 8]] for i in range(0, 32, 8)]
    assert all(sorted(r) == list(range(8)) for r in rounds) and len({tuple(r) for r in rounds}) > 1
    assert "monotone ms" in capsys.readouterr().out
    assert table.raw.keys() == table.measurements.keys() and all(len(v) == 5 for v in table.samples.values())
    back = CostTable.from_json(json.loads(json.dumps(table.to_json())))
    assert back.samples == table.samples and back.raw == table.raw   # every timed step is kept
    assert table.measurements[(2, 4)] == pytest.approx(BIAS + alpha_true(2) + theta_true(6), abs=1e-9)
    assert table.additive is not None and table.model_name == "fake"


def test_trend_z_by_hand_and_its_sign():
    # ks 0, 1; two rounds; no round effect. Pairs at different K: 4, all concordant, so S = 4;
    # n = 4 with two ties of 2 in K: var = (4*3*13 - 2*(2*1*9)) / 18 = 20/3; z = (4 - 1) / sqrt(20/3)
    assert trend_z([0, 1], [[1.0, 1.0], [2.0, 2.0]]) == pytest.approx(3 / np.sqrt(20 / 3))
    assert trend_z([0, 1], [[2.0, 2.0], [1.0, 1.0]]) == pytest.approx(-3 / np.sqrt(20 / 3))
    assert trend_z([0, 1], [[1.0, 1.0], [1.0, 1.0]]) == 0.0
    # a slow round (every K of round 1 twice as slow) is removed before ranking
    assert trend_z([0, 1, 2], [[1.0, 2.0], [1.1, 2.2], [1.2, 2.4]]) == pytest.approx(
        trend_z([0, 1, 2], [[1.0, 1.0], [1.1, 1.1], [1.2, 1.2]]))


def bimodal_profile(slope, seed, ks=tuple(range(0, 1281, 160)), rounds=7):
    """Timings like the H200's at bs 256: each step near 30 ms or near 47 ms at random, times
    (1 + slope * K / K_max)."""
    rng = np.random.default_rng(seed)
    return {(256, k): [(30e-3 if rng.random() < 0.5 else 47e-3) * (1 + slope * k / ks[-1]) * (1 + 0.01 * rng.standard_normal())
                       for _ in range(rounds)] for k in ks}


def gated(samples):
    from nanodspark.lab.profile_stats import round_adjusted as ra
    ks = sorted(k for _, k in samples)
    raw = dict(zip([(256, k) for k in ks], ra([samples[(256, k)] for k in ks])))
    t = CostTable(force_monotone(raw), raw=raw, samples=samples)
    zs = gate_by_trend(t)
    return t, zs[256]


def test_gate_flattens_a_noise_slope_and_keeps_a_real_one():
    """With no real slope, the isotonic staircase of a bimodal machine still rises (a slow last
    point cannot be pooled away), so the scheduler would trim; the gate flattens it. A real 25 %
    rise under the same noise is kept, and so is every row of a clean staircase."""
    flattened = kept = 0
    for seed in range(20):
        t, z = gated(bimodal_profile(0.0, seed))
        flattened += z < 1.645
        if z < 1.645:
            assert len(set(t.measurements.values())) == 1 and t.notes["flattened"] == [256]
    assert flattened >= 17                       # a one-sided 5 % test: ~1 in 20 passes by chance
    for seed in range(10):
        t, z = gated(bimodal_profile(0.25, seed))
        kept += z >= 1.645
    assert kept >= 9
    t, z = gated(bimodal_profile(0.25, 0))
    if z >= 1.645:
        assert t.measurements[(256, 1280)] > t.measurements[(256, 0)] and t.notes["flattened"] == []


def test_gate_on_an_ungated_h200_profile():
    """An H200 table profiled without the trend gate and while committing drafts
    (tests/data/cost_table_h200_ungated.json): the
    rise with K is significant at bs 1-64 and not at 128 and 256, whose isotonic rows rose
    12-13 % on a single slow last point (walkthrough/results/economics.md)."""
    from pathlib import Path
    path = Path(__file__).resolve().parent / "data" / "cost_table_h200_ungated.json"
    t = CostTable.from_json(next(iter(json.loads(path.read_text()).values())))
    before = {b: t.measurements[(b, 5 * b)] / t.measurements[(b, 0)] for b in (64, 256)}
    zs = gate_by_trend(t)
    assert [b for b, z in zs.items() if z < 1.645] == [128, 256] and t.notes["flattened"] == [128, 256]
    assert before[256] > 1.1 and t.measurements[(256, 1280)] == t.measurements[(256, 0)]
    assert t.measurements[(64, 320)] / t.measurements[(64, 0)] == pytest.approx(before[64])   # kept


def test_the_shipped_h200_profile_was_gated_and_held_acceptance_fixed():
    """benchmarks/cost_table_h200.json came out of `bench profile` with the gate and with no
    draft committed; its notes say so, and gating its own samples again gives the same z."""
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cost_table_h200.json"
    t = CostTable.from_json(next(iter(json.loads(path.read_text()).values())))
    assert t.notes["acceptance"] == "none" and t.notes["trend_z_min"] == 1.645
    zs = {str(b): round(z, 2) for b, z in gate_by_trend(t).items()}
    assert zs == t.notes["trend_z"]
    for b in t.notes["flattened"]:
        assert len({s for (bb, _), s in t.measurements.items() if bb == b}) == 1
