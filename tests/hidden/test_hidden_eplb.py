"""Hidden tests of the `eplb` unit (run by `course grade`, never exported): the packing and the
replication on random loads, against their greedy rules written out with loops, and the
hierarchical placement's invariants."""
import random

import torch

from nanodspark.eplb import balanced_packing, rebalance_experts, replicate_experts


def test_balanced_packing_on_random_loads():
    rng = random.Random(9)
    for _ in range(40):
        packs, per = rng.randint(1, 5), rng.randint(2, 5)
        n = packs * per
        w = [[float(rng.choice([rng.randint(0, 5), rng.random() * 10])) for _ in range(n)] for _ in range(2)]
        pack, rank = balanced_packing(torch.tensor(w, dtype=torch.float64), packs)
        for x in range(2):
            load, count = [0.0] * packs, [0] * packs
            want_pack, want_rank = [0] * n, [0] * n
            for i in sorted(range(n), key=lambda i: (-w[x][i], i)):
                p = min((q for q in range(packs) if count[q] < per), key=lambda q: (load[q], q))
                want_pack[i], want_rank[i] = p, count[p]
                load[p] += w[x][i]
                count[p] += 1
            assert pack[x].tolist() == want_pack and rank[x].tolist() == want_rank


def test_replicate_experts_on_random_loads():
    rng = random.Random(10)
    for _ in range(40):
        n, extra = rng.randint(1, 8), rng.randint(0, 8)
        w = [float(rng.randint(0, 20)) for _ in range(n)]
        phy2log, rank, cnt = replicate_experts(torch.tensor([w], dtype=torch.float64), n + extra)
        replicas, want_p2l, want_rank = [1] * n, list(range(n)), [0] * n
        for _ in range(extra):
            e = max(range(n), key=lambda e: (w[e] / replicas[e], -e))
            want_p2l.append(e)
            want_rank.append(replicas[e])
            replicas[e] += 1
        assert phy2log[0].tolist() == want_p2l and rank[0].tolist() == want_rank and cnt[0].tolist() == replicas


def test_hierarchical_placement_keeps_groups_on_nodes_and_fills_every_gpu():
    gen = torch.Generator().manual_seed(11)
    for L, n, replicas, groups, nodes, gpus in [(2, 16, 24, 4, 2, 4), (3, 12, 16, 4, 2, 8), (1, 8, 8, 2, 1, 2)]:
        w = torch.randint(1, 200, (L, n), generator=gen).double()
        phy2log, log2phy, count = rebalance_experts(w, replicas, groups, nodes, gpus, policy="hierarchical")
        per_node, per_gpu = replicas // nodes, replicas // gpus
        for l in range(L):
            row = phy2log[l].tolist()
            assert sorted(set(row)) == list(range(n))                         # every expert placed
            assert [row.count(e) for e in range(n)] == count[l].tolist()
            for node in range(nodes):                                         # a group never spans nodes
                here = {e // (n // groups) for e in row[node * per_node:(node + 1) * per_node]}
                assert len(here) == groups // nodes
            for g in range(gpus):
                assert len(row[g * per_gpu:(g + 1) * per_gpu]) == per_gpu
