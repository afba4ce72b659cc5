"""The benchmark's acceptance law on random weights (verify.SyntheticAcceptance): the law it
states holds (per-draft survival, the window, the cap, the target's token after the accepted
drafts), it is refused where it would change a checkpoint's output, and an engine on a shape with
random weights commits as many tokens per step as the law says, with its rate as confidence."""
import json
import math

import numpy as np
import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.config import EngineConfig
from nanodspark.verify import SyntheticAcceptance


def test_bad_specs_and_real_weights_are_refused():
    for spec in ("0.5", "a:b", "0.8:0.2", "0.5:1.0", "-0.1:0.5"):
        with pytest.raises(ValueError, match="synthetic_acceptance"):
            SyntheticAcceptance.parse(spec)
    with pytest.raises(ValueError, match="load_format='dummy'"):
        EngineConfig(synthetic_acceptance="0.5:0.6")
    EngineConfig(synthetic_acceptance="0.5:0.6", load_format="dummy")


def test_the_rate_is_the_requests_own_and_spans_the_range():
    law = SyntheticAcceptance(0.2, 0.9)
    seeds = torch.arange(4000)
    a = law.rates(seeds)
    assert torch.equal(a, law.rates(seeds.clone())) and a.min() >= 0.2 and a.max() <= 0.9
    assert abs(a.mean().item() - 0.55) < 0.02 and a.std().item() > 0.18       # uniform: std 0.202
    assert SyntheticAcceptance(0.6, 0.6).expected_tau(7) == pytest.approx((1 - 0.6 ** 8) / 0.4)


def test_the_verdict_follows_the_law_inside_window_and_cap():
    R, g, V = 6000, 5, 11
    law = SyntheticAcceptance(0.7, 0.7)
    torch.manual_seed(0)
    drafts = torch.randint(0, V, (R, g))
    logits = torch.randn(R * (g + 1), V)
    row_index = torch.arange(R * (g + 1)).view(R, g + 1)
    seed, anchor = torch.arange(R), torch.full((R,), 40)
    verified = torch.randint(0, g + 1, (R,))
    cap = torch.minimum(verified, torch.randint(0, g + 1, (R,)))
    v = law.verdict(drafts, logits, row_index, seed, anchor, verified, cap)
    assert (v.ceiling <= verified).all() and torch.equal(v.accepted, torch.minimum(v.ceiling, cap))
    # survival: P(ceiling >= k + 1 | ceiling >= k, k < verified) = alpha at every k
    for k in range(g):
        at = (v.ceiling >= k) & (verified > k)
        assert abs((v.ceiling[at] >= k + 1).float().mean().item() - 0.7) < 0.03
    # the accepted drafts are committed, then the target's argmax after them
    target = logits.argmax(-1)[row_index]
    for r in range(50):
        m = int(v.accepted[r])
        assert v.tokens[r, :m].tolist() == drafts[r, :m].tolist() and v.tokens[r, m] == target[r, m]
    # fresh noise each step: the same request at another anchor draws anew
    w = law.verdict(drafts, logits, row_index, seed, anchor + 3, verified, cap)
    assert not torch.equal(v.ceiling, w.ceiling)


def test_an_engine_on_random_weights_commits_what_the_law_says(tmp_path):
    from nanodspark.lab.shapes import materialize
    model = materialize("tiny-dense", tmp_path / "tiny-dense")
    law = "0.75:0.75"
    llm = LLM(str(model), load_format="dummy", synthetic_acceptance=law, use_tqdm=False, max_num_seqs=16,
              enable_prefix_cache=False, max_model_len=512)
    eng = llm.engine
    assert eng.model_name == "tiny-dense (random weights)"          # the key of its cost table
    seen = []
    eng.extra_observers.append(type("Keep", (), {"observe": lambda self, res: seen.append(res)})())
    outs = llm.generate([[5 + i, 9, 11] for i in range(16)],
                        SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    assert all(len(o.token_ids) == 120 for o in outs)
    from nanodspark.lab.traces import step_arrays
    steps = [step_arrays(r, eng.gamma) for r in seen]
    conf = np.concatenate([s.conf.ravel() for s in steps if len(s.conf)])
    assert np.allclose(conf, 0.75)
    # steps far from the limit verify full blocks: tokens per step = (1 - a^(g+1)) / (1 - a)
    full = np.concatenate([s.accepted[s.verified == eng.gamma] for s in steps if len(s.accepted)])
    tau = SyntheticAcceptance.parse(law).expected_tau(eng.gamma)
    assert len(full) > 500 and abs(full.mean() + 1 - tau) < 0.25


def test_compact_lets_the_confident_requests_draft_alone(tmp_path):
    """Requests of mixed acceptance (law 0.05-0.99) under a profile where the drafter's pass costs
    more per row than a doubtful request gains: compact runs steps where only a share of the
    requests drafts (the ledger counts them), and in those steps the rows that draft are the
    confident ones: their law rates lie above those of the rows that do not (the lag's
    confidences are the law's rate, constant per request, so the ranking must be exact)."""
    from nanodspark.cost_table import CostTable
    from nanodspark.lab.shapes import materialize
    from nanodspark.lab.traces import StepLedger, account
    import time
    model = materialize("tiny-dense", tmp_path / "tiny-dense")
    name, path = "tiny-dense (random weights)", tmp_path / "cost.json"
    kw = dict(load_format="dummy", synthetic_acceptance="0.05:0.99", use_tqdm=False, max_num_seqs=16,
              enable_prefix_cache=False, max_model_len=512)
    probe = LLM(str(model), **kw).engine
    g, dtype, device = probe.gamma, str(probe.dtype), probe.device.type
    del probe
    sizes = (1, 2, 4, 8, 16)
    CostTable({(b, k): 1e-3 * (1 + 0.1 * b + 0.3 * b + 0.02 * k) for b in sizes for k in range(0, b * g + 1)},
              model_name=name, dtype=dtype, device=device).save(path)
    CostTable({(b, 0): 1e-3 * (1 + 0.1 * b) for b in sizes}, model_name=f"{name} (no drafter)", dtype=dtype,
              device=device).save(path)
    for f in (0.25, 0.5, 0.75):              # the partial steps' own profiles
        d = lambda b: math.ceil(f * b)      # noqa: E731
        CostTable({(b, k): 1e-3 * (1 + 0.1 * b + 0.3 * d(b) + 0.02 * k) for b in sizes for k in range(0, d(b) * g + 1)},
                  model_name=f"{name} (draft {f:g})", dtype=dtype, device=device).save(path)
    llm = LLM(str(model), **kw, verify_mode="compact", cost_table=str(path))
    ledger = StepLedger.attach(llm.engine, time.monotonic)
    seen = []
    llm.engine.extra_observers.append(type("Keep", (), {"observe": lambda self, res: seen.append(res)})())
    outs = llm.generate([[5 + i, 9, 11] for i in range(16)], SamplingParams(temperature=0, max_tokens=80,
                                                                            ignore_eos=True))
    assert account(ledger, -np.inf, np.inf, [])["partial_steps"] > 5
    law = SyntheticAcceptance.parse(kw["synthetic_acceptance"])
    gaps = []
    for res in seen:
        d = res.decode
        if d is None or d.requests is None or not 0 < (d.out.drafted != 0).sum() < len(d.slots):
            continue
        rates = law.rates(torch.tensor([r.seed for r in d.requests.tolist()])).numpy()
        on = d.out.drafted != 0
        gaps.append(rates[on].min() - rates[~on].max())
    assert len(gaps) > 5 and min(gaps) >= 0           # every partial step drafted its most confident rows
    assert all(len(o.token_ids) == 80 for o in outs)


def test_the_law_costs_a_drafting_step_few_kernels():
    """The law stands in for a greedy verify (which draws no noise) inside every drafting step:
    its rates and verdict must stay a few dozen small ops, not the sampler's keyed noise (which
    cost 243 ops a step, a quarter of a SmolLM2-shaped drafting step's kernels on the H200)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    R, g, V = 16, 5, 50
    law = SyntheticAcceptance(0.3, 0.6)
    drafts, logits = torch.randint(0, V, (R, g)), torch.randn(R * (g + 1), V)
    row_index, seed = torch.arange(R * (g + 1)).view(R, g + 1), torch.arange(R) * 7919
    full = torch.full((R,), g)
    with Count():
        law.verdict(drafts, logits, row_index, seed, torch.full((R,), 40), full, full, law.rates(seed))
    assert Count.n <= 130
