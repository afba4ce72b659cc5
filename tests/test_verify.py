"""Lossless speculative decoding: greedy identity, sampling distribution, rollback hygiene."""
import itertools
import random

import numpy as np
import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.drafter import Draft
from nanodspark.loader import load_model
from nanodspark.model import DenseAttentionContext
from nanodspark.windows import ForcedWindows
from nanodspark.verify import accept_sampling, verify_block

from conftest import ENGINE_DEVICE, EXACT, make_hf_model, random_drafter
from test_engine import check_no_leak, dense_greedy, prompts


def make_drafter(model_dir, out, gamma=4, seed=0, **kw):
    """A random drafter for the checkpoint at model_dir, saved to out."""
    random_drafter(load_model(model_dir), gamma=gamma, num_layers=1, std=0.1, seed=seed, **kw).save(out)
    return out


# The oracle reads the committed ids on the host, in Python: it needs eager, synchronous steps
# (a captured graph would freeze its Python, and the overlapped loop commits a step late).
ORACLE = dict(cuda_graphs=False, overlap=False)


class OracleDrafter:
    """Stands in for the drafter (the same `propose` / `inject` interface): drafts exactly what the
    target would say (greedy), so every draft is accepted and rollback, windows and block
    boundaries run at full speed. It finds each row's request by its drafter block table."""

    def __init__(self, eng):
        self.eng, self.config = eng, eng.executor.spec.drafter.config

    def propose(self, anchors, anchor_pos, cache, block_tables, block_size, st, ops, stream, kv_start=None):
        dg = self.eng.worker.draft_group    # the group whose tables the drafter reads
        by_block = {r.tables[dg].blocks[0]: r for r in self.eng.scheduler.running if r.tables.get(dg)}
        first = block_tables[:, 0].tolist()
        g = self.config.gamma
        rows = [dense_greedy(self.eng.model, by_block[b].all_ids, g) if b in by_block else [0] * g for b in first]
        toks = torch.tensor(rows, device=anchors.device)
        conf = torch.full(toks.shape, 0.9, device=anchors.device)
        return Draft(toks, None, torch.zeros(toks.shape, device=anchors.device), conf)

    def inject(self, *args, **kwargs):
        pass


def use_oracle(eng):
    """Draft with `OracleDrafter`. Build the engine with **ORACLE: its drafts are read from the
    requests on the host, so it needs eager, synchronous steps."""
    assert not (eng.config.cuda_graphs or eng.config.overlap) or eng.device.type != "cuda", "build it with **ORACLE"
    eng.executor.spec.drafter = OracleDrafter(eng)


def force_windows(eng, fn):
    eng.windows = ForcedWindows(eng.gamma, fn)


@pytest.fixture(scope="module")
def drafter_dir(tiny_dir, tmp_path_factory):
    return make_drafter(tiny_dir, tmp_path_factory.mktemp("drafter"))


@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_spec_equals_target_only(tiny_dir, drafter_dir, mode, oracle):
    base = LLM(str(tiny_dir), use_tqdm=False, **EXACT)
    spec = LLM(str(tiny_dir), use_tqdm=False, **EXACT, **(ORACLE if oracle else {}), drafter_path=str(drafter_dir),
               verify_mode=mode, block_size=4)
    eng = spec.engine
    if oracle:
        use_oracle(eng)
    rng = random.Random(mode)
    force_windows(eng, lambda reqs: [rng.randint(0, eng.gamma) for _ in reqs])
    vocab = eng.model_config.vocab_size
    for bs in (1, 5, 16):
        ps = prompts(bs, vocab, seed=bs, lo=3, hi=30)
        params = SamplingParams(temperature=0, max_tokens=rng.randint(5, 14), ignore_eos=True)
        want = [o.token_ids for o in base.generate(ps, params)]
        got = spec.generate(ps, params)
        assert [o.token_ids for o in got] == want
        steps = sum(o.spec["steps"] for o in got)
        committed = sum(o.spec["committed"] for o in got)
        assert steps > 0 and committed == sum(len(t) for t in want) - len(want)  # first token comes from prefill
        if oracle:          # the target's own tokens: every verified draft is accepted, in every mode
            assert all(o.spec["accepted"] == o.spec["verified"] for o in got)
    check_no_leak(spec)


def exact_continuation_dist(model, prompt, n, vocab):
    """P(x_1..x_n | prompt) at temperature 1 by enumeration through the dense forward."""
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n):
            ids = list(prompt) + list(seq)
            S = len(ids)
            out = model(torch.tensor(ids), torch.arange(S), DenseAttentionContext(1, S))
            lp = torch.log_softmax(model.compute_logits(out.hidden), -1)
            probs[seq] = float(sum(lp[len(prompt) - 1 + i, seq[i]] for i in range(n)).exp())
    return probs


def steep_cost_table(model_dir, path):
    """A synthetic step-cost profile with a cliff: verifying more than 2.5 drafts per request
    costs 50 % more, so the cost scheduler really trims about half the windows (a flat table
    would fall back to static)."""
    from nanodspark.cost_table import CostTable
    meas = {(bs, k): 1e-3 * (1 + bs) * (1.0 + 0.5 * (k > 2.5 * bs)) + 1e-6 * k for bs in (1, 8, 64, 512)
            for k in sorted({round(3 * bs * i / 12) for i in range(13)})}
    CostTable(measurements=meas, model_name=str(model_dir), dtype=str(torch.float32), device=ENGINE_DEVICE).save(path)
    return str(path)


@pytest.mark.parametrize("mode, windows", [("static", "full"), ("compact", "forced"), ("cap-accept", "scheduler")],
                         ids=["static", "compact-forced", "cap-accept-scheduler"])
def test_sampling_spec_follows_target_distribution(tmp_path, mode, windows):
    """Exact distribution test. In compact the windows are random (forced, chosen without looking
    at the drafts); in cap-accept they come from the real cost scheduler (lagged budget, fresh
    top-K); both really trim. (This random drafter's confidences depend too weakly on the
    sampled tokens for a non-causal budget to show at this sample size; the Appendix A
    construction in test_cost_scheduler.py is the test that catches that.) The course grades the
    verifier on the first two: the third runs the cost scheduler too."""
    V, n, N = 5, 3, 2500
    d, _ = make_hf_model("qwen3", tmp_path / "m", vocab_size=V, num_hidden_layers=2, seed=3)
    ddir = make_drafter(d, tmp_path / "d", gamma=3, seed=4)
    target = load_model(d)
    prompt = [1, 3, 0, 2]
    exact = exact_continuation_dist(target, prompt, n, V)
    table = steep_cost_table(d, tmp_path / "cost.json") if windows == "scheduler" else None
    llm = LLM(str(d), use_tqdm=False, **EXACT, drafter_path=str(ddir), max_num_seqs=512, seed=7, verify_mode=mode,
              cost_table=table)
    if windows == "forced":
        rng = random.Random(5)
        force_windows(llm.engine, lambda reqs: [rng.randint(0, 3) for _ in reqs])
    chosen = []
    llm.engine.extra_observers.append(WindowLog(chosen))
    outs = llm.generate([prompt] * N, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True))
    if mode != "static":
        if windows == "scheduler":
            assert llm.engine.windows.scheduler.effective_mode() == mode
        trimmed = sum(w < 3 for w in chosen) / len(chosen)
        assert 0.05 < trimmed < 1.0, f"the scheduler should trim some windows and not all ({trimmed:.2f})"
    chi2 = continuation_chi2(outs, exact)
    # df = 124; P(chi2 > 190) ~ 1e-4 under the null
    assert chi2 < 190, chi2
    acc = acceptance(outs)
    assert 0.05 < acc < 0.95, acc  # rejections and residual samples really happened
    check_no_leak(llm)


def continuation_chi2(outs, exact: dict) -> float:
    """Pearson's chi-square of the generated continuations against their exact distribution."""
    counts = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    n = len(outs)
    return sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in exact.items())


def acceptance(outs) -> float:
    """Accepted drafts over verified drafts, over all requests."""
    return sum(o.spec["accepted"] for o in outs) / max(1, sum(o.spec["verified"] for o in outs))


class WindowLog:
    """An observer of step results: the windows the device chose."""

    def __init__(self, out):
        self.out = out

    def observe(self, result):
        if result.decode is not None:
            self.out.extend(result.decode.out.windows.tolist())


def test_accept_sampling_matches_target_on_one_position():
    """Exact distribution of the committed token after one draft, vs p, by enumeration-free MC."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.7, 0.2, 0.1], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.2, 0.5, 0.3]])
    counts = torch.zeros(3)
    for _ in range(20000):
        d = torch.multinomial(q[0], 1, generator=g)
        vr = verify_block(d, p, q, window=1, mode="static", greedy=False, generator=g)
        counts[vr.tokens[0]] += 1
    assert torch.allclose(counts / counts.sum(), p[0], atol=0.015)


def test_cap_accept_commits_what_compact_would():
    drafts = torch.tensor([1, 2, 0, 1])
    probs = torch.nn.functional.one_hot(torch.tensor([1, 2, 0, 1, 2]), 3).float()  # target agrees everywhere
    full = verify_block(drafts, probs, None, window=2, mode="cap-accept", greedy=True, generator=None)
    compact = verify_block(drafts, probs[:3], None, window=2, mode="compact", greedy=True, generator=None)
    assert full.tokens == compact.tokens == [1, 2, 0] and full.ceiling == 4 and full.accepted == 2


def test_residual_is_renormalised():
    p = torch.tensor([[0.0, 0.6, 0.4], [1 / 3] * 3])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    m, res = accept_sampling(torch.tensor([0]), q, p, torch.Generator().manual_seed(1))
    assert m == 0  # p(d) = 0: always rejected
    assert torch.allclose(res, torch.tensor([0.0, 0.2, 0.8]))  # norm(max(0, p - q))


@pytest.mark.parametrize("mode", ["compact", "cap-accept"])
def test_block_accept_ceiling_sees_through_trimming(tiny_dir, drafter_dir, mode):
    """With an oracle drafter every draft would be accepted by a full verify: however the windows
    are trimmed, the estimated ceiling is gamma + 1 committed tokens per step, and what trimming
    delivered is (mean window + 1)."""
    llm = LLM(str(tiny_dir), use_tqdm=False, **EXACT, **ORACLE, drafter_path=str(drafter_dir), verify_mode=mode)
    eng = llm.engine
    use_oracle(eng)
    rng = random.Random(1)
    force_windows(eng, lambda reqs: [rng.randint(1, eng.gamma - 1) for _ in reqs])
    ps = prompts(4, llm.engine.model_config.vocab_size, seed=3)
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    m = eng.metrics
    est = m.ceiling.estimate()
    assert est.records > 10 and not m.pending.any()
    assert est.ceiling == pytest.approx(eng.gamma + 1, abs=0.35)   # the last blocks are cut by max_tokens
    assert est.utilisation < 0.8 and est.delivered == pytest.approx(est.mean_window + 1)
    assert m.summary()["ceiling"]["utilisation"] == est.utilisation


def test_token_budget_must_hold_a_verify_window(tiny_dir, drafter_dir):
    with pytest.raises(ValueError, match="verify window"):
        LLM(str(tiny_dir), drafter_path=str(drafter_dir), max_num_batched_tokens=3)


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_full_prefix_hit_reserves_a_whole_verify_window(tmp_path_factory, mode):
    """On a target with only full attention (like SmolLM2: no sliding window, so no SWA replay),
    a prompt of k * block_size + 1 tokens that is fully cached leaves only its last token to
    compute, and is admitted straight into decoding: it needs slots for anchor + gamma drafts in
    its very first step (the engine once reserved only its tokens, and the commit overran the
    table). Repeating the prompts, greedy then sampled, must stay target-only greedy and leak
    nothing."""
    target, _ = make_hf_model("llama", tmp_path_factory.mktemp("llama_full"), vocab_size=8192)
    ddir = make_drafter(target, tmp_path_factory.mktemp("llama_drafter"))
    base = LLM(str(target), use_tqdm=False, **EXACT)
    spec = LLM(str(target), use_tqdm=False, **EXACT, drafter_path=str(ddir), verify_mode=mode, block_size=4)
    assert "sliding" not in spec.engine.scheduler.managers
    ps = [p[:n] for p, n in zip(prompts(6, 8192, seed=11, lo=30, hi=40), (9, 13, 17, 10, 21, 5))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in base.generate(ps, greedy)]
    for _ in range(2):  # the second pass hits the prefix cache for every prompt
        assert [o.token_ids for o in spec.generate(ps, greedy)] == want
    sampled = spec.generate(ps, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3))
    assert all(len(o.token_ids) == 12 for o in sampled)
    check_no_leak(spec)
    # A pool too small for the batch: preempted requests come back through admission, where
    # their own published blocks are prefix hits.
    small = LLM(str(target), use_tqdm=False, **EXACT, drafter_path=str(ddir), verify_mode=mode, block_size=4,
                num_kv_blocks=24)
    preempted = []
    orig = small.engine.scheduler.preempt
    small.engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), orig(r))
    for _ in range(2):
        assert [o.token_ids for o in small.generate(ps, greedy)] == want
    assert preempted, "the test did not exercise preemption"
    check_no_leak(small)


@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_coupled_sampling_gives_target_only_tokens(tiny_dir, drafter_dir, mode):
    """Seeded sampled requests (T = 1, and with top-p / top-k) give the same tokens with
    speculation as without, at batch 1 and beside other random requests, in every verify mode:
    drafts and verification share the target's noise (coupled_sampling)."""
    base = LLM(str(tiny_dir), use_tqdm=False, **EXACT)
    spec = LLM(str(tiny_dir), use_tqdm=False, **EXACT, drafter_path=str(drafter_dir), verify_mode=mode, block_size=4,
               coupled_sampling=True)
    rng = random.Random(mode)
    force_windows(spec.engine, lambda reqs: [rng.randint(0, spec.engine.gamma) for _ in reqs])
    ps = prompts(8, 8192, seed=31, lo=4, hi=30)
    kinds = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=20)]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, seed=100 + i, **kinds[i % 3]) for i in range(8)]
    want = [o.token_ids for o in base.generate(ps, params)]
    assert [o.token_ids for o in spec.generate(ps[:1], params[:1])] == want[:1]        # alone
    mixed = spec.generate(ps, params)                                                   # beside others
    assert [o.token_ids for o in mixed] == want
    assert sum(o.spec["accepted"] for o in mixed) > 0            # the drafter's coupled drafts were taken
    check_no_leak(spec)


def test_coupled_sampling_follows_target_distribution(tmp_path):
    """The coupled sampler is target-only sampling, so its output follows the target exactly
    (chi-square over all 125 continuations, as above)."""
    V, n, N = 5, 3, 2500
    d, _ = make_hf_model("qwen3", tmp_path / "m", vocab_size=V, num_hidden_layers=2, seed=3)
    ddir = make_drafter(d, tmp_path / "d", gamma=3, seed=4)
    exact = exact_continuation_dist(load_model(d), [1, 3, 0, 2], n, V)
    llm = LLM(str(d), use_tqdm=False, drafter_path=str(ddir), max_num_seqs=512, coupled_sampling=True)
    outs = llm.generate([[1, 3, 0, 2]] * N, [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)
                                             for i in range(N)])
    chi2 = continuation_chi2(outs, exact)
    assert chi2 < 190, chi2
    acc = acceptance(outs)
    assert 0.02 < acc < 0.98, acc


class AlternatePlain:
    """A window policy that drafts full blocks on even steps and runs plain steps (no drafter
    pass) on odd ones: the drafter must resume from a context the plain steps kept whole."""

    def __init__(self, gamma):
        self.gamma = gamma

    def plan(self, rows, step):
        from nanodspark.step import WindowPlan
        return WindowPlan(len(rows.slots) * self.gamma, False, draft=step % 2 == 0)

    def observe(self, result):
        pass


class CyclePartial:
    """A window policy cycling through every row drafting, a share drafting, none drafting; the
    drafting rows are a shuffled pick (the plan's `order`), so any row may be first or skip."""

    def __init__(self, gamma, shares=(1.0, 0.5, 0.0, 0.25)):
        self.gamma, self.shares, self.rng = gamma, shares, np.random.default_rng(7)
        self.partial_rows = 0

    def plan(self, rows, step):
        from nanodspark.step import WindowPlan
        R, f = len(rows.slots), self.shares[step % len(self.shares)]
        order = self.rng.permutation(R) if 0 < f < 1 else None
        self.partial_rows += (0 < f < 1) * (R - int(np.ceil(f * R)))
        return WindowPlan(R * self.gamma, False, draft=f, order=order)

    def observe(self, result):
        pass


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "coupled-sampled"])
def test_a_share_of_the_rows_drafting_keeps_target_only_tokens(tiny_dir, drafter_dir, sampled):
    """Steps where only some requests (a shuffled pick) run the drafter's pass, between full and
    plain steps: the tokens are target-only decoding's (greedy; and seeded sampling with coupled
    noise), the rows that did not draft count no drafts, and no KV block leaks."""
    ps = prompts(5, 8192, seed=41, lo=4, hi=40)       # 5 rows in a tier of 8: its drafter pass covers more rows
    if sampled:
        params = [SamplingParams(max_tokens=16, ignore_eos=True, seed=200 + i, temperature=1.0) for i in range(5)]
    else:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(tiny_dir), use_tqdm=False, **EXACT, drafter_path="none").generate(ps, params)]
    llm = LLM(str(tiny_dir), use_tqdm=False, **EXACT, drafter_path=str(drafter_dir), coupled_sampling=sampled,
              enable_prefix_cache=False)
    policy = llm.engine.windows = CyclePartial(llm.engine.gamma)
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == want
    g = llm.engine.gamma
    steps, drafted = sum(o.spec["steps"] for o in outs), sum(o.spec["drafted"] for o in outs)
    assert policy.partial_rows > 0 and drafted < steps * g and drafted % g == 0
    assert all(o.spec["verified"] <= o.spec["drafted"] for o in outs)
    assert sum(o.spec["accepted"] for o in outs) > 0 or not sampled     # coupled drafts are taken
    check_no_leak(llm)


def _draft_context(llm, prompt, n):
    """Greedy output of one request, and the drafter's context K/V at its committed positions."""
    eng, seen = llm.engine, {}

    class Blocks:
        def observe(self, result):
            for r in eng.scheduler.running:
                seen["blocks"] = list(r.tables[eng.worker.draft_group].blocks)
    eng.extra_observers.append(Blocks())
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
    bs, L = eng.config.block_size, len(prompt) + n - 1           # the last token never reached the target
    pos = torch.arange(L)
    blocks = torch.tensor(seen["blocks"])[pos // bs]
    return out, eng.worker.draft_cache[:, :, blocks, pos % bs].float()


def test_plain_steps_keep_output_and_the_drafters_context(tiny_dir, drafter_dir):
    """Plain steps between drafting steps: greedy output equals target-only decoding, and the
    drafter's context cache holds the same K/V at every committed position as an engine that
    drafted every step (a plain step injects its anchor row's features)."""
    prompt, n = prompts(1, 200, seed=3)[0], 40
    want = LLM(str(tiny_dir), use_tqdm=False, **EXACT, drafter_path="none").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
    kw = dict(use_tqdm=False, **EXACT, **ORACLE, drafter_path=str(drafter_dir), enable_prefix_cache=False)
    every = LLM(str(tiny_dir), **kw)
    out_a, ctx_a = _draft_context(every, prompt, n)
    mixed = LLM(str(tiny_dir), **kw)
    mixed.engine.windows = AlternatePlain(mixed.engine.gamma)
    out_b, ctx_b = _draft_context(mixed, prompt, n)
    assert out_a == out_b == want
    assert torch.allclose(ctx_a, ctx_b, atol=1e-4), (ctx_a - ctx_b).abs().max()
    check_no_leak(mixed)


@pytest.mark.parametrize("plain_ms, plain_steps, clock", [(0.01, True, False), (100.0, False, False),
                                                          (0.01, True, True)],
                         ids=["plain-cheap", "plain-dear", "plain-cheap-step-clock"])
def test_compact_runs_plain_steps_only_where_they_pay(tiny_dir, drafter_dir, tmp_path, plain_ms, plain_steps, clock):
    """With the target's own profile in the cost file, compact runs plain steps where a plain
    step beats drafting (a cheap target) and never where it does not (a dear one); greedy output
    is target-only's either way (with the step clock too), and the drafted counts say what ran."""
    from nanodspark.cost_table import CostTable
    path = tmp_path / "cost.json"
    steep_cost_table(tiny_dir, path)
    CostTable({(b, 0): 1e-3 * plain_ms for b in (1, 8, 64, 512)}, model_name=f"{tiny_dir} (no drafter)",
              dtype=str(torch.float32), device=ENGINE_DEVICE).save(path)
    ps = prompts(6, 200, seed=5)
    llm = LLM(str(tiny_dir), use_tqdm=False, **EXACT, drafter_path=str(drafter_dir), verify_mode="compact",
              cost_table=str(path), enable_prefix_cache=False, verify_step_clock=clock)
    assert llm.engine.windows.scheduler.plain_table is not None
    assert llm.engine.windows.scheduler.step_clock is clock
    import time
    from nanodspark.lab.traces import StepLedger
    ledger = StepLedger.attach(llm.engine, time.monotonic)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    marked = int((ledger.table()["budget"] < 0).sum())          # the ledger marks plain steps (budget -1)
    assert (marked > 0) == plain_steps
    base = LLM(str(tiny_dir), use_tqdm=False, **EXACT, drafter_path="none")
    assert [o.token_ids for o in outs] == [o.token_ids for o in base.generate(
        ps, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    drafted = sum(o.spec["drafted"] for o in outs)
    steps = sum(o.spec["steps"] for o in outs)
    g = llm.engine.gamma
    # every decode step counted, plain or not: the tokens after the prefill's one, and one step each at least
    assert all(o.spec["committed"] == len(o.token_ids) - 1 == o.spec["accepted"] + o.spec["steps"] for o in outs)
    if plain_steps:
        assert drafted < steps * g and all(o.spec["verified"] <= o.spec["drafted"] for o in outs)
    else:
        assert drafted == steps * g
    check_no_leak(llm)
