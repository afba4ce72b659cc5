"""Tests of nanodspark/calibration.py: metrics on hand-computed arrays, STS recovery of known
per-position temperatures, the online accumulator (the reliability diagram's figure:
tests/test_plots.py).
(Paper §3.2.1 and §4.3.3; walkthrough chapter 06.)"""

import math

import pytest
import torch

from nanodspark.calibration import (
    OnlineCalibrationMetrics, apply_temperatures, auroc, brier, calibration_report, ece, fit_sts, fit_sts_shifted,
    offset_interval,
    position_metrics, reliability, sts_grid, survival,
)


# ---------------------------------------------------------------------------------------------
# metrics on hand-computed values
# ---------------------------------------------------------------------------------------------

def test_ece_hand_computed():
    # two bins: [0, .5) holds .1, .2 (labels 0, 1) and [.5, 1] holds .8, .9 (labels 1, 1)
    # bin 0: |.15 - .5| * 2/4 = .175 ; bin 1: |.85 - 1| * 2/4 = .075
    assert ece([0.1, 0.2, 0.8, 0.9], [0, 1, 1, 1], n_bins=2) == pytest.approx(0.25)
    assert ece([1.0, 0.0], [1, 0], n_bins=20) == pytest.approx(0.0)     # 1.0 lands in the last bin
    assert math.isnan(ece([], []))


def test_auroc_hand_computed_and_ties():
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    # positives {0.5, 0.9}, negatives {0.5, 0.5}: 0.9 wins twice, the 0.5-0.5 ties count 1/2 each
    assert auroc([0.5, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx(0.75)
    assert auroc([0.2, 0.2], [0, 1]) == pytest.approx(0.5)
    assert auroc([0.9, 0.1], [1, 0]) == pytest.approx(1.0)
    assert math.isnan(auroc([0.3, 0.4], [1, 1]))
    assert math.isnan(auroc([0.3, 0.4], [0, 0]))


def test_auroc_matches_pairwise_definition():
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 5, (60,), generator=g).double() / 4          # many ties
    y = torch.rand(60, generator=g) < 0.4
    pos, neg = p[y], p[~y]
    pairwise = ((pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()).mean()
    assert auroc(p, y) == pytest.approx(float(pairwise))


def test_brier_and_reliability():
    assert brier([0.2, 0.7], [0, 1]) == pytest.approx((0.04 + 0.09) / 2)
    r = reliability([0.1, 0.2, 0.8, 0.9], [0, 1, 1, 1], n_bins=4)
    assert r.count.tolist() == [2, 0, 0, 2]
    assert r.mean_pred[0] == pytest.approx(0.15) and r.mean_label[0] == pytest.approx(0.5)
    assert r.mean_pred[3] == pytest.approx(0.85) and r.mean_label[3] == pytest.approx(1.0)
    assert math.isnan(float(r.mean_pred[1])) and math.isnan(float(r.mean_label[2]))
    assert r.edges.tolist() == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])


def test_survival_is_cumprod():
    c = torch.tensor([[0.9, 0.5, 1.0], [1.0, 0.0, 0.7]])
    assert torch.allclose(survival(c), torch.tensor([[0.9, 0.45, 0.45], [1.0, 0.0, 0.0]]))


# ---------------------------------------------------------------------------------------------
# STS
# ---------------------------------------------------------------------------------------------

def synthetic_proposals(n, true_t, seed=0, truncate=True):
    """Raw logits z, prefix labels y and validity: conditional accepts ~ Bernoulli(sigmoid(z/T))."""
    g = torch.Generator().manual_seed(seed)
    gamma = len(true_t)
    z = torch.randn(n, gamma, generator=g, dtype=torch.float64) * 2.0 + 2.0
    accept = torch.rand(n, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(z / torch.tensor(true_t))
    y = torch.cumprod(accept.double(), dim=1)
    if truncate:   # some proposals are shorter (e.g. an EOS): positions past the end are invalid
        length = torch.randint(1, gamma + 1, (n,), generator=g)
        valid = torch.arange(gamma)[None, :] < length[:, None]
        y = torch.where(valid, y, torch.full_like(y, 0.5))   # garbage where invalid: must be ignored
    else:
        valid = torch.ones(n, gamma, dtype=torch.bool)
    return z, y, valid


def test_sts_grid_contains_identity_and_bounds():
    g = sts_grid()
    assert len(g) == 257 and (g == 1.0).any()
    assert g[0] == pytest.approx(0.05) and g[-1] == pytest.approx(20.0)
    assert bool((g[1:] > g[:-1]).all())


def test_sts_recovers_known_temperatures_and_lowers_ece():
    true_t = [0.5, 1.0, 2.0, 0.8]
    z, y, valid = synthetic_proposals(24000, true_t)
    temps = fit_sts(z, y, valid)
    assert temps.shape == (4,)
    for got, want in zip(temps.tolist(), true_t):
        assert got == pytest.approx(want, rel=0.2)
    report = calibration_report(z, y, valid, temps)
    assert report.mean_ece("after") < report.mean_ece("before")
    assert report.mean_ece("after") < 0.02
    # a position with T != 1 must improve on its own
    for k in (0, 2):
        assert report.after[k].ece < report.before[k].ece
    # temperature scaling preserves order at position 1, so AUROC there is unchanged
    assert report.after[0].auroc == pytest.approx(report.before[0].auroc)
    assert "mean ECE" in report.format()


def test_sts_with_shifts_removes_an_offset_that_temperatures_cannot():
    """Conditional confidences near 1/2 over-predicted by a constant logit offset: plain STS
    leaves a mean over-prediction (a temperature cannot lower a mean near 1/2), the shifted fit
    recovers T and s and removes it."""
    g = torch.Generator().manual_seed(7)
    n, true_t, true_s = 40000, torch.tensor([1.0, 1.3, 0.8]), torch.tensor([-0.1, -0.4, -0.3])
    z = torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.8 + 0.3
    accept = torch.rand(n, 3, generator=g, dtype=torch.float64) < torch.sigmoid(z / true_t + true_s)
    y = torch.cumprod(accept.double(), dim=1)
    temps, shifts = fit_sts_shifted(z, y)
    assert temps.tolist() == pytest.approx(true_t.tolist(), rel=0.25)
    assert shifts.tolist() == pytest.approx(true_s.tolist(), abs=0.08)
    plain = calibration_report(z, y, None, fit_sts(z, y))
    shifted = calibration_report(z, y, None, temps, shifts=shifts)
    assert shifted.shifts == pytest.approx(shifts.tolist()) and "shift" in shifted.format()
    for k in (1, 2):
        assert plain.after[k].mean_pred - plain.after[k].mean_observed > 0.01       # offset left by STS
        assert abs(shifted.after[k].mean_pred - shifted.after[k].mean_observed) < 0.005
        assert shifted.after[k].ece < plain.after[k].ece
    # ranking survives (a constant predictor would have ECE ~0 too, but AUROC 0.5)
    assert all(shifted.after[k].auroc > 0.6 for k in range(3))


def test_sts_identity_when_already_calibrated():
    z, y, valid = synthetic_proposals(24000, [1.0, 1.0, 1.0], seed=3, truncate=False)
    temps = fit_sts(z, y, valid)
    assert temps.tolist() == pytest.approx([1.0, 1.0, 1.0], rel=0.15)


def test_sts_position_without_samples_keeps_identity():
    z, y, _ = synthetic_proposals(500, [0.5, 1.0], seed=4, truncate=False)
    valid = torch.ones_like(z, dtype=torch.bool)
    valid[:, 1] = False
    assert fit_sts(z, y, valid)[1] == 1.0


def test_apply_temperatures_keeps_dtype_device_and_identity():
    z = torch.randn(3, 4, dtype=torch.float32)
    c = apply_temperatures(z, [1.0, 1.0, 1.0, 1.0])
    assert c.dtype == torch.float32 and c.device == z.device
    assert torch.allclose(c, torch.sigmoid(z))
    c2 = apply_temperatures(z, torch.tensor([2.0, 1.0, 1.0, 0.5], dtype=torch.float64))
    assert torch.allclose(c2[:, 0], torch.sigmoid(z[:, 0] / 2))


def test_position_metrics_use_only_valid_rows():
    a = torch.tensor([[0.9, 0.8], [0.1, 0.0]])
    y = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    valid = torch.tensor([[True, True], [True, False]])
    m = position_metrics(a, y, valid)
    assert m[0].count == 2 and m[1].count == 1
    assert m[1].mean_pred == pytest.approx(0.8) and m[1].mean_observed == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# online metrics
# ---------------------------------------------------------------------------------------------

def test_online_metrics_match_batch_ece():
    z, y, valid = synthetic_proposals(3000, [0.7, 1.5, 1.0], seed=5)
    a = survival(torch.sigmoid(z))
    online = OnlineCalibrationMetrics(gamma=3)
    for chunk in range(3):
        sl = slice(chunk * 1000, (chunk + 1) * 1000)
        online.update(a[sl], y[sl], valid[sl])
    batch = position_metrics(a, y, valid)
    for k in range(3):
        assert float(online.ece()[k]) == pytest.approx(batch[k].ece, abs=1e-12)
        assert float(online.mean_pred()[k]) == pytest.approx(batch[k].mean_pred)
        assert float(online.mean_observed()[k]) == pytest.approx(batch[k].mean_observed)
        assert int(online.samples()[k]) == batch[k].count
    assert online.count.shape == (3, 20)                   # bounded memory
    online.reset()
    assert bool(torch.isnan(online.ece()).all())


def test_ece_noise_floor_tracks_sampling_noise():
    from nanodspark.calibration import ece_noise_floor
    g = torch.Generator().manual_seed(5)
    for n in (500, 8000):
        p = torch.rand(n, generator=g, dtype=torch.float64)
        y = torch.bernoulli(p, generator=g)          # calibrated by construction
        floor = ece_noise_floor(p)
        assert 0.5 * floor < ece(p, y) < 2.0 * floor   # a calibrated predictor sits at the floor
    assert ece_noise_floor(p[:500]) > 2.5 * ece_noise_floor(p)   # ~ 1 / sqrt(N)
    assert ece(p, torch.bernoulli((p * 0.7), generator=g)) > 5 * ece_noise_floor(p)  # real miscalibration is above it


def test_offset_interval_resamples_prompts_and_sees_a_real_offset():
    """Clustered data: 60 prompts, each with its own acceptance rate and 50 proposals. A
    calibrated predictor's interval covers 0; the same predictor shifted by +0.05 is excluded
    from 0, and its gap is measured as ~0.05. Resampling proposals instead of prompts would
    give a much narrower interval (checked against the prompt-level one)."""
    g = torch.Generator().manual_seed(3)
    rate = torch.rand(60, generator=g) * 0.8 + 0.1
    groups = torch.arange(60).repeat_interleave(50)
    p = rate[groups].unsqueeze(1)                                   # one position
    y = torch.bernoulli(p.expand(-1, 1).clone(), generator=g)
    gap, lo, hi = offset_interval(p, y, None, groups)[0]
    assert lo < 0 < hi and abs(gap) < 0.03
    gap2, lo2, hi2 = offset_interval((p + 0.05).clamp(max=1), y, None, groups)[0]
    assert 0 < lo2 < gap2 < hi2 and abs(gap2 - 0.05) < 0.03
    # one group per proposal = the i.i.d. bootstrap: narrower than the prompt-level interval
    _, lo3, hi3 = offset_interval(p, y, None, torch.arange(len(groups)))[0]
    assert hi3 - lo3 < hi - lo
