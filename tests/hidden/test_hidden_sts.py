"""Hidden tests of the `sts` unit (run by `course grade`, never exported): ECE and the plain STS
fit on random data, against brute force written out with loops."""
import math
import random

import torch

from nanodspark.calibration import ece, fit_sts


def ece_by_loops(pred, label, n_bins=10):
    bins = [[] for _ in range(n_bins)]
    for p, y in zip(pred, label):
        bins[min(int(min(max(p, 0.0), 1.0) * n_bins), n_bins - 1)].append((p, y))
    n = len(pred)
    return sum(len(b) / n * abs(sum(p for p, _ in b) / len(b) - sum(y for _, y in b) / len(b)) for b in bins if b)


def test_ece_on_random_samples():
    rng = random.Random(6)
    for _ in range(50):
        n, bins = rng.randint(1, 300), rng.choice([1, 5, 10, 15])
        pred = [rng.choice([0.0, 1.0, 0.5, rng.random()]) for _ in range(n)]
        label = [float(rng.random() < 0.6) for _ in range(n)]
        assert math.isclose(ece(pred, label, bins), ece_by_loops(pred, label, bins), abs_tol=1e-12)
    assert math.isnan(ece([], []))


def test_plain_sts_picks_the_grid_temperature_of_least_ece_left_to_right():
    g = torch.Generator().manual_seed(8)
    N, gamma = 400, 3
    z = torch.randn(N, gamma, generator=g, dtype=torch.float64) * 2
    y = (torch.rand(N, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(z / 2.5)).double().cumprod(1)
    grid = torch.tensor([0.5, 1.0, 1.7, 2.5, 4.0], dtype=torch.float64)
    temps = fit_sts(z, y, grid=grid)
    prefix = torch.ones(N, dtype=torch.float64)
    for k in range(gamma):
        errs = [ece((prefix * torch.sigmoid(z[:, k] / T)).tolist(), y[:, k].tolist()) for T in grid.tolist()]
        best = min(errs)
        ties = [T for T, e in zip(grid.tolist(), errs) if abs(e - best) <= 1e-12]
        assert float(temps[k]) == min(ties, key=lambda T: abs(math.log(T)))
        prefix = prefix * torch.sigmoid(z[:, k] / temps[k])
