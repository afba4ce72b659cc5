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


def oracle_batch(N, g, V, temperature, seed0=0):
    """N requests whose drafts come from exactly the target's law at each position (an oracle
    drafter: Q = P, drafts drawn with keyed noise): (drafts, Q, packed logits, row_index, st, pos)."""
    gen = torch.Generator().manual_seed(seed0)
    logits = torch.randn(N, g + 1, V, generator=gen) * 2.0
    st = SamplingTensors(torch.full((N,), float(temperature)), torch.zeros(N, dtype=torch.long), torch.ones(N),
                         torch.arange(seed0, seed0 + N, dtype=torch.long) * 131 + 7)
    law = torch.softmax(logits / temperature, -1)
    anchor_pos = torch.randint(5, 50, (N,), generator=gen)
    drafts = torch.stack([gumbel_argmax(torch.log(law[:, k]), st.seed, anchor_pos + 1 + k, STREAM_DRAFT)
                          for k in range(g)], 1)
    packed_logits, row_index = packed(logits)
    return drafts, law[:, :g].contiguous(), packed_logits, row_index, st, anchor_pos


def test_an_oracle_draft_is_accepted_in_full_in_every_mode():
    """Drafts that are the target's own choice — its argmax (greedy), or a draw from exactly its
    law (sampled: then P(d) / Q(d) = 1) — are accepted up to the cap in every verify mode:
    static (verify and commit all), compact (verify the window) and cap-accept (verify all,
    commit the window, report the whole run as the ceiling). A verifier that accepts less is
    lossless but useless."""
    N, g, V = 64, 4, 7
    gen = torch.Generator().manual_seed(5)
    window = torch.randint(0, g + 1, (N,), generator=gen)
    full = torch.full((N,), g)
    for mode, verified, cap in (("static", full, full), ("compact", window, window), ("cap-accept", full, window)):
        for temperature in (0.0, 1.0, 0.7):
            drafts, Q, logits, row_index, st, pos = oracle_batch(N, g, V, temperature or 1.0)
            if temperature == 0.0:           # greedy: the oracle proposes the argmax chain
                drafts = logits.view(N, g + 1, V).argmax(-1)[:, :g]
                v = verify_batch(drafts, None, logits, row_index, None, pos, verified, cap, True)
            else:
                v = verify_batch(drafts, Q, logits, row_index, st, pos, verified, cap, False)
            assert v.accepted.tolist() == cap.tolist(), (mode, temperature)
            assert v.ceiling.tolist() == verified.tolist(), (mode, temperature)    # the whole verified run
            for r in range(N):
                c = int(cap[r])
                assert v.tokens[r, :c].tolist() == drafts[r, :c].tolist(), (mode, temperature, r)


def test_coupled_rows_commit_the_targets_own_sample():
    """Coupled verification (the drafts drawn with the TARGET stream's noise): a draft is accepted
    iff it equals the target's own keyed sample at its position, and every committed token is
    that sample — the token target-only decoding draws there — whatever the draft law. With the
    target's law as the draft law everything is accepted; greedy rows stay greedy."""
    from nanodspark.sampling import STREAM_TARGET, probs_from_logits
    N, g, V = 400, 3, 5
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(N, g + 1, V, generator=gen) * 1.5
    temps = torch.where(torch.arange(N) % 4 == 0, 0.0, 1.0)                # every 4th row greedy
    st = SamplingTensors(temps, torch.zeros(N, dtype=torch.long), torch.ones(N), torch.arange(N) * 977 + 1)
    pos = torch.full((N,), 30)
    at = pos[:, None] + 1 + torch.arange(g + 1)
    P = probs_from_logits(logits.reshape(-1, V), st.rows(torch.arange(N).repeat_interleave(g + 1))).view(N, g + 1, V)
    own = torch.stack([gumbel_argmax(torch.log(P[:, k]), st.seed, at[:, k], STREAM_TARGET) for k in range(g + 1)], 1)
    own = torch.where((temps == 0)[:, None], logits.argmax(-1), own)
    packed_logits, row_index = packed(logits)
    full = torch.full((N,), g)
    for draft_law in ("the target's", "another"):
        Q = P[:, :g] if draft_law == "the target's" else torch.softmax(torch.randn(N, g, V, generator=gen), -1)
        drafts = torch.stack([gumbel_argmax(torch.log(Q[:, k]), st.seed, at[:, k], STREAM_TARGET) for k in range(g)], 1)
        drafts = torch.where((temps == 0)[:, None], own[:, :g], drafts) if draft_law == "the target's" else drafts
        v = verify_batch(drafts, Q.contiguous(), packed_logits, row_index, st, pos, full, full, False, coupled=True)
        run = (drafts == own[:, :g]).long().cumprod(1).sum(1)
        assert v.accepted.tolist() == run.tolist(), draft_law
        for r in range(N):
            m = int(v.accepted[r])
            assert v.tokens[r, :m + 1].tolist() == own[r, :m + 1].tolist(), (draft_law, r)
        if draft_law == "the target's":
            assert int(v.accepted.min()) == g                                  # the oracle: all accepted
        else:
            assert 0 < float(v.accepted.float().mean()) < g
