"""Tests of nanodspark/cost_scheduler.py: Algorithm 1 (incl. the paper's Appendix A
counterexample, computed exactly), the device top-K against Algorithm 1's order of cells, the
lagged budget, the relay, the scheduler modes and the block-accept ceiling (the cost table:
test_cost_table.py).
(Paper §3.2.2, App. A, §5.2; walkthrough chapter 07.)"""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanodspark.cost_scheduler import (
    ConfidenceRelay, CostScheduler, algorithm1, budget_from_lagged, choose_windows, descending_cells, topk_windows,
)
from nanodspark.cost_table import CostTable
from nanodspark.observers import BlockAcceptEstimator, wilson_interval


# ---------------------------------------------------------------------------------------------
# Algorithm 1
# ---------------------------------------------------------------------------------------------

def test_algorithm1_hand_example():
    # survivals: r0 = (0.9, 0.45), r1 = (0.6, 0.3); order 0.9, 0.6, 0.45, 0.3
    conf = [[0.9, 0.5], [0.6, 0.5]]
    sps = {2: 10.0, 3: 9.5, 4: 9.0, 5: 7.0, 6: 6.5}.__getitem__
    # Theta: B=2 -> 20 ; +0.9 -> 2.9*9.5 = 27.55 ; +0.6 -> 3.5*9 = 31.5 ; +0.45 -> 3.95*7 = 27.65 stop
    assert algorithm1(conf, sps).tolist() == [1, 1]


def test_algorithm1_stops_at_first_non_improvement():
    # Theta(B): 1*1 = 1, then 2*0.4 = 0.8 (drop -> stop), although B=4 would give 4*1 = 4
    sps = {1: 1.0, 2: 0.4, 3: 1.0, 4: 1.0}.__getitem__
    assert algorithm1([[1.0, 1.0, 1.0]], sps).tolist() == [0]


def test_algorithm1_tie_break_lower_position_then_request():
    sps = {2: 1.0, 3: 0.9, 4: 0.5, 5: 0.1, 6: 0.1}.__getitem__
    # all survivals 1: order (r0,k1), (r1,k1), (r0,k2), ... ; B=3 improves (2.7 > 2), B=4 does not
    assert algorithm1([[1.0, 1.0], [1.0, 1.0]], sps).tolist() == [1, 0]
    assert [(r, k) for r, k, _ in descending_cells([[1, 1], [1, 1]])] == [(0, 1), (1, 1), (0, 2), (1, 2)]


def test_algorithm1_skips_zero_survival_and_admits_all_when_free():
    sps = lambda b: 1.0                                    # noqa: E731 - a flat SPS: every token pays
    assert algorithm1([[0.5, 0.0, 0.9], [1.0, 1.0, 1.0]], sps).tolist() == [1, 3]


# ---------------------------------------------------------------------------------------------
# Appendix A: retrospective global argmax over current confidences is not lossless
# ---------------------------------------------------------------------------------------------

P_TARGET = np.array([0.7, 0.3])      # target distribution of the first token (tokens A, B)
P_DRAFT = np.array([0.5, 0.5])       # draft distribution of the first token
C1 = 0.8                             # confidence of position 1 (does not depend on x_1)
C2 = {0: 0.9, 1: 0.1}                # confidence of position 2 depends on x_1 (Markov feature)
SPS = {1: 1.0, 2: 0.5, 3: 0.45}


def first_token_distribution(window_of) -> np.ndarray:
    """Exact law of the first committed token when the window depends on (conf, x_1).

    window_of(conf [1, 2], x1) -> window. If the window is 0 the target samples the token
    itself (the bonus); otherwise x_1 is verified by speculative sampling: accepted with
    min(1, p_t/p_d), else replaced by a sample of norm(max(0, p_t - p_d)).
    """
    residual = np.maximum(P_TARGET - P_DRAFT, 0.0)
    residual /= residual.sum()
    out = np.zeros(2)
    for x1 in (0, 1):
        conf = torch.tensor([[C1, C2[x1]]])
        if window_of(conf, x1) == 0:
            out += P_DRAFT[x1] * P_TARGET
        else:
            accept = min(1.0, P_TARGET[x1] / P_DRAFT[x1])
            out += P_DRAFT[x1] * (accept * np.eye(2)[x1] + (1 - accept) * residual)
    return out


def retrospective_global_argmax(conf) -> int:
    """Window of a single request chosen by the global argmax of Theta over all prefixes."""
    a = torch.cumprod(conf[0].double(), 0).tolist()
    thetas = [(1 + sum(a[:w])) * SPS[1 + w] for w in range(len(a) + 1)]
    return int(np.argmax(thetas))


def test_appendix_a_counterexample_exact():
    # the setting is the one that makes trimming matter: Theta(0)=1.0, Theta(1)=0.9,
    # Theta(2)=(1.8 + 0.8*c2)*0.45, which beats 1.0 iff c2 > 0.528 -- i.e. iff x_1 = A
    assert retrospective_global_argmax(torch.tensor([[C1, C2[0]]])) == 2
    assert retrospective_global_argmax(torch.tensor([[C1, C2[1]]])) == 0

    # 1) global argmax over *current* confidences: x_1 = A is always admitted (and accepted),
    #    x_1 = B never is -> the output is skewed towards A
    skewed = first_token_distribution(lambda conf, x1: retrospective_global_argmax(conf))
    assert skewed == pytest.approx([0.85, 0.15])

    # the same leak through the production functions fed with current (not lagged) survivals
    def leaky(conf, x1):
        k = budget_from_lagged(torch.cumprod(conf, 1), lambda bs, k: 1.0 / SPS[bs + k], min_gain=0.0)
        return int(topk_windows(conf, k)[0])
    assert first_token_distribution(leaky) == pytest.approx([0.85, 0.15])

    # 2) Algorithm 1 with its early stop: Theta drops at the first admission, so x_1 is never
    #    used to decide its own admission and the target law is kept
    assert algorithm1(torch.tensor([[C1, C2[0]]]), SPS.__getitem__).tolist() == [0]
    causal = first_token_distribution(lambda conf, x1: int(algorithm1(conf, SPS.__getitem__)[0]))
    assert causal == pytest.approx([0.7, 0.3])

    # 3) production: the budget comes from lagged confidences (independent of x_1); for any such
    #    budget the fresh top-K admits x_1 iff a_1 is in the top K, which x_1 cannot change
    for budget in (0, 1, 2):
        law = first_token_distribution(lambda conf, x1: int(topk_windows(conf, budget)[0]))
        assert law == pytest.approx([0.7, 0.3])


# ---------------------------------------------------------------------------------------------
# top-K allocation
# ---------------------------------------------------------------------------------------------

conf_values = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0))


@st.composite
def conf_and_budget(draw):
    R, gamma = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    conf = torch.tensor(draw(st.lists(st.lists(conf_values, min_size=gamma, max_size=gamma),
                                      min_size=R, max_size=R)), dtype=torch.float32)
    return conf, draw(st.integers(0, R * gamma + 3))


def brute_force_top_k(conf, budget):
    """The admitted set by definition: first `budget` positive cells in (-a, k, r) order."""
    a = torch.cumprod(conf, dim=1).tolist()               # same float32 arithmetic as the code
    return {(r, k) for r, k, _ in descending_cells(a)[:budget]}


@settings(max_examples=200, deadline=None)
@given(conf_and_budget())
def test_topk_window_iff_in_top_k_and_contiguous(case):
    """The device top-K admits exactly the first `budget` cells of Algorithm 1's order."""
    conf, budget = case
    windows = topk_windows(conf, budget).tolist()
    top = brute_force_top_k(conf, budget)
    R, gamma = conf.shape
    for r in range(R):
        for k in range(1, gamma + 1):
            assert (windows[r] >= k) == ((r, k) in top)
    # the theorem behind it: the top-K set is prefix-closed (contiguous windows)
    assert all(k == 1 or (r, k - 1) in top for r, k in top)
    n_positive = int((torch.cumprod(conf, 1) > 0).sum())
    assert sum(windows) == min(budget, n_positive)


@settings(max_examples=200, deadline=None)
@given(conf_and_budget(), st.data())
def test_topk_admission_of_x_k_ignores_what_depends_on_x_k(case, data):
    """Causality: c_{r,k+1..} depend on x_{r,k}; changing them must not change window_r >= k."""
    conf, budget = case
    R, gamma = conf.shape
    r, k = data.draw(st.integers(0, R - 1)), data.draw(st.integers(1, gamma))
    other = conf.clone()
    other[r, k:] = torch.tensor(data.draw(st.lists(conf_values, min_size=gamma - k, max_size=gamma - k)))
    before = topk_windows(conf, budget)[r] >= k
    after = topk_windows(other, budget)[r] >= k
    assert bool(before) == bool(after)


def test_topk_tie_break_examples():
    ones = torch.ones(2, 2)
    assert topk_windows(ones, 1).tolist() == [1, 0]
    assert topk_windows(ones, 2).tolist() == [1, 1]
    assert topk_windows(ones, 3).tolist() == [2, 1]
    assert topk_windows(ones, 99).tolist() == [2, 2]
    assert topk_windows(torch.tensor([[0.0, 1.0], [0.5, 1.0]]), 4).tolist() == [0, 2]
    assert topk_windows(torch.tensor([[float("nan"), 1.0], [0.5, 2.0]]), 4).tolist() == [0, 2]   # NaN as 0, clamped
    out = topk_windows(torch.tensor([[0.9, 0.9]], dtype=torch.bfloat16), 1)
    assert out.dtype == torch.int64 and out.tolist() == [1]
    # an inactive row admits nothing and leaves the budget to the others
    assert topk_windows(ones, 2, torch.tensor([False, True])).tolist() == [0, 2]
    assert topk_windows(ones, torch.tensor(3)).tolist() == [2, 1]          # the budget as a device scalar


def step_windows(conf, budget, trim, cap=None, active=None):
    R, g = conf.shape
    return choose_windows(conf, torch.ones(R, dtype=torch.bool) if active is None else active,
                          torch.tensor(budget), torch.tensor(trim),
                          torch.full((R,), g, dtype=torch.long) if cap is None else torch.tensor(cap))


def test_choose_windows_trims_with_trim_only_and_caps_every_window():
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.2, 0.2, 0.2]])
    assert step_windows(conf, 2, False).tolist() == [3, 3]                # no trim: full blocks, whatever the budget
    assert step_windows(conf, 2, True).tolist() == topk_windows(conf, 2).tolist() == [2, 0]
    assert step_windows(conf, 4, True, cap=[1, 3]).tolist() == [1, 1]     # window_cap bounds either way
    assert step_windows(conf, 0, False, cap=[1, 3]).tolist() == [1, 3]
    assert step_windows(conf, 2, True, active=torch.tensor([False, True])).tolist() == [0, 2]
    assert step_windows(torch.zeros(2, 0), 0, True).tolist() == [0, 0]    # plain decoding: no drafts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
def test_topk_on_gpu_matches_cpu_without_host_sync():
    g = torch.Generator().manual_seed(0)
    conf = torch.randint(0, 5, (64, 7), generator=g) / 4.0          # many exact ties
    active = torch.rand(64, generator=g) < 0.8
    cap = torch.randint(0, 8, (64,), generator=g)
    for budget in (0, 1, 37, 150, 64 * 7):
        for trim in (True, False):
            ref = choose_windows(conf, active, torch.tensor(budget), torch.tensor(trim), cap)
            args = [x.cuda() for x in (conf, active, torch.tensor(budget), torch.tensor(trim), cap)]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")                 # any device->host sync raises
            try:
                out = choose_windows(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert out.device == args[0].device and torch.equal(out.cpu(), ref)


# ---------------------------------------------------------------------------------------------
# budget from lagged survivals
# ---------------------------------------------------------------------------------------------

def linear_cost(bs, k):
    return 1.0 + 0.5 * k


def test_budget_hand_example_and_min_gain_guard():
    s = torch.tensor([[0.9, 0.5, 0.1]])
    # Theta(K) = (1 + cumsum) / (1 + K/2): 1, 1.267, 1.2, 1.0 -> K = 1
    assert budget_from_lagged(s, linear_cost) == 1
    assert budget_from_lagged(s, linear_cost, min_gain=0.3) == 3      # 1.267 < 1.3 * 1.0: no trim


def test_budget_is_a_global_search():
    # Theta: 1/1, 2/2.5 = 0.8 (a dip), 3/2.5 = 1.2, 4/10 = 0.4 -> K = 2 (early stop would say 0)
    times = {0: 1.0, 1: 2.5, 2: 2.5, 3: 10.0}
    assert budget_from_lagged(torch.ones(1, 3), lambda bs, k: times[k], min_gain=0.0) == 2


def test_budget_flat_cost_gives_full_budget():
    s = torch.full((3, 4), 0.01)
    assert budget_from_lagged(s, lambda bs, k: 1.0) == 12
    flat = CostTable({(b, k): 1e-3 for b in (1, 2, 4) for k in (0, 4, 8)})
    assert flat.is_flat()
    assert budget_from_lagged(s, flat) == 12
    assert budget_from_lagged(torch.zeros(0, 4), linear_cost) == 0


def test_budget_drops_tiny_survivals():
    s = torch.tensor([[1e-9, 1e-9]])
    # with eps, both cells add nothing: K = 0 is the best (cost grows)
    assert budget_from_lagged(s, linear_cost, min_gain=0.0) == 0


# ---------------------------------------------------------------------------------------------
# relay
# ---------------------------------------------------------------------------------------------

def test_relay_lag_and_generation_guard():
    relay = ConfidenceRelay(max_slots=4, gamma=2, lag=2)
    assert torch.equal(relay.lagged([0, 1], [7, 7], step=1), torch.ones(2, 2))   # nothing yet
    relay.push(0, [0, 1], [7, 8], torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    relay.push(1, [0, 1], [7, 8], torch.tensor([[0.2, 0.2], [0.3, 0.3]]))
    got = relay.lagged([0, 1, 2], [7, 8, 1], step=2)            # reads step 0
    assert torch.allclose(got, torch.tensor([[0.5, 0.25], [0.9, 0.09], [1.0, 1.0]]))  # slot 2: missing
    assert torch.allclose(relay.lagged([1, 0], [8, 7], step=3), torch.tensor([[0.3, 0.09], [0.2, 0.04]]))
    # slot 1 recycled to a new request (generation 9): its old entry is not trusted
    assert torch.equal(relay.lagged([1], [9], step=3), torch.ones(1, 2))
    # slot 0 not pushed at step 2, so at step 4 (reads step 2) it is stale
    relay.push(2, [1], [8], torch.tensor([[0.5, 0.5]]))
    assert torch.equal(relay.lagged([0], [7], step=4), torch.ones(1, 2))
    assert torch.allclose(relay.lagged([1], [8], step=4), torch.tensor([[0.5, 0.25]]))
    with pytest.raises(ValueError):
        ConfidenceRelay(4, 2, lag=0)


def test_relay_ring_does_not_alias_after_wraparound():
    relay = ConfidenceRelay(max_slots=1, gamma=1, lag=2)
    for step in range(10):
        relay.push(step, [0], [0], torch.tensor([[step / 10]]))
        if step >= 1:   # planning step + 1 reads step - 1
            assert relay.lagged([0], [0], step=step + 1).item() == pytest.approx((step - 1) / 10)


# ---------------------------------------------------------------------------------------------
# the scheduler
# ---------------------------------------------------------------------------------------------

def trimming_table():
    """Verify tokens are expensive: trimming pays off when survivals are low."""
    return CostTable({(b, k): 1.0 + 0.1 * b + 0.5 * k for b in (1, 2, 4) for k in range(0, 17)})


def test_scheduler_static_mode():
    sched = CostScheduler(gamma=3, max_slots=8, mode="static")
    budget, trim, predicted = sched.budget([0, 1], [0, 0], step=0)
    assert (budget, trim) == (6, False) and np.isnan(predicted)


def test_scheduler_without_table_warns_once_and_falls_back():
    sched = CostScheduler(gamma=3, max_slots=8, mode="compact")
    with pytest.warns(UserWarning, match="cost table"):
        assert sched.budget([0], [0], 0)[:2] == (3, False)
    assert sched.effective_mode() == "static"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.budget([0], [0], 1)
    with pytest.warns(UserWarning):
        CostScheduler(3, 8, "cap-accept", CostTable({(1, 0): 1.0, (1, 3): 1.0})).budget([0], [0], 0)
    with pytest.raises(ValueError):
        CostScheduler(3, 8, mode="bogus")


def plan_step(sched, step, slots, gens, conf):
    """One verify step as the engine runs it: the host's budget (lagged), the device's windows
    (fresh top-K under it), then the step's confidences pushed into the relay."""
    budget, trim, predicted = sched.budget(slots, gens, step)
    windows = step_windows(conf, budget, trim)
    sched.record(step, slots, gens, conf)
    return budget, windows, predicted


def test_scheduler_compact_uses_lagged_budget_and_fresh_windows():
    sched = CostScheduler(gamma=3, max_slots=8, mode="compact", cost_table=trimming_table())
    low = torch.tensor([[0.9, 0.2, 0.2], [0.5, 0.2, 0.2]])
    high = torch.tensor([[0.99, 0.99, 0.99], [0.1, 0.1, 0.1]])
    slots, gens = [3, 5], [1, 1]
    b0, _, _ = plan_step(sched, 0, slots, gens, low)      # steps 0 and 1: no lagged data -> survival 1
    b1, _, _ = plan_step(sched, 1, slots, gens, high)
    assert b0 == b1 == budget_from_lagged(torch.ones(2, 3), trimming_table())
    b2, w2, predicted = plan_step(sched, 2, slots, gens, high)     # step 2: budget from step 0's (low) confidences
    expected_budget = budget_from_lagged(torch.cumprod(low, 1), trimming_table())
    assert b2 == expected_budget < 6                        # the table says trim, and it trims
    assert torch.equal(w2, topk_windows(high, expected_budget)) and int(w2.sum()) == expected_budget
    assert predicted == pytest.approx(trimming_table().predict(2, expected_budget))
    # a recycled slot (new generation) gets survival 1 for its lagged row
    b3, _, _ = plan_step(sched, 3, [3, 5], [1, 2], high)
    lagged = torch.cumprod(high, 1)
    lagged[1] = 1.0
    assert b3 == budget_from_lagged(lagged, trimming_table())


def test_scheduler_skips_the_search_where_no_trim_can_pass_the_guard():
    """Where T(full) <= (1 + min_gain) * min T the search is skipped (full budget), and that is
    exactly what the search would have found, for any survivals; elsewhere it still trims."""
    table = CostTable({(2, 0): 10.0, (2, 3): 10.2, (2, 6): 10.39,        # +3.9 %: never trims
                       (4, 0): 10.0, (4, 12): 20.0})                      # doubles: may trim
    g = torch.Generator().manual_seed(0)
    sched = CostScheduler(gamma=3, max_slots=8, mode="compact", cost_table=table)
    for step in range(30):
        conf = torch.rand(2, 3, generator=g) ** 4
        assert plan_step(sched, step, [0, 1], [0, 0], conf)[0] == 6
        assert budget_from_lagged(torch.cumprod(conf, 1), table) == 6
    low = torch.full((4, 3), 0.05)
    budgets = [plan_step(sched, step, [0, 1, 2, 3], [0] * 4, low)[0] for step in range(30, 33)]
    assert budgets[-1] < 12                   # two steps later the lagged low confidences trim


def test_scheduler_cap_accept_verifies_full_blocks():
    sched = CostScheduler(gamma=3, max_slots=4, mode="cap-accept", cost_table=trimming_table())
    conf = torch.tensor([[0.9, 0.2, 0.2]])
    for step in range(3):
        budget, windows, predicted = plan_step(sched, step, [0], [0], conf)
    assert budget < 3 and torch.equal(windows, topk_windows(conf, budget))
    assert predicted == pytest.approx(trimming_table().predict(1, 3))   # the cost of the full block


# ---------------------------------------------------------------------------------------------
# block-accept ceiling
# ---------------------------------------------------------------------------------------------

def test_ceiling_hand_example():
    est = BlockAcceptEstimator(gamma=3)
    est.record(3, 3)                              # T T T
    est.record(3, 1)                              # T F
    est.record(1, 1, remainder=[True, False])     # T | T F  (trimmed positions checked later)
    est.record(1, 1)                              # T | censored
    e = est.estimate()
    assert e.at_risk == [4, 3, 2]
    assert e.conditional == pytest.approx([1.0, 2 / 3, 0.5])
    assert e.ceiling == pytest.approx(1 + 1 + 2 / 3 + 1 / 3)
    assert e.delivered == pytest.approx(2.5) and e.mean_window == pytest.approx(2.0)
    assert e.utilisation == pytest.approx(2.5 / 3.0)
    assert e.window_ratio == pytest.approx(3.0 / 3.0)
    assert e.lo <= e.ceiling <= e.hi
    with pytest.raises(ValueError):
        est.record(2, 3)


def test_ceiling_recovers_truth_from_trimmed_steps():
    rng = np.random.default_rng(0)
    p = [0.9, 0.8, 0.7, 0.6]
    truth = 1 + float(np.sum(np.cumprod(p)))
    est = BlockAcceptEstimator(gamma=4, max_records=100_000)
    for _ in range(6000):
        verdicts = rng.random(4) < p                       # what the full block would have done
        full = int(np.argmin(verdicts)) if not verdicts.all() else 4
        window = int(rng.integers(0, 5))
        accepted = min(full, window)
        est.record(window, accepted, remainder=verdicts[window:].tolist())
    e = est.estimate()
    assert e.ceiling == pytest.approx(truth, abs=0.08)
    assert e.lo < truth < e.hi
    assert 0 < e.utilisation < 1


def test_ceiling_record_many_equals_records_one_by_one_through_the_window_edge():
    """The observer records a step's plain rows in one call; the ring must then hold, count and
    drop exactly what one call per row would (batches smaller than, across and larger than the
    window of 7 records)."""
    rng = np.random.default_rng(3)
    one, many = BlockAcceptEstimator(gamma=4, max_records=7), BlockAcceptEstimator(gamma=4, max_records=7)
    for m in (3, 5, 1, 9, 2, 7, 4):
        w = rng.integers(0, 5, m)
        a = np.array([rng.integers(0, x + 1) for x in w])
        for x, y in zip(w, a):
            one.record(int(x), int(y))
        many.record_many(w, a)
        e1, e2 = one.estimate(), many.estimate()
        assert (e2.at_risk, e2.records, e2.delivered, e2.mean_window) == (e1.at_risk, e1.records, e1.delivered,
                                                                        e1.mean_window)
        assert e2.conditional == pytest.approx(e1.conditional, nan_ok=True)
    with pytest.raises(ValueError):
        many.record_many([2], [3])


def test_spec_metrics_read_mid_run_equal_a_step_by_step_update():
    """The observers keep steps and take them in every FLUSH_EVERY steps: whenever they are read
    (summary, the properties, the estimator), the numbers are those of the unbatched update,
    computed here step by step from the same rows (past the ring's 4096 records: its edge too)."""
    from nanodspark.calibration import OnlineCalibrationMetrics
    from nanodspark.observers import FLUSH_EVERY, SpecMetrics
    from nanodspark.speculative import DecodeOut
    from nanodspark.step import DecodeRows, StepResult
    from nanodspark.verify import VerifyMode

    g, rng = 4, np.random.default_rng(5)
    m = SpecMetrics(g, VerifyMode.STATIC)
    trials, accepts = np.zeros(g, np.int64), np.zeros(g, np.int64)
    online, ceiling = OnlineCalibrationMetrics(g), BlockAcceptEstimator(g)
    reads = 0
    for step in range(5 * FLUSH_EVERY + 3):
        R = int(rng.integers(1, 120))
        count = rng.integers(1, g + 2, R)
        conf = rng.random((R, g)).astype(np.float32)
        conf[rng.random((R, g)) < 0.05] = np.nan
        z = np.zeros(R, np.int64)
        out = DecodeOut(np.zeros((R, g + 1), np.int64), np.zeros((R, g), np.int64), count, z + g, z + g, z, z + 1,
                        z + 1, conf, conf)
        m.observe(StepResult([], DecodeRows(np.arange(R), z, out), step, seconds=0.001))
        for c, row in zip(count.tolist(), conf.astype(np.float64)):        # the unbatched update, row by row
            a = c - 1
            trials[:min(a + 1, g)] += 1
            accepts[:a] += 1
            surv = np.cumprod(np.clip(np.nan_to_num(row, nan=0.0), 0.0, 1.0))
            online.update(torch.from_numpy(surv[None]), torch.from_numpy(np.arange(g) < a)[None])
            ceiling.record(g, a)
        if rng.random() < 0.3 or step % FLUSH_EVERY == FLUSH_EVERY - 1:
            reads += 1
            got, want = m.ceiling.estimate(), ceiling.estimate()
            assert (got.at_risk, got.records, got.delivered) == (want.at_risk, want.records, want.delivered)
            assert m.position_trials.tolist() == trials.tolist() and m.position_accepts.tolist() == accepts.tolist()
            for name in ("count", "sum_pred", "sum_label"):
                assert torch.equal(getattr(m.online, name), getattr(online, name)), name
            assert m.summary()["online_ece"] == [float(e) for e in online.ece()]
    assert reads > 10 and ceiling.estimate().records == m.ceiling.max_records


def test_ceiling_sliding_window_and_wilson():
    est = BlockAcceptEstimator(gamma=2, max_records=2)
    est.record(2, 0)
    est.record(2, 2)
    est.record(2, 2)
    assert est.estimate().at_risk == [2, 2] and est.estimate().records == 2
    lo, hi = wilson_interval(8, 10)
    assert 0.44 < lo < 0.5 and 0.94 < hi < 0.97
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_a_plain_step_carries_each_requests_last_confidences_forward():
    """A plain step has no confidences: the relay pushes each slot's last drafted ones (a slot that
    never drafted: the running mean), so the budget `lag` steps later never reads survival 1.0
    for a request the drafter has seen, and a recycled slot does not inherit its old request's."""
    relay = ConfidenceRelay(max_slots=4, gamma=2, lag=2)
    relay.push(0, [0, 1], [5, 6], np.array([[0.5, 0.5], [0.9, 0.8]], dtype=np.float32))
    relay.push(1, [0, 1, 2], [5, 7, 9], np.zeros((3, 2), np.float32), drafted=False)
    got = relay.lagged_np([0, 1, 2], [5, 7, 9], step=3)
    assert np.allclose(got[0], [0.5, 0.25])                      # its own last confidences, carried
    mean = 0.9 * 1.0 + 0.1 * np.array([0.7, 0.65])               # slot 1 holds another generation now
    assert np.allclose(got[1], np.cumprod(mean)) and np.allclose(got[2], np.cumprod(mean))


def test_a_plain_steps_row_reads_what_it_carried_then_after_fresh_confidences_arrive():
    """A plain step's row is kept lazily (it holds no values of its own, only stamps): a fresh
    push after it must not leak into it, or the budget would read confidences one step old
    instead of `lag` steps old. A plain step also leaves the running mean as it was (no news)."""
    relay = ConfidenceRelay(max_slots=3, gamma=2, lag=2)
    relay.push(0, [0, 1], [5, 6], np.array([[0.5, 0.5], [0.9, 0.8]], dtype=np.float32))
    mean = relay.mean.copy()
    relay.push(1, [0, 1, 2], [5, 6, 9], np.zeros((3, 2), np.float32), drafted=False)
    assert np.array_equal(relay.mean, mean)                        # a plain step brings no news
    relay.push(2, [0, 1, 2], [5, 6, 9], np.array([[0.1, 0.1], [0.2, 0.2], [0.3, 0.3]], np.float32))
    got = relay.lagged_np([0, 1, 2], [5, 6, 9], step=3)            # the row of step 1
    assert np.allclose(got, [[0.5, 0.25], [0.9, 0.72], np.cumprod(mean)])
    assert np.allclose(relay.lagged_np([0], [5], step=4), [[0.1, 0.01]])   # step 2's own row
    assert np.allclose(relay.lagged_np([2], [9], step=3, prior=False), [np.cumprod(mean)])


def test_a_plain_steps_stamps_wait_until_read_and_no_read_can_tell():
    """A plain step's stamps are written only when its row is read: a relay that writes them at
    once reads the same survivals after any mix of plain, partial and full pushes, recycled
    slots and ring wrap-arounds (a waiting stamp dropped, or written to the wrong row, would make
    a lagged read of a plain step fall back to 1.0 or read another step's row)."""
    class Eager(ConfidenceRelay):
        def push(self, step, *a, **k):
            super().push(step, *a, **k)
            self._stamp(step % (self.lag + 1))

    rng = np.random.default_rng(0)
    lazy, eager = ConfidenceRelay(8, 3, lag=2), Eager(8, 3, lag=2)
    gens = np.zeros(8, dtype=np.int64)
    plain_reads = 0
    for step in range(300):
        gens[rng.random(8) < 0.05] += 1                            # a slot gets a new request
        slots = np.sort(rng.choice(8, size=rng.integers(1, 9), replace=False))
        kind = rng.choice(["plain", "all", "part"], p=[0.6, 0.2, 0.2])
        drafted = {"plain": False, "all": True, "part": rng.random(len(slots)) < 0.5}[kind]
        conf = rng.random((len(slots), 3)).astype(np.float32)
        for r in (lazy, eager):
            r.push(step, slots, gens[slots], conf, drafted)
        if kind == "plain":
            assert not (lazy.stamp == step).any()                  # waiting, not written
        if rng.random() < 0.5:                                     # a read, as the budget's
            read = step + 1
            plain_reads += lazy._stamps[(read - 2) % 3] is not None
            for prior in (False, True):
                assert np.array_equal(lazy.lagged_np(slots, gens[slots], read, prior),
                                      eager.lagged_np(slots, gens[slots], read, prior))
    assert plain_reads > 20


def test_drafting_pays_only_where_the_plain_step_does_not_win():
    """Compact with a plain profile: a plain step when R / T_plain beats the best speculative
    step (drafter included) by more than min_gain; otherwise draft. Without a plain table, always draft."""
    spec = CostTable({(b, k): 1e-3 * (3 + 0.1 * k) for b in (1, 8) for k in range(0, 4 * b + 1)})
    cheap = CostTable({(b, 0): 1e-3 for b in (1, 8)})
    dear = CostTable({(b, 0): 2.5e-3 for b in (1, 8)})
    for plain, survival, pays in ((cheap, 0.5, False), (cheap, 0.99, False), (dear, 0.9, True), (dear, 0.01, False),
                                  (None, 0.01, True)):
        s = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=plain)
        s.record(0, range(8), range(8), np.full((8, 4), survival, np.float32))
        assert s.drafting_pays(range(8), range(8), step=2) is pays, (plain is cheap, survival)
    static = CostScheduler(4, 8, mode="static", cost_table=spec, plain_table=cheap)
    assert static.drafting_pays(range(8), range(8), step=2)


def test_a_plain_choice_holds_until_drafted_confidences_arrive_whatever_the_batch(monkeypatch):
    """A plain step brings no confidences, so its choice holds `plain_hold` steps without reading
    the relay, at a smaller or a bigger batch; drafted confidences or the hold's end make a fresh
    choice, and a fresh choice that says draft ends the streak. plain_hold=1 chooses at every step."""
    spec = CostTable({(b, k): 1e-3 * (3 + 0.1 * k) for b in (1, 8) for k in range(0, 4 * b + 1)})
    cheap = CostTable({(b, 0): 1e-3 for b in (1, 8)})
    s = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=cheap, plain_hold=3)
    s.record(0, range(8), range(8), np.full((8, 4), 0.5, np.float32))
    assert s.draft_choice(range(5), range(5), step=2).fraction == 0.0        # chosen: plain, 5 rows
    reads = []
    real = s.relay.lagged_np
    monkeypatch.setattr(s.relay, "lagged_np", lambda *a, **k: reads.append(a[2]) or real(*a, **k))
    s.record(2, range(5), range(5), np.zeros((5, 4), np.float32), drafted=False)
    assert s.draft_choice(range(4), range(4), step=3).fraction == 0.0 and reads == []   # held (two left)
    assert s.draft_choice(range(8), range(8), step=4).fraction == 0.0 and reads == []   # a bigger batch too
    assert s.draft_choice(range(8), range(8), step=5).fraction == 0.0 and reads == [5]  # the hold's end
    s.draft_choice(range(8), range(20, 28), step=6)
    assert reads == [5]                                                       # held again, from step 5
    s.draft_choice(range(8), range(8), step=8)
    assert reads == [5, 8]                                                    # held again, from step 8
    s.record(8, range(8), range(8), np.full((8, 4), 0.99, np.float32))        # drafted: the hold ends
    # plain still wins here (see test_drafting_pays_only_where_the_plain_step_does_not_win), but it is chosen afresh
    assert s.draft_choice(range(8), range(8), step=9).fraction == 0.0 and reads == [5, 8, 9]
    one = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=cheap, plain_hold=1)
    one.record(0, range(8), range(8), np.full((8, 4), 0.5, np.float32))
    monkeypatch.setattr(one.relay, "lagged_np", lambda *a, **k: reads.append(a[2]) or real(*a, **k))
    one.draft_choice(range(8), range(8), step=2)
    one.draft_choice(range(8), range(8), step=3)
    assert reads[-2:] == [2, 3]
    dear = CostScheduler(4, 8, mode="compact", cost_table=spec,
                         plain_table=CostTable({(b, 0): 2.5e-3 for b in (1, 8)}), plain_hold=3)
    dear.record(0, range(8), range(8), np.full((8, 4), 0.9, np.float32))
    assert dear.draft_choice(range(8), range(8), step=2) is None and dear._held is None   # drafting: no hold
    with pytest.raises(ValueError, match="plain_hold"):
        CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=cheap, plain_hold=0)


def test_a_long_plain_run_lets_the_drafters_context_lapse_and_drafting_ends_the_run():
    """Plain steps keep feeding the drafter's context for `lapse_after` steps in a row, held or
    chosen afresh; every plain step after them lets it lapse (upkeep False) until a choice that
    drafts ends the run; lapse_after=0 never lapses. Only plain steps lapse."""
    spec = CostTable({(b, k): 1e-3 * (3 + 0.1 * k) for b in (1, 8) for k in range(0, 4 * b + 1)})
    cheap = CostTable({(b, 0): 1e-3 for b in (1, 8)})
    dear = CostTable({(b, 0): 2.5e-3 for b in (1, 8)})
    s = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=cheap, plain_hold=2, lapse_after=3)
    s.record(0, range(8), range(8), np.full((8, 4), 0.5, np.float32))
    got = [s.draft_choice(range(8), range(8), step=n) for n in range(2, 8)]
    assert [c.fraction for c in got] == [0.0] * 6
    assert [c.upkeep for c in got] == [True, True, True, False, False, False]
    s.plain_table = dear                          # drafting pays again: the run ends there
    s.record(7, range(8), range(8), np.full((8, 4), 0.9, np.float32))
    assert s.draft_choice(range(8), range(8), step=9) is None
    s.plain_table = cheap
    s.record(9, range(8), range(8), np.full((8, 4), 0.5, np.float32))
    assert s.draft_choice(range(8), range(8), step=11).upkeep      # a new run keeps it again
    never = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=cheap, plain_hold=1)
    never.record(0, range(8), range(8), np.full((8, 4), 0.5, np.float32))
    assert all(never.draft_choice(range(8), range(8), step=n).upkeep for n in range(2, 40))


def test_a_clear_choice_of_every_row_drafting_holds_until_the_batch_grows(monkeypatch):
    """Every row drafting, chosen by more than min_gain over each alternative, holds `plain_hold`
    steps without reading the relay, whatever confidences arrive meanwhile; a bigger batch or the
    hold's end choose afresh. A near tie is chosen afresh at every step."""
    spec = CostTable({(b, k): 1e-3 * (3 + 0.1 * k) for b in (1, 8) for k in range(0, 4 * b + 1)})
    dear = CostTable({(b, 0): 2.5e-3 for b in (1, 8)})
    s = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=dear, plain_hold=3)
    s.record(0, range(8), range(8), np.full((8, 4), 0.9, np.float32))
    reads, real = [], s.relay.lagged_np
    monkeypatch.setattr(s.relay, "lagged_np", lambda *a, **k: reads.append(a[2]) or real(*a, **k))
    assert s.draft_choice(range(6), range(6), step=2) is None and reads == [2]     # chosen: every row
    s.record(2, range(6), range(6), np.zeros((6, 4), np.float32))                 # news: no re-choice
    assert s.draft_choice(range(6), range(6), step=3) is None and reads == [2]
    assert s.draft_choice(range(8), range(8), step=4) is None and reads == [2, 4]  # the batch grew
    assert s.draft_choice(range(8), range(8), step=5) is None and reads == [2, 4]
    s.draft_choice(range(8), range(8), step=7)
    assert reads == [2, 4, 7]                                                      # the hold's end
    # a near tie: plain priced so that drafting wins by less than min_gain is chosen every step
    tie = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=dear, plain_hold=3)
    tie.record(0, range(8), range(8), np.full((8, 4), 0.9, np.float32))
    theta_all = max((8 + np.sort(np.cumprod(np.full((8, 4), 0.9), 1).ravel())[::-1][:k].sum()) / t
                    for k, t in enumerate(spec.curve(8, 32)))
    tie.plain_table = CostTable({(b, 0): 8 / (theta_all / 1.02) for b in (1, 8)})   # plain 2 % behind
    monkeypatch.setattr(tie.relay, "lagged_np", lambda *a, **k: reads.append(a[2]) or real(*a, **k))
    assert tie.draft_choice(range(8), range(8), step=2) is None and tie.draft_choice(range(8), range(8), step=3) is None
    assert reads[-2:] == [2, 3]


def test_the_step_clock_corrects_each_kind_of_step_and_flips_the_choice_only_when_on():
    """A profile that flatters drafting (steps that draft run 2x their price) makes compact draft
    where a plain step wins; the step clock, once it has timed 8 drafting steps, prices them at
    2x and chooses plain; once plain steps run 2x too, drafting wins again. Partial steps, idle
    gaps and steps without a price are not timed; without the clock nothing is corrected."""
    from nanodspark.cost_scheduler import CLOCK_MIN_STEPS
    spec = CostTable({(b, k): 1e-3 * (3 + 0.1 * k) for b in (1, 8) for k in range(0, 4 * b + 1)})
    dear = CostTable({(b, 0): 2.5e-3 for b in (1, 8)})
    on = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=dear, plain_hold=1, step_clock=True)
    off = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=dear, plain_hold=1)
    every, none = np.ones(8, bool), np.zeros(8, bool)
    for s in (on, off):
        s.record(0, range(8), range(8), np.full((8, 4), 0.9, np.float32))
        assert s.draft_choice(range(8), range(8), step=2) is None            # the profile: drafting pays
        for i in range(CLOCK_MIN_STEPS):
            s.time_step(every, 12.4e-3, 6.2e-3)                               # drafting steps: 2x their price
            s.time_step(np.arange(8) < 4, 1.0, 6.2e-3)                        # partial: not timed
            s.time_step(none, 1.0, 2.5e-3)                                    # an idle gap: not timed
            s.time_step(none, 2.5e-3, float("nan"))                           # no price: not timed
    assert on.correction(1) == pytest.approx(2.0) and on.correction(0) == 1.0 and off.correction(1) == 1.0
    assert on.draft_choice(range(8), range(8), step=2).fraction == 0.0        # corrected: plain wins
    assert off.draft_choice(range(8), range(8), step=2) is None
    for i in range(CLOCK_MIN_STEPS):
        on.time_step(none, 5e-3, 2.5e-3)                                      # plain steps: 2x too
    assert on.correction(0) == pytest.approx(2.0)
    on.record(1, range(8), range(8), np.full((8, 4), 0.9, np.float32))        # (drafted: the hold ends)
    assert on.draft_choice(range(8), range(8), step=3) is None                # both 2x: drafting again


def test_cost_windows_time_decode_only_steps_for_the_step_clock(monkeypatch):
    """`CostWindows.observe` hands the scheduler each decode-only step's period (from the step seen
    before), skipping a step with a prefill and the one after it (the prefill's device time spills
    over); without the step clock it times nothing."""
    from types import SimpleNamespace
    from nanodspark.windows import CostWindows
    import nanodspark.windows as win
    spec = CostTable({(b, k): 1e-3 * (3 + 0.1 * k) for b in (1, 8) for k in range(0, 4 * b + 1)})
    timed = []
    for clock in (True, False):
        s = CostScheduler(4, 8, mode="compact", cost_table=spec, plain_table=spec, step_clock=clock)
        s.time_step = lambda drafted, seconds, predicted: timed.append((round(seconds, 6), predicted))
        w, t = CostWindows(s), iter([1.0, 1.002, 1.010, 1.013, 1.016])
        monkeypatch.setattr(win.time, "perf_counter", lambda: next(t))
        out = SimpleNamespace(conf=np.zeros((2, 4), np.float32), drafted=np.ones(2, np.int64))
        rows = SimpleNamespace(slots=np.arange(2), generations=np.arange(2), out=out, plain=False)
        for step, prefill in enumerate([False, False, True, False, False]):
            w.observe(SimpleNamespace(decode=rows, prefill=[1] if prefill else [], step=step,
                                      predicted_step_time=0.003))
    assert timed == [(0.002, 0.003), (0.003, 0.003)]                          # steps 1 and 4 only


def test_draft_choice_lets_the_confident_half_draft_computed_by_hand():
    """R = 4, gamma 2; every row drafting: T(4, K) = 26 ms + 1 ms per draft; the target alone
    20 ms; a share f drafting (ceil(4 f) rows), as profiled: 20 ms + 1.5 ms a drafting row + 1 ms
    per draft. Rows 1 and 3 have c = 0.9 (survivals .9, .81), rows 0 and 2 c = 0.1. Expected
    tokens per second:
      none  4 / 20 ms                                    = 200
      1 row (.9, .81)      5.71 / (21.5 + 2) ms          = 243.0
      2 rows, K = 4        7.42 / (23 + 4) ms            = 274.8   <- best
      3 rows, K = 4        7.42 / (24.5 + 4) ms          = 260.4
      all,    K = 4        7.42 / (26 + 4) ms            = 247.3   (274.8 > 1.04 * 247.3)
    The two confident rows draft (first in the order), the budget is their 4 drafts, priced 27 ms."""
    spec = CostTable({(4, k): 1e-3 * (26 + k) for k in range(9)})
    plain = CostTable({(4, 0): 20e-3})
    shares = {f: CostTable({(4, k): 1e-3 * (20 + 1.5 * d + k) for k in range(2 * d + 1)})
              for f, d in ((0.25, 1), (0.5, 2), (0.75, 3))}
    confs = np.array([[0.1, 0.1], [0.9, 0.9], [0.1, 0.1], [0.9, 0.9]], np.float32)
    s = CostScheduler(2, 4, mode="compact", cost_table=spec, plain_table=plain, share_tables=shares)
    s.record(0, range(4), range(4), confs)
    c = s.draft_choice(range(4), range(4), step=2)
    assert c.fraction == 0.5 and sorted(c.order[:2].tolist()) == [1, 3] and c.budget == 4
    assert c.predicted == pytest.approx(27e-3)
    assert s.drafting_pays(range(4), range(4), step=2)
    # a dearer profile of a share changes the choice: half drafting at a flat 40 ms (7.42 / 44 ms
    # = 168) loses to three rows drafting (7.42 / 28.5 ms = 260.4 > 1.04 * 247.3)
    m = CostScheduler(2, 4, mode="compact", cost_table=spec, plain_table=plain,
                      share_tables={**shares, 0.5: CostTable({(4, k): 40e-3 for k in range(5)})})
    m.record(0, range(4), range(4), confs)
    c = m.draft_choice(range(4), range(4), step=2)
    assert c.fraction == 0.75 and c.budget == 4 and c.predicted == pytest.approx(28.5e-3)
    # every row confident: drafting all of them beats any share, so no choice is made (the budget decides)
    s.record(3, range(4), range(4), np.full((4, 2), 0.9, np.float32))
    assert s.draft_choice(range(4), range(4), step=5) is None
    # no share profiled: only "none" is left, and here drafting pays, so no choice either
    t = CostScheduler(2, 4, mode="compact", cost_table=spec, plain_table=plain)
    t.record(0, range(4), range(4), confs)
    assert t.draft_choice(range(4), range(4), step=2) is None
    with pytest.raises(ValueError, match="draft shares"):
        CostScheduler(2, 4, mode="compact", cost_table=spec, plain_table=plain, share_tables={1.0: spec})


def test_the_relay_carries_forward_only_the_rows_that_did_not_draft():
    """A step where some rows drafted: those push their fresh confidences, the others carry their
    last ones (drafted given per row)."""
    relay = ConfidenceRelay(max_slots=3, gamma=2, lag=1)
    relay.push(0, [0, 1, 2], [1, 1, 1], np.array([[0.5, 0.5], [0.8, 0.8], [0.2, 0.2]], np.float32))
    relay.push(1, [2, 0, 1], [1, 1, 1], np.array([[0.9, 0.9], [0.0, 0.0], [0.0, 0.0]], np.float32),
               drafted=np.array([True, False, False]))
    got = relay.lagged_np([0, 1, 2], [1, 1, 1], step=2)
    assert np.allclose(got, [[0.5, 0.25], [0.8, 0.64], [0.9, 0.81]])


def test_a_request_without_lagged_confidences_counts_as_the_mean_when_choosing_who_drafts():
    """The budget treats a missing entry as survival 1.0 (verify everything: safe); the choice of
    who drafts treats it as the running mean, so newly admitted requests do not look certain."""
    relay = ConfidenceRelay(max_slots=4, gamma=2, lag=1)
    relay.push(0, [0, 1], [1, 1], np.array([[0.9, 0.9], [0.3, 0.3]], np.float32))
    mean = 0.9 * 1.0 + 0.1 * np.array([0.6, 0.6])
    got = relay.lagged_np([0, 1, 2], [1, 1, 1], step=1, prior=True)
    assert np.allclose(got[:2], [[0.9, 0.81], [0.3, 0.09]]) and np.allclose(got[2], np.cumprod(mean))
    assert np.allclose(relay.lagged_np([2], [1], step=1), [[1.0, 1.0]])
    assert np.allclose(relay.lagged_np([2], [1], step=0, prior=True), [np.cumprod(relay.mean)])


def test_the_engine_prices_its_plain_step_by_what_a_run_of_them_costs(tmp_path):
    """A cost file may hold the target alone ("(no drafter)"), this engine's own plain step
    ("(draft 0)", `bench profile --draft-fraction 0`: it keeps the drafter's context) and its
    plain step that lets the context lapse ("(lapsed)", `--lapse`). The engine prices plain steps
    by the lapsed one where they may lapse (the default), else by its own, else the target alone."""
    from nanodspark import LLM
    from nanodspark.lab.shapes import materialize
    model = materialize("tiny-dense", tmp_path / "tiny-dense")
    name, path = "tiny-dense (random weights)", tmp_path / "cost.json"
    kw = dict(load_format="dummy", synthetic_acceptance="0.3:0.6", use_tqdm=False, max_num_seqs=4,
              max_model_len=128, verify_mode="compact", cost_table=str(path))
    probe = LLM(str(model), **{**kw, "verify_mode": "static", "cost_table": None}).engine
    g, dtype, device = probe.gamma, str(probe.dtype), probe.device.type
    del probe
    sizes = (1, 2, 4)
    save = lambda t, n: CostTable(t, model_name=n, dtype=dtype, device=device).save(path)   # noqa: E731
    save({(b, k): 1e-3 * (2 + 0.1 * k) for b in sizes for k in range(0, b * g + 1)}, name)
    save({(b, 0): 1e-3 for b in sizes}, f"{name} (no drafter)")
    plain = lambda **o: LLM(str(model), **kw, **o).engine.windows.scheduler.plain_table.predict(2, 0)  # noqa: E731
    assert plain() == pytest.approx(1e-3) and plain(verify_lapse_after=0) == pytest.approx(1e-3)
    save({(b, 0): 1.25e-3 for b in sizes}, f"{name} (draft 0)")
    assert plain() == pytest.approx(1.25e-3) and plain(verify_lapse_after=0) == pytest.approx(1.25e-3)
    save({(b, 0): 1.1e-3 for b in sizes}, f"{name} (lapsed)")
    assert plain() == pytest.approx(1.1e-3) and plain(verify_lapse_after=0) == pytest.approx(1.25e-3)


def test_compact_with_nothing_to_trim_runs_static_windows_and_static_output(tmp_path):
    """A flat cost file (a step costs the same whatever it verifies), even one holding a plain
    step's price: compact warns and plans as static, with static's host policy (no relay, no
    cost lookups per step), and its greedy output is static's token for token. A table that rises
    keeps the cost scheduler."""
    from nanodspark import LLM, SamplingParams
    from nanodspark.lab.shapes import materialize
    from nanodspark.windows import CostWindows, StaticWindows
    model = materialize("tiny-dense", tmp_path / "tiny-dense")
    name, path = "tiny-dense (random weights)", tmp_path / "cost.json"
    kw = dict(load_format="dummy", use_tqdm=False, max_num_seqs=4, max_model_len=128)
    static = LLM(str(model), **kw, verify_mode="static")
    g, dtype, device = static.engine.gamma, str(static.engine.dtype), static.engine.device.type
    save = lambda t, n: CostTable(t, model_name=n, dtype=dtype, device=device).save(path)   # noqa: E731
    sizes = (1, 2, 4)
    save({(b, k): 2e-3 for b in sizes for k in range(0, b * g + 1)}, name)
    save({(b, 0): 1e-3 for b in sizes}, f"{name} (no drafter)")
    with pytest.warns(UserWarning, match="non-flat cost table"):
        flat = LLM(str(model), **kw, verify_mode="compact", cost_table=str(path))
    assert isinstance(flat.engine.windows, StaticWindows) and not flat.engine.plain_steps
    prompts = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in flat.generate(prompts, params)] == \
           [o.outputs[0].token_ids for o in static.generate(prompts, params)]
    save({(b, k): 1e-3 * (2 + 0.1 * k) for b in sizes for k in range(0, b * g + 1)}, name)
    assert isinstance(LLM(str(model), **kw, verify_mode="compact", cost_table=str(path)).engine.windows, CostWindows)
    with pytest.warns(UserWarning, match="non-flat cost table"):
        assert isinstance(LLM(str(model), **kw, verify_mode="compact").engine.windows, StaticWindows)


def test_a_lapsed_drafter_context_stays_lossless_unread_and_unshared(tmp_path):
    """Plain steps 3-9, of which 5-9 let the drafter's context lapse, then every row drafts again:
    greedy output equals the target alone; each request's `draft_start` moved past the lapse;
    the drafter reads nothing below it (the whole draft cache is NaN when drafting resumes, yet
    every drafted confidence is finite); and what the lapsed requests publish is marked as holding
    no drafter context, so a later prompt over the same tokens hits the cache only up to it (the
    whole published prefix without a lapse)."""
    from conftest import make_hf_model, random_drafter
    from nanodspark import LLM, SamplingParams
    from nanodspark.loader import load_model
    from nanodspark.step import WindowPlan
    from nanodspark.windows import WindowPolicy
    out, _ = make_hf_model("qwen3", tmp_path / "pair", num_hidden_layers=2)
    random_drafter(load_model(out), gamma=3, num_layers=1, std=0.2).save(out / "drafter")
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 11, 18)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(use_tqdm=False, device="cpu", block_size=4, enable_prefix_cache=True)
    want = [o.token_ids for o in LLM(str(out), drafter_path="none", **kw).generate(ps, greedy)]

    class Lapse(WindowPolicy):
        def __init__(self, eng, lapse):
            self.eng, self.lapse, self.conf, self.widths = eng, lapse, [], set()

        def plan(self, rows, step):
            if 3 <= step < 10:
                return WindowPlan(0, True, None, draft=0.0, upkeep=not (self.lapse and step >= 5))
            if step == 10 and self.lapse:      # whatever lies below draft_start is never read
                self.eng.executor.spec.draft_cache.fill_(float("nan"))
            return WindowPlan(len(rows.slots) * self.eng.gamma, False)

        def observe(self, result):
            d = result.decode
            if d is not None and len(d.slots) and result.step >= 10:
                self.conf.append(d.out.conf[d.out.drafted != 0])
            if d is not None and len(d.slots) and 3 <= result.step < 10:   # a plain step: no draft columns
                self.widths.add((d.out.tokens.shape[1], d.out.drafts.shape[1], d.out.conf.shape[1]))

    for lapse in (True, False):
        llm = LLM(str(out), **kw)
        eng = llm.engine
        eng.windows = policy = Lapse(eng, lapse)
        assert [o.token_ids for o in llm.generate(ps, greedy)] == want
        assert policy.widths == {(1, 0, 0)}
        starts = eng.state.draft_start[:len(ps)]
        assert eng.worker.draft_group == "full" and eng.state.tables["draft"] is eng.state.tables["full"]
        no_context = eng.scheduler.no_context
        if lapse:
            assert (starts > torch.tensor([len(p) for p in ps], dtype=torch.int32)).all(), starts
            assert policy.conf and all(np.isfinite(c).all() for c in policy.conf)
            assert no_context.any()
        else:
            assert (starts == 0).all() and not no_context.any()
        ids = ps[2] + want[2]                              # the same tokens again: a prefix hit
        chain = eng.scheduler.managers["full"].prefix_blocks(ids, (len(ids) - 1) // 4 * 4)
        holes = [i for i, b in enumerate(chain) if no_context[b]]
        again = eng.add_request(ids)
        eng.step()
        assert len(chain) >= 6 and bool(holes) == lapse
        assert again.tables["full"].num_cached_tokens == 4 * (holes[0] if holes else len(chain))
