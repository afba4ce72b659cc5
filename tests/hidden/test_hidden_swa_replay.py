"""Hidden tests of the `swa-replay` unit (run by `course grade`, never exported): the replay plan
on random settings against its definition."""
import random

from nanodspark.swa_replay import exact_replay_tokens, plan_replay


def test_exact_replay_is_what_each_sliding_layer_loses():
    for n, w in [(1, 1), (1, 2), (3, 4), (12, 128), (24, 4096)]:
        assert exact_replay_tokens(w, n) == n * (w - 1)


def test_plans_on_random_settings():
    rng = random.Random(3)
    for _ in range(500):
        hit = rng.choice([0, 16, 64, 256, 1024, rng.randrange(0, 4096, 16)])
        window, layers = rng.choice([1, 8, 128, 4096]), rng.choice([0, 1, 2, 12])
        keep = rng.choice([0, 1, 50, 140, 10 ** 6])
        plan = plan_replay(hit, window, layers, keep)
        if hit == 0 or layers == 0:
            assert (plan.start, plan.replay_until, plan.kv_start) == (hit, hit, hit)
            continue
        exact = layers * (window - 1)
        kept = exact if keep == 0 else min(keep, exact)
        assert (plan.start, plan.replay_until, plan.kv_start) == (max(0, hit - kept), hit, max(0, hit - kept))
