"""Hidden tests of the `verify` unit (run by `course grade`, never exported): the batched verdict
against the one-request rules on random greedy batches, and the sampled acceptance rate and
residual law against their formulas."""
import random

import torch

from nanodspark.sampling import STREAM_DRAFT, SamplingTensors, gumbel_argmax
from nanodspark.verify import verify_batch, verify_greedy

from test_verify_contract import onehot_logits, packed


def test_greedy_batches_against_one_request_at_a_time():
    rng = random.Random(15)
    for _ in range(30):
        R, g, V = rng.randint(1, 6), rng.randint(1, 5), 3
        target = [[rng.randrange(V) for _ in range(g + 1)] for _ in range(R)]
        drafts = [[t if rng.random() < 0.7 else rng.randrange(V) for t in row[:g]] for row in target]
        mode = rng.choice(["static", "compact", "cap-accept"])
        window = [rng.randint(0, g) for _ in range(R)]
        verified = [g if mode != "compact" else w for w in window]
        cap = [g if mode == "static" else w for w in window]
        logits, row_index = packed(onehot_logits(target, V))
        v = verify_batch(torch.tensor(drafts), None, logits, row_index, None, torch.zeros(R, dtype=torch.long),
                         torch.tensor(verified), torch.tensor(cap), True)
        for r in range(R):
            one = verify_greedy(drafts[r][:verified[r]], target[r][:verified[r] + 1], window[r], mode)
            assert int(v.accepted[r]) == one.accepted, (mode, r)
            assert v.tokens[r, :one.accepted + 1].tolist() == one.tokens, (mode, r)
            if mode == "cap-accept":
                assert int(v.ceiling[r]) == one.ceiling


def test_sampled_acceptance_and_residual_follow_their_formulas():
    N, V = 40000, 4
    P = torch.tensor([0.1, 0.6, 0.2, 0.1])
    Q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    seeds = torch.arange(N) * 104729 + 11
    pos = torch.full((N,), 3)
    st = SamplingTensors(torch.ones(N), torch.zeros(N, dtype=torch.long), torch.ones(N), seeds)
    d = gumbel_argmax(torch.log(Q).expand(N, V), seeds, pos + 1, STREAM_DRAFT)[:, None]
    logits = torch.log(P).expand(2 * N, V).contiguous()
    one = torch.ones(N, dtype=torch.long)
    v = verify_batch(d, Q.expand(N, 1, V).contiguous(), logits, torch.arange(2 * N).view(N, 2), st, pos, one, one,
                     False)
    accept = float(torch.minimum(P, Q).sum())                          # 0.7
    assert abs(float(v.accepted.float().mean()) - accept) < 0.01
    rejected = v.accepted == 0
    law = torch.bincount(v.tokens[rejected, 0], minlength=V).double() / int(rejected.sum())
    residual = (P - Q).clamp_min(0)
    assert torch.allclose(law, (residual / residual.sum()).double(), atol=0.015)
