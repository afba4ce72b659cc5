"""Hidden tests of the `cost-scheduler` unit (run by `course grade`, never exported): Algorithm 1,
the lagged budget and the device top-K on random tables, each against its definition written
out as plainly as possible."""
import random

import torch

from nanodspark.cost_scheduler import algorithm1, budget_from_lagged, choose_windows, topk_windows


def random_conf(rng, R, gamma):
    levels = [0.0, 0.25, 0.5, 0.75, 1.0]
    return torch.tensor([[rng.choice(levels) if rng.random() < 0.5 else rng.random() for _ in range(gamma)]
                         for _ in range(R)], dtype=torch.float32)


def survivals(conf):
    out = []
    for row in conf.double().tolist():
        a, s = 1.0, []
        for c in row:
            a *= min(max(c, 0.0), 1.0)
            s.append(a)
        out.append(s)
    return out


def cells_in_order(surv):
    return sorted(((a, k, r) for r, row in enumerate(surv) for k, a in enumerate(row, 1) if a > 0),
                  key=lambda c: (-c[0], c[1], c[2]))


def test_algorithm1_on_random_tables():
    rng = random.Random(11)
    for _ in range(60):
        R, gamma = rng.randint(1, 5), rng.randint(1, 5)
        conf = random_conf(rng, R, gamma)
        sps_table = {b: 1.0 / (1.0 + 0.2 * b + rng.random() * 0.3 * (b > R)) for b in range(R, R * (gamma + 1) + 1)}
        windows, best_windows = [0] * R, [0] * R
        tau, batch = float(R), R
        best = tau * sps_table[batch]
        for a, k, r in cells_in_order(survivals(conf)):
            windows[r] = k
            tau, batch = tau + a, batch + 1
            if tau * sps_table[batch] <= best:
                break
            best, best_windows = tau * sps_table[batch], list(windows)
        assert algorithm1(conf, sps_table.__getitem__).tolist() == best_windows


def test_budget_on_random_tables():
    rng = random.Random(12)
    for _ in range(60):
        R, gamma = rng.randint(1, 5), rng.randint(1, 5)
        s = torch.tensor(survivals(random_conf(rng, R, gamma)))
        cliff = rng.randint(0, R * gamma)
        cost = {k: 1.0 + 0.05 * k + 0.6 * (k > cliff) for k in range(R * gamma + 1)}
        gain = rng.choice([0.0, 0.04, 0.2])
        vals = sorted((v for v in s.flatten().tolist()), reverse=True)
        theta = [(R + sum(vals[:k])) / cost[k] for k in range(R * gamma + 1)]
        k_best = max(range(len(theta)), key=lambda k: (theta[k], -k))
        want = k_best if theta[k_best] > (1 + gain) * theta[-1] else R * gamma
        assert budget_from_lagged(s, lambda bs, k: cost[k], min_gain=gain) == want


def test_device_topk_on_random_tables_with_inactive_rows_and_caps():
    rng = random.Random(13)
    for _ in range(100):
        R, gamma = rng.randint(1, 6), rng.randint(1, 5)
        conf = random_conf(rng, R, gamma)
        active = [rng.random() < 0.8 for _ in range(R)]
        cap = [rng.randint(0, gamma) for _ in range(R)]
        budget = rng.randint(0, R * gamma + 2)
        a = torch.cumprod(conf.clamp(0.0, 1.0), 1).tolist()           # the float32 arithmetic of the code
        surv = [row if on else [0.0] * gamma for row, on in zip(a, active)]
        admitted = cells_in_order(surv)[:budget]
        want = [sum(1 for _, _, r2 in admitted if r2 == r) for r in range(R)]
        assert topk_windows(conf, budget, torch.tensor(active)).tolist() == want
        got = choose_windows(conf, torch.tensor(active), torch.tensor(budget), torch.tensor(True), torch.tensor(cap))
        assert got.tolist() == [min(w, c) for w, c in zip(want, cap)]
