"""`verify_batch`, the engine's verification of a whole batch, checked on its own (the course's
`verify` unit): greedy rows accept the leading matches, caps and windows bound what is committed,
sampled rows commit tokens distributed exactly as the target's (whatever the draft law), and a
row's verdict depends on its own seed and position only, never on the rest of the batch."""
import torch

from nanodspark.sampling import STREAM_DRAFT, SamplingTensors, gumbel_argmax
from nanodspark.verify import verify_batch


def packed(logits_per_request):
    """[R, g + 1, V] logits -> the packed [T, V] rows and row_index [R, g + 1]."""
    R, n, V = logits_per_request.shape
    return logits_per_request.reshape(R * n, V), torch.arange(R * n).view(R, n)


def onehot_logits(tokens, V):
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), V).float() * 10.0


def test_greedy_rows_accept_the_leading_matches():
    V = 6
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5], [0, 1, 2, 3]]      # argmax after anchor, d1, d2, d3
    drafts = torch.tensor([[1, 2, 0], [1, 2, 3], [4, 5, 5], [0, 1, 2]])
    logits, row_index = packed(onehot_logits(target, V))
    verified, cap = torch.tensor([3, 3, 3, 2]), torch.tensor([3, 1, 3, 2])
    v = verify_batch(drafts, None, logits, row_index, None, torch.tensor([10, 20, 30, 40]), verified, cap, True)
    assert v.ceiling.tolist() == [2, 3, 0, 2]            # leading matches among the verified drafts
    assert v.accepted.tolist() == [2, 1, 0, 2]           # ... capped
    assert v.tokens.tolist() == [[1, 2, 3, 0],           # accepted drafts, then the target's token, zeros after
                                 [1, 2, 0, 0],
                                 [5, 0, 0, 0],
                                 [0, 1, 2, 0]]


def test_nothing_past_the_verified_drafts_is_accepted():
    V, g = 5, 4
    target = [[1, 2, 3, 4, 0]] * 3
    drafts = torch.tensor([[1, 2, 3, 4]] * 3)            # an oracle: every draft matches
    logits, row_index = packed(onehot_logits(target, V))
    verified, cap = torch.tensor([4, 2, 0]), torch.tensor([4, 2, 0])
    v = verify_batch(drafts, None, logits, row_index, None, torch.zeros(3, dtype=torch.long), verified, cap, True)
    assert v.accepted.tolist() == [4, 2, 0] and v.ceiling.tolist() == [4, 2, 0]
    assert v.tokens[:, :g + 1].tolist() == [[1, 2, 3, 4, 0], [1, 2, 3, 0, 0], [1, 0, 0, 0, 0]]


def sampled_batch(N, temperature, cap, seed0=0):
    """N requests with one target and one draft law each position (g = 2, V = 4): drafts drawn
    from Q with keyed noise, the target's logits log P (its law at temperature 1)."""
    g, V = 2, 4
    P = torch.tensor([[0.55, 0.25, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    Q = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]])
    seeds = torch.arange(seed0, seed0 + N, dtype=torch.long) * 7919 + 3
    anchor_pos = torch.full((N,), 17, dtype=torch.long)
    drafts = torch.stack([gumbel_argmax(torch.log(Q[k]).expand(N, V), seeds, anchor_pos + 1 + k, STREAM_DRAFT)
                          for k in range(g)], 1)
    logits, row_index = packed(torch.log(P).expand(N, g + 1, V).clone())
    st = SamplingTensors(torch.full((N,), float(temperature)), torch.zeros(N, dtype=torch.long),
                         torch.ones(N), seeds)
    v = verify_batch(drafts, Q.expand(N, g, V).clone(), logits, row_index, st, anchor_pos,
                     torch.full((N,), g), torch.full((N,), cap), False)
    law = torch.softmax(torch.log(P) / temperature, -1)
    return v, law


def chi2(tokens, law):
    counts = torch.bincount(tokens, minlength=law.numel()).double()
    expected = law.double() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_rows_commit_the_target_law_whatever_the_draft():
    """Speculative sampling is lossless: the first committed token follows P_0, and the token after
    an accepted draft follows P_1 (the target's rows here do not depend on the drafts), at full
    caps and with the window capped. chi-square, 3 degrees of freedom: P(> 21.1) = 1e-4."""
    for temperature, cap in ((1.0, 2), (1.0, 1), (0.6, 2)):
        v, law = sampled_batch(30000, temperature, cap)
        count = v.accepted + 1
        assert chi2(v.tokens[:, 0], law[0]) < 21.1, (temperature, cap)
        assert chi2(v.tokens[count >= 2, 1], law[1]) < 21.1, (temperature, cap)
        if cap == 2:
            assert chi2(v.tokens[count >= 3, 2], law[2]) < 21.1
        acc = float(v.accepted.double().mean()) / cap
        assert 0.1 < acc < 0.9, "rejections and residual samples must really happen"
        assert int(v.accepted.max()) == cap and bool((v.ceiling >= v.accepted).all())


def test_a_row_depends_on_its_seed_and_position_only():
    v, _ = sampled_batch(64, 1.0, 2)
    again, _ = sampled_batch(64, 1.0, 2)
    assert torch.equal(v.tokens, again.tokens)                    # no generator state
    part, _ = sampled_batch(16, 1.0, 2, seed0=48)                 # the last 16 requests alone
    assert torch.equal(part.tokens, v.tokens[48:]) and torch.equal(part.accepted, v.accepted[48:])
