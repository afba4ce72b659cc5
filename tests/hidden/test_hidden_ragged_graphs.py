"""Hidden tests of the `ragged-graphs` unit (run by `course grade`, never exported): packing rows,
the tier list and the tier picked, on random inputs against plain loops."""
import math
import random

import torch

from nanodspark.ragged_graphs import pack_rows, pick_tier, tier_list


def test_pack_rows_on_random_batches():
    rng = random.Random(4)
    for _ in range(200):
        R = rng.randint(1, 7)
        rows = [rng.randint(0, 5) for _ in range(R)]
        tokens = sum(rows) + rng.randint(0, 6)
        if tokens == 0:
            continue
        lay = pack_rows(torch.tensor(rows), tokens)
        cu = [0]
        for n in rows:
            cu.append(cu[-1] + n)
        req, off, valid = [], [], []
        for r, n in enumerate(rows):
            req += [r] * n
            off += list(range(n))
        pad = tokens - len(req)
        assert lay.cu_seqlens.dtype == torch.int32 and lay.cu_seqlens.tolist() == cu
        assert lay.row_req.tolist() == req + [R - 1] * pad
        assert lay.row_off.tolist() == off + [0] * pad
        assert lay.row_valid.tolist() == [True] * len(req) + [False] * pad


def test_tiers_and_picks_on_random_settings():
    rng = random.Random(5)
    for _ in range(100):
        sizes = sorted(rng.sample(range(1, 65), rng.randint(1, 6)))
        gamma = rng.randint(1, 6)
        fractions = tuple(sorted({rng.choice([0.25, 0.5, 0.75, 1.0]) for _ in range(rng.randint(1, 3))}))
        cap = rng.choice([None, rng.randint(1, 64)])
        want = sorted({(b, b + math.ceil(round(f * b * gamma * 1000) / 1000)) for b in sizes
                       for f in fractions if cap is None or b <= cap})
        tiers = tier_list(sizes, gamma, fractions, cap)
        assert tiers == want
        for _ in range(10):
            req, tok = rng.randint(1, 70), rng.randint(1, 400)
            fits = [t for t in want if t[0] >= req and t[1] >= tok]
            assert pick_tier(tiers, req, tok) == (min(fits, key=lambda t: (t[1], t[0])) if fits else None)
