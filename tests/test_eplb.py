"""EPLB (nanodspark/eplb.py): the placement reproduces the public README example and keeps its
invariants on random loads, improves balance on skewed loads, refuses bad arguments; the
recorder's counts are exact; redundant experts and rebalancing never change the output."""
import json

import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.config import EngineConfig
from nanodspark.eplb import (ExpertBalancer, LoadRecorder, balance_stats, balanced_packing, check_placement,
                             colocated_replicas, fold_to_logical, keep_in_place, rebalance_experts, replica_load,
                             replicate_experts, trivial_placement)
from nanodspark.loader import load_model
from nanodspark.model import DenseAttentionContext
from kernels.replicas import map_to_replicas, map_to_replicas_ref

# deepseek-ai/EPLB README: two layers of 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs
README_WEIGHT = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def per_gpu_sets(phy2log, num_gpus):
    L, P = phy2log.shape
    return [[sorted(g) for g in layer] for layer in phy2log.view(L, num_gpus, P // num_gpus).tolist()]


def zipf_loads(gen, layers, experts, s=1.2, tokens=10_000):
    """Skewed loads: a Zipf(s) popularity over a random permutation of the experts per layer."""
    out = []
    for _ in range(layers):
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.double) ** s
        p = p[torch.randperm(experts, generator=gen)]
        out.append(torch.multinomial(p / p.sum(), tokens, replacement=True, generator=gen).bincount(minlength=experts))
    return torch.stack(out)


# ----------------------------------------------------------------------------- the two steps
# (the contracts of the course's unit eplb: walkthrough/12_eplb.md, Task 10)
def test_balanced_packing_largest_first_into_the_lightest_pack_with_room():
    # 5 -> p0, 4 -> p1, 3 -> p1 (4 < 5), 3 -> p0 (5 < 7), 2 -> p1 (7 < 8), 1 -> p0 (p1 is full)
    pack, rank = balanced_packing(torch.tensor([[5., 1, 4, 2, 3, 3]]), 2)
    assert pack.tolist() == [[0, 0, 1, 1, 1, 0]] and rank.tolist() == [[0, 2, 0, 2, 1, 1]]
    pack, rank = balanced_packing(torch.tensor([[1., 1, 1, 1], [0, 0, 0, 9]]), 2)   # ties: lower item, lower pack
    assert pack.tolist() == [[0, 1, 0, 1], [1, 1, 0, 0]] and rank.tolist() == [[0, 0, 1, 1], [0, 1, 1, 0]]
    pack, rank = balanced_packing(torch.tensor([[3., 9, 1]]), 3)                   # one item per pack: in order
    assert pack.tolist() == [[0, 1, 2]] and rank.tolist() == [[0, 0, 0]]
    with pytest.raises(ValueError, match="evenly"):
        balanced_packing(torch.ones(1, 5), 2)


@pytest.mark.parametrize("seed", range(4))
def test_balanced_packing_fills_every_pack_exactly(seed):
    gen = torch.Generator().manual_seed(seed)
    X, packs, per = 3, [2, 3, 4, 8][seed], [2, 3, 5, 4][seed]
    w = torch.rand(X, packs * per, generator=gen) * 100
    pack, rank = balanced_packing(w, packs)
    for x in range(X):
        for q in range(packs):
            items = (pack[x] == q).nonzero().flatten()
            assert len(items) == per                                         # exactly n / packs items
            order = items[rank[x, items].argsort()]
            assert sorted(rank[x, items].tolist()) == list(range(per))       # ranks 0..per-1
            assert (w[x, order].diff() <= 0).all()                           # received largest first


def test_replicate_experts_gives_each_extra_slot_to_the_most_loaded_per_replica():
    # chapter 12, step b: 165 -> 82.5 twice, then 104 -> 52 twice
    phy2log, rank, cnt = replicate_experts(torch.tensor([[61., 104, 165, 39, 4, 73]]), 8)
    assert phy2log.tolist() == [[0, 1, 2, 3, 4, 5, 2, 1]] and rank.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1]]
    assert cnt.tolist() == [[1, 2, 2, 1, 1, 1]]
    phy2log, rank, cnt = replicate_experts(torch.tensor([[2., 2], [1, 8]]), 5)       # ties: the lower expert
    assert phy2log.tolist() == [[0, 1, 0, 1, 0], [0, 1, 1, 1, 1]]
    assert rank.tolist() == [[0, 0, 1, 1, 2], [0, 0, 1, 2, 3]] and cnt.tolist() == [[3, 2], [1, 4]]
    phy2log, rank, cnt = replicate_experts(torch.tensor([[4., 0, 7]]), 3)            # no spare slot
    assert phy2log.tolist() == [[0, 1, 2]] and cnt.tolist() == [[1, 1, 1]]


@pytest.mark.parametrize("seed", range(3))
def test_replicate_experts_minimises_the_largest_load_per_replica(seed):
    """The greedy is optimal: no other split of the slots has a smaller max_e load_e / count_e
    (checked against every split of up to 4 spare slots over 4 experts)."""
    import itertools
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(1, 50, (2, 4), generator=gen).double()
    for spare in range(5):
        phy2log, rank, cnt = replicate_experts(w, 4 + spare)
        assert phy2log[:, :4].tolist() == [[0, 1, 2, 3]] * 2 and (cnt.sum(1) == 4 + spare).all()
        for x in range(2):
            assert cnt[x].tolist() == torch.bincount(phy2log[x], minlength=4).tolist()
            for e in range(4):                                   # ranks 0..count-1, in slot order
                assert rank[x][phy2log[x] == e].tolist() == list(range(int(cnt[x, e])))
            best = min(max(w[x, e] / (1 + c[e]) for e in range(4))
                       for c in itertools.product(range(spare + 1), repeat=4) if sum(c) == spare)
            assert float((w[x] / cnt[x]).max()) == pytest.approx(float(best))


# ----------------------------------------------------------------------------- placement
def test_readme_example_is_reproduced_up_to_order_within_a_gpu():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert per_gpu_sets(phy2log, 8) == per_gpu_sets(torch.tensor(README_PHY2LOG), 8)
    assert phy2log.tolist() == README_PHY2LOG          # (and in fact in the README's order)
    check_placement(phy2log, log2phy, logcnt, 8)
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    # balance of the README loads (reference/components.md §1.2): naive 3 experts per GPU on 4 GPUs
    naive = balance_stats(README_WEIGHT, 4)["balancedness_per_layer"]
    hier = balance_stats(replica_load(README_WEIGHT, phy2log), 8)["balancedness_per_layer"]
    assert [round(b, 2) for b in naive] == [0.78, 0.56] and [round(b, 2) for b in hier] == [0.83, 0.81]


def test_global_policy_on_the_readme_loads_puts_two_replicas_of_one_expert_on_one_gpu():
    """The global policy packs replicas as independent items: expert 1 lands twice on one GPU
    (layer 0). Allowed (the slot is wasted, nothing is wrong) and counted."""
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 1, 1, 8, policy="global")
    check_placement(phy2log, log2phy, logcnt, 8)
    assert [1, 1] in per_gpu_sets(phy2log, 8)[0]
    assert colocated_replicas(phy2log, 8) >= 1
    bal = balance_stats(replica_load(README_WEIGHT, phy2log), 8)["balancedness_per_layer"]
    assert [round(b, 2) for b in bal] == [0.93, 0.84]
    # auto picks global when the groups do not divide over the nodes (4 groups, 3 nodes)
    auto, _, _ = rebalance_experts(README_WEIGHT, 18, 4, 3, 6)
    assert torch.equal(auto, rebalance_experts(README_WEIGHT, 18, 4, 3, 6, policy="global")[0])


@pytest.mark.parametrize("seed", range(6))
def test_random_loads_keep_every_invariant(seed):
    gen = torch.Generator().manual_seed(seed)
    L, n = 3, [8, 12, 16, 32][seed % 4]
    gpus = [2, 4, 8][seed % 3]
    groups = 4 if seed % 2 else 1                       # every n here divides into 4 groups
    nodes = 2 if groups == 4 else 1                     # hierarchical over 2 nodes, or global
    P = n + (-n) % gpus + gpus * (seed % 3)             # a multiple of the GPUs, >= n
    weight = zipf_loads(gen, L, n) if seed % 2 else torch.randint(0, 100, (L, n), generator=gen)
    for policy in ("auto", "global"):
        phy2log, log2phy, logcnt = rebalance_experts(weight, P, groups, nodes, gpus, policy=policy)
        assert phy2log.shape == (L, P) and logcnt.shape == (L, n) and log2phy.shape[:2] == (L, n)
        check_placement(phy2log, log2phy, logcnt, gpus)
        assert (logcnt >= 1).all() and (logcnt.sum(1) == P).all()
        # each GPU holds exactly P / gpus slots (GPU-major), and log2phy / phy2log are inverse
        assert all(len(g) == P // gpus for layer in per_gpu_sets(phy2log, gpus) for g in layer)
        for l in range(L):
            for e in range(n):
                for s in log2phy[l, e][log2phy[l, e] >= 0].tolist():
                    assert phy2log[l, s] == e
            assert sorted(s for e in range(n) for s in log2phy[l, e].tolist() if s >= 0) == list(range(P))
        # keeping experts in their old slot changes neither the sets per GPU nor the balance
        kept = keep_in_place(trivial_placement(L, n, P), phy2log, gpus)
        assert per_gpu_sets(kept, gpus) == per_gpu_sets(phy2log, gpus)


@pytest.mark.parametrize("seed", range(5))
def test_balancedness_after_placement_is_at_least_before_on_skewed_loads(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    for n, ep in ((8, 4), (32, 8), (128, 8)):
        weight = zipf_loads(gen, 4, n)
        before = balance_stats(weight, ep)["balancedness"]               # expert e on rank e // (n / ep)
        last = 0.0
        for redundant in (0, ep, 4 * ep):
            phy2log, _, _ = rebalance_experts(weight, n + redundant, 1, 1, ep)
            after = balance_stats(replica_load(weight, phy2log), ep)["balancedness"]
            assert after >= before - 1e-9, (n, ep, redundant, before, after)
            assert after >= last - 0.02                 # more slots never make it much worse
            last = after
        if n == 128:                                    # many experts, 4 spare slots per rank
            assert last > 0.95


@pytest.mark.parametrize("args, match", [
    ((README_WEIGHT, 15, 4, 2, 8), "not divisible by num_gpus"),
    ((README_WEIGHT, 16, 4, 3, 8), "not divisible by num_nodes"),
    ((README_WEIGHT, 16, 5, 1, 8), "not divisible into num_groups"),
    ((README_WEIGHT, 8, 4, 2, 8), "every expert needs a slot"),
    ((README_WEIGHT[0], 16, 4, 2, 8), "must be \\[layers, logical experts\\]"),
    ((-README_WEIGHT, 16, 4, 2, 8), "non-negative"),
    ((README_WEIGHT, 16, 0, 2, 8), "positive integer"),
])
def test_bad_arguments_get_a_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(*args)


def test_hierarchical_policy_needs_groups_divisible_by_nodes():
    with pytest.raises(ValueError, match="num_groups=4 is not divisible by num_nodes=3"):
        rebalance_experts(README_WEIGHT, 18, 4, 3, 6, policy="hierarchical")
    with pytest.raises(ValueError, match="policy must be one of"):
        rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="greedy")


def test_engine_config_and_balancer_refuse_bad_eplb_settings(tiny_dir):
    with pytest.raises(ValueError, match="eplb_policy"):
        EngineConfig(eplb_policy="nope")
    with pytest.raises(ValueError, match="needs the recorder"):     # recording off is the bench's control only
        LLM(str(tiny_dir), eplb=True, eplb_interval=5, use_tqdm=False).engine.eplb.set_recording(False)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineConfig(eplb=True, tensor_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ValueError, match="multiple of the EP size"):
        LLM(str(tiny_dir), eplb=True, eplb_ep_size=3, use_tqdm=False)
    with pytest.raises(ValueError, match="num_groups=4 is not divisible by num_nodes=3"):
        LLM(str(tiny_dir), eplb=True, eplb_ep_size=6, eplb_num_redundant_experts=4, eplb_num_groups=4,
            eplb_num_nodes=3, eplb_policy="hierarchical", use_tqdm=False)


# ----------------------------------------------------------------------------- balance figures
def test_balance_stats_takes_the_ratio_per_layer_then_the_mean():
    load = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0]])       # 2 ranks of 2 slots
    s = balance_stats(load, 2)
    assert s["balancedness_per_layer"] == [1.0, 0.5] and s["balancedness"] == pytest.approx(0.75)
    assert s["straggler"] == pytest.approx((1.0 + 2.0) / 2)
    assert s["rank_load"] == [60.0, 20.0] and s["modelled_moe_time"] == {"max_rank": 60.0, "mean_rank": 40.0}
    # (summing means and maxes over layers first would say 40 / 60 = 0.67)
    assert balance_stats(torch.zeros(1, 4), 2)["balancedness"] is None


# ----------------------------------------------------------------------------- recorder
def test_recorder_ring_buffer_keeps_the_last_window_steps():
    rec = LoadRecorder(2, 3, window=3, device="cpu")
    for step in range(5):
        rec.load += step + 1
        rec.advance()
        assert rec.load.sum() == 0
    assert rec.steps_in_window() == 3
    assert rec.per_step()[:, 0, 0].tolist() == [3, 4, 5]               # oldest first
    assert rec.total.tolist() == [[12, 12, 12]] * 2
    rec.reset()
    assert rec.total.sum() == 0 and rec.steps == 0


def _balancer(model, **kw):
    cfg = EngineConfig(eplb=True, **{"eplb_interval": 0, **kw})
    return ExpertBalancer(model, cfg, "cpu")


def _forward(model, ids):
    B, S = ids.shape
    with torch.inference_mode():
        out = model(ids.flatten(), torch.arange(S).repeat(B), DenseAttentionContext(B, S))
        return model.compute_logits(out.hidden)


def test_recorder_counts_equal_the_routers_own_top_k(tiny_dir):
    """Per physical slot and per logical expert, the recorder's counts of a forward are the
    counts of the router's top-k on the same inputs (captured with forward hooks)."""
    model = load_model(tiny_dir)
    bal = _balancer(model, eplb_num_redundant_experts=4, eplb_ep_size=4)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0]))) for m in bal.moes]
    ids = torch.randint(0, 8192, (3, 11), generator=torch.Generator().manual_seed(0))
    _forward(model, ids)
    for h in hooks:
        h.remove()
    assert len(seen) == len(bal.moes)
    torch.set_grad_enabled(False)
    tops = [moe.route(x)[1] for moe, x in seen]                          # the router's own top-k
    physical = [map_to_replicas_ref(top, m.replicas.log2phy, m.replicas.logcnt, m.replicas.step)
                for (m, _), top in zip(seen, tops)]                      # the step's replica rule
    bal.launched()                                                       # closes the step
    for l, (moe, x) in enumerate(seen):
        top = tops[l]
        want_logical = torch.bincount(top.flatten(), minlength=bal.num_logical)
        want_physical = torch.bincount(physical[l].flatten(), minlength=bal.num_physical)
        step_load = bal.recorder.window[0, l]
        assert torch.equal(step_load, want_physical)
        assert torch.equal(fold_to_logical(step_load, bal.phy2log[l], bal.num_logical), want_logical)
        assert step_load.sum() == x.shape[0] * moe.top_k
    # the map sends every pair to a replica of its own expert, and uses the spare replicas
    assert all((bal.phy2log[l][p] == top).all() for l, (p, top) in enumerate(zip(physical, tops)))
    assert (bal.recorder.total[:, 8:] > 0).any()
    torch.set_grad_enabled(True)


@pytest.mark.parametrize("record, padded", [(True, True), (True, False), (False, False)])
def test_replica_kernel_equals_its_reference(record, padded):
    """kernels/replicas.py (the Triton interpreter on CPU, natively on CUDA): same slots, same counts."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    N, R, T, k = 16, 8, 37, 4
    phy2log = torch.cat([torch.arange(N), torch.randint(0, N, (R,), generator=gen)])[None]
    from nanodspark.eplb import inverse_map
    log2phy, logcnt = (t[0].to(dev) for t in inverse_map(phy2log, N, width=1 + R))
    ids = torch.stack([torch.randperm(N, generator=gen)[:k] for _ in range(T)]).to(dev)
    step = torch.tensor(5, device=dev)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=dev) if padded else None   # rows 30.. are padding
    loads = [torch.zeros(N + R, dtype=torch.long, device=dev) if record else None for _ in range(2)]
    want = map_to_replicas_ref(ids, log2phy, logcnt, step, cu, loads[0])
    got = map_to_replicas(ids, log2phy, logcnt, step, cu, loads[1])
    assert torch.equal(got, want) and (phy2log[0].to(dev)[got] == ids).all()
    if record:
        assert torch.equal(loads[0], loads[1]) and loads[1].sum() == (30 if padded else T) * k


def test_engine_counts_real_rows_only(tiny_dir):
    """In the engine, every MoE layer counts top_k pairs per row the model really computed:
    prompt rows plus decode rows, and not the padding rows of the graph tiers (on a CPU the
    padded buffers run eagerly, so the padding is there)."""
    llm = LLM(str(tiny_dir), use_tqdm=False, eplb=True, eplb_interval=0, eplb_window=10_000,
              graph_batch_sizes=(4,))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    rows = sum(len(p) for p in prompts) + sum(len(o.token_ids) - 1 for o in outs)
    bal = llm.engine.eplb
    assert bal.recorder.total.sum(1).tolist() == [rows * 2] * len(bal.moes)
    assert bal.recorder.steps == bal.steps > 0


# ----------------------------------------------------------------------------- output unchanged
def test_logits_do_not_depend_on_the_placement(tiny_dir):
    ids = torch.randint(0, 8192, (2, 9), generator=torch.Generator().manual_seed(1))
    model = load_model(tiny_dir)
    ref = _forward(model, ids)
    bal = _balancer(model, eplb_num_redundant_experts=8, eplb_ep_size=4)
    widened = _forward(model, ids)                             # trivial placement, 16 slots
    torch.testing.assert_close(widened, ref, rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(2)
    bal.recorder.total.copy_(torch.randint(0, 50, bal.recorder.total.shape, generator=gen) ** 2)
    old = bal.phy2log.clone()
    rec = bal.rebalance()
    assert rec["moved_slots"] > 0 and not torch.equal(old, bal.phy2log)
    for l, moe in enumerate(bal.moes):                         # every slot holds its expert's weights
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = getattr(moe.experts, name)
            assert torch.equal(w, getattr(model_ref_experts(tiny_dir, l), name)[bal.phy2log[l]])
    torch.testing.assert_close(_forward(model, ids), ref, rtol=1e-5, atol=1e-5)   # up to summation order


_REF = {}


def model_ref_experts(tiny_dir, l):
    if tiny_dir not in _REF:
        _REF[tiny_dir] = load_model(tiny_dir).moe_layers()
    return _REF[tiny_dir][l].experts


def test_greedy_output_is_unchanged_by_rebalancing_mid_generation(tiny_dir):
    """Requests in flight while the engine rebalances every 2 steps (8 redundant slots on 4
    simulated ranks), requests of different lengths, so new ones join mid-run: the same
    tokens as without EPLB, greedy and sampled (sampling is keyed by seed and position)."""
    prompts = [[5 + i, 40 + 3 * i, 99, 7 * i + 1, 12] for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 4, 7, 9)]
    params[3] = SamplingParams(temperature=0.8, max_tokens=9, seed=3, ignore_eos=True)
    want = LLM(str(tiny_dir), use_tqdm=False, max_num_seqs=3).generate(prompts, params)
    llm = LLM(str(tiny_dir), use_tqdm=False, max_num_seqs=3, eplb=True, eplb_interval=2,
              eplb_num_redundant_experts=8, eplb_ep_size=4, eplb_window=3)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    bal = llm.engine.eplb
    assert len(bal.rebalances) >= 4 and sum(r["moved_slots"] for r in bal.rebalances) > 0
    s = bal.stats()
    assert s["num_physical"] == 16 and len(s["rank_load"]) == 4 and s["rebalances"] == len(bal.rebalances)
    last = s["last_rebalance"]
    assert last["seconds"] > 0 and 0 < last["balancedness_before"] <= 1 and 0 < last["balancedness_after_predicted"] <= 1


def test_metrics_export_the_balance(tiny_dir):
    pytest.importorskip("prometheus_client")
    from nanodspark.server.metrics import Metrics
    llm = LLM(str(tiny_dir), use_tqdm=False, eplb=True, eplb_interval=0, eplb_ep_size=2,
              eplb_num_redundant_experts=2)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    m = Metrics()
    llm.engine.eplb.summary()                               # queues a host copy, no sync
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    summary = llm.engine.eplb.summary()                     # ... which has arrived now
    m.set_engine_state(0, 0, llm.engine.kv_usage(), None, summary)
    text = m.render()[0].decode()
    for name in ("nanodspark_eplb_balancedness", "nanodspark_eplb_straggler_factor",
                 'nanodspark_eplb_rank_load_tokens{rank="1"}', 'nanodspark_eplb_layer_balancedness{layer="0"}',
                 "nanodspark_eplb_rebalances"):
        assert name in text, name


# ----------------------------------------------------------------------------- the benchmark
def test_bench_eplb_runs_on_cpu_on_a_tiny_config(tiny_dir, tmp_path):
    from nanodspark.lab.bench import build_parser
    out = tmp_path / "eplb.json"
    argv = ["eplb", "--quick", "--model", str(tiny_dir), "--out", str(out), "--workloads", "math", "mix",
            "--prompts", "2", "--max-tokens", "3", "--ep-sizes", "2", "4", "--redundant", "0", "4",
            "--qwen-layers", "2", "--qwen-hidden", "32", "--qwen-intermediate", "16", "--qwen-steps", "4",
            "--qwen-tokens-per-step", "64", "--engine-prompts", "2", "--engine-max-tokens", "5",
            "--engine-interval", "2", "--engine-repeats", "1", "--kv-gb", "0.05"]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "eplb" and res["command"].startswith("python -m nanodspark.bench")
    assert res["hardware"]["name"] and res["versions"]["torch"] == torch.__version__
    assert {r["source"] for r in res["rows"]} == {"default:math", "default:mix", "qwen3-30b-a3b-shaped:mix"}
    assert {(r["ep_size"], r["redundant"]) for r in res["rows"]} == {(e, k) for e in (2, 4) for k in (0, 4)}
    for r in res["rows"]:
        assert 0 < r["balancedness_before"] <= 1 and 0 < r["balancedness_after"] <= 1
        assert r["straggler_before"] >= 1 and r["straggler_after"] >= 1
        assert r["moe_time_max_rank_before"] >= r["moe_time_mean_rank"] > 0
    eng = res["engine"]
    assert eng["greedy_identical"] and eng["rebalances"] >= 1 and eng["rebalance_seconds"]["max"] > 0
    assert set(eng["step_ms"]) == {"off", "map_only", "map_and_record"}
