"""EPLB: record expert load, place redundant experts, rebalance a running engine (walkthrough 12).

With expert parallelism (EP) a forward waits for the busiest rank, and routing is skewed. EPLB
(DeepSeek-V3's "redundant experts"; deepseek-ai/EPLB, written here from its public description;
the recorder and the move follow vLLM's and SGLang's designs) gives a layer `num_physical >=
num_logical` expert *slots*, places replicas of hot experts in the extra slots, and packs the
slots onto ranks so that every rank gets about the same load.

The three parts of this file (chapter 12 walks through each)
    1. The recorder (`LoadRecorder`): every MoE layer adds the tokens routed to each physical
       slot into `load[layer]` on the device (inside captured graphs; padding rows not counted);
       `advance()`, once per step at launch, moves it into a ring of the last `window` steps.
    2. The placement (`rebalance_experts`, pure host functions): load `weight[L, num_logical]`
       -> `phy2log[L, num_physical]` (slots GPU-major), `log2phy[L, num_logical, max_count]`
       (-1 padded) and `logcnt`. Hierarchical: pack expert groups onto nodes, give each node's
       extra slots to the expert with the largest load per replica, pack replicas onto the
       node's GPUs (largest first, lightest GPU with room); global: one group, one node. Two
       replicas may share a GPU (the public algorithm's choice): `colocated_replicas` counts them.
    3. The move (`ExpertBalancer`, an engine observer): every `eplb_interval` steps, between
       two steps, it copies the changed slots' rows into the parameters in place (`index_copy_`:
       the storage graphs hold never changes) and overwrites the maps in place.

Routing to replicas (`ReplicaMap`; kernels/replicas.py on CUDA): token row t sends its pair
with logical expert e to replica `(t + step) mod logcnt[e]`, slot `log2phy[e, that replica]`;
`step` is a device counter advanced once per engine step.

Balancedness (`balance_stats`): per layer `mean_r(load_r) / max_r(load_r)` over the ranks r,
then the mean over layers. EP ranks are simulated on one device: rank r owns the slots
`[r * S, (r + 1) * S)`, `S = num_physical / ep_size`.

Invariants
    * every logical expert has at least one replica; every rank has exactly num_physical /
      ep_size slots; `log2phy` and `phy2log` are inverse (`check_placement`);
    * replicas hold identical weights, so the model's output does not depend on the placement
      (up to the summation order of the experts of a token on the reference path);
    * the forward reads only tensors that are updated in place (weights, `log2phy`, `logcnt`,
      `step`, `load`): a captured graph stays valid across rebalances;
    * the window only ever holds counts of the current placement (it is cleared by a
      rebalance), so folding it through the current `phy2log` is exact.
"""
from __future__ import annotations

import time

import torch

POLICIES = ("auto", "hierarchical", "global")
SUMMARY_EVERY = 32      # steps between the non-blocking host copies that summary() reads


# ----------------------------------------------------------------------------- 2. placement
def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the n items of each row of `weight[X, n]` into `num_packs` packs of exactly
    n / num_packs items: largest item first, each into the lightest pack that is not full
    (ties: the lower pack index). Returns (pack index, rank inside the pack), both [X, n]; the
    rank is the order in which the pack received its items."""
    X, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items cannot be split evenly into {num_packs} packs")
    per_pack = n // num_packs
    # BEGIN STUDENT eplb balanced-packing
    if per_pack == 1:      # one item per pack: nothing to balance, keep the order
        idx = torch.arange(n).expand(X, n).clone()
        return idx, torch.zeros(X, n, dtype=torch.long)
    pack = torch.empty(X, n, dtype=torch.long)
    rank = torch.empty(X, n, dtype=torch.long)
    for x in range(X):
        w = weight[x].tolist()
        load, count = [0.0] * num_packs, [0] * num_packs
        for i in sorted(range(n), key=lambda i: -w[i]):           # stable: ties keep item order
            p = min((q for q in range(num_packs) if count[q] < per_pack), key=lambda q: load[q])
            pack[x, i], rank[x, i] = p, count[p]
            load[p] += w[i]
            count[p] += 1
    return pack, rank
    # END STUDENT eplb


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn the n logical experts of each row of `weight[X, n]` into `num_phy` replicas: one
    each, then every extra replica to the expert with the largest load per replica (ties: the
    lower expert id). Returns phy2log [X, num_phy] (replicas 0..n-1 are the experts in order,
    then the extras in the order they were added), the replica's rank among its expert's
    replicas [X, num_phy], and the replica count per expert [X, n]."""
    X, n = weight.shape
    if num_phy < n:
        raise ValueError(f"{num_phy} slots cannot hold {n} experts")
    # BEGIN STUDENT eplb replicate
    rows = torch.arange(X)
    phy2log = torch.arange(num_phy).repeat(X, 1)
    rank = torch.zeros(X, num_phy, dtype=torch.long)
    logcnt = torch.ones(X, n, dtype=torch.long)
    w = weight.double()
    for i in range(n, num_phy):
        e = (w / logcnt).argmax(-1)            # the expert with the most load per replica
        phy2log[:, i], rank[:, i] = e, logcnt[rows, e]
        logcnt[rows, e] += 1
    return phy2log, rank, logcnt
    # END STUDENT eplb


def rebalance_hierarchical(weight: torch.Tensor, num_phy: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> torch.Tensor:
    """phy2log [L, num_phy] by the three steps of the hierarchical policy (module docstring)."""
    L, n = weight.shape
    group_size, groups_per_node = n // num_groups, num_groups // num_nodes
    log_per_node, phy_per_node = n // num_nodes, num_phy // num_nodes
    gpus_per_node, phy_per_gpu = num_gpus // num_nodes, num_phy // num_gpus
    # BEGIN STUDENT eplb hierarchical
    w = weight.double()
    # a. whole groups to nodes. node_experts[l, m] = the logical expert at "node-major"
    #    position m: node by node, its groups in the order they were packed, experts in order.
    node_of_group, rank_of_group = balanced_packing(w.view(L, num_groups, group_size).sum(-1), num_nodes)
    node_major_group = node_of_group * groups_per_node + rank_of_group            # [L, groups]
    node_experts = torch.empty(L, n, dtype=torch.long)
    for l in range(L):
        for g in range(num_groups):
            m = node_major_group[l, g] * group_size
            node_experts[l, m:m + group_size] = torch.arange(g * group_size, (g + 1) * group_size)
    # b. replicate inside each node: rows are (layer, node), columns that node's experts
    local_w = w.gather(1, node_experts).view(L * num_nodes, log_per_node)
    local_p2l, _, local_cnt = replicate_experts(local_w, phy_per_node)            # [L*nodes, phy_per_node]
    # c. pack each node's replicas onto its GPUs by load per replica
    per_replica = (local_w / local_cnt).gather(1, local_p2l)
    gpu, rank = balanced_packing(per_replica, gpus_per_node)
    slot = gpu * phy_per_gpu + rank                                               # slot inside the node
    phy2log = torch.empty(L, num_phy, dtype=torch.long)
    for row in range(L * num_nodes):
        l, node = divmod(row, num_nodes)
        experts = node_experts[l, node * log_per_node:(node + 1) * log_per_node]
        phy2log[l, node * phy_per_node + slot[row]] = experts[local_p2l[row]]
    return phy2log
    # END STUDENT eplb


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int = 1, num_nodes: int = 1,
                      num_gpus: int = 1, policy: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The public contract: load `weight[L, num_logical]` -> (phy2log [L, num_replicas],
    log2phy [L, num_logical, max_count] (-1 padded, slots in increasing order), logcnt
    [L, num_logical]). Slots are GPU-major. Raises ValueError on arguments the algorithm
    cannot honour."""
    weight = torch.as_tensor(weight).detach().cpu()
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, logical experts], got shape {tuple(weight.shape)}")
    L, n = weight.shape
    if n == 0 or L == 0:
        raise ValueError("weight has no experts or no layers")
    if not torch.isfinite(weight.double()).all() or (weight < 0).any():
        raise ValueError("weight must hold finite, non-negative loads")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                    ("num_gpus", num_gpus)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if num_replicas < n:
        raise ValueError(f"num_replicas={num_replicas} < {n} logical experts: every expert needs a slot")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} is not divisible by num_gpus={num_gpus}: "
                         "every GPU must hold the same number of slots")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} is not divisible by num_nodes={num_nodes}")
    if n % num_groups:
        raise ValueError(f"{n} logical experts are not divisible into num_groups={num_groups} groups")
    hierarchical = policy == "hierarchical" or (policy == "auto" and num_groups % num_nodes == 0)
    if hierarchical:
        if num_groups % num_nodes:
            raise ValueError(f"hierarchical policy: num_groups={num_groups} is not divisible by "
                             f"num_nodes={num_nodes} (use policy='global')")
        if num_replicas % num_nodes:
            raise ValueError(f"num_replicas={num_replicas} is not divisible by num_nodes={num_nodes}")
        phy2log = rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:                            # global: one group, one node, then pack onto every GPU
        phy2log = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    log2phy, logcnt = inverse_map(phy2log, n)
    return phy2log, log2phy, logcnt


def inverse_map(phy2log: torch.Tensor, num_logical: int, width: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phy [L, num_logical, width] with each expert's slots in increasing order, -1 padded;
    logcnt [L, num_logical]). width defaults to the largest replica count."""
    L, P = phy2log.shape
    logcnt = torch.zeros(L, num_logical, dtype=torch.long).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    width = width or int(logcnt.max())
    log2phy = torch.full((L, num_logical, width), -1, dtype=torch.long)
    for l in range(L):
        for e in range(num_logical):
            slots = (phy2log[l] == e).nonzero().flatten()
            log2phy[l, e, :len(slots)] = slots
    return log2phy, logcnt


def check_placement(phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, num_gpus: int) -> None:
    """Raise AssertionError unless the invariants hold: every expert has >= 1 replica, slots
    divide evenly over the GPUs, and log2phy / phy2log / logcnt describe the same placement."""
    L, P = phy2log.shape
    n = logcnt.shape[1]
    assert P % num_gpus == 0, f"{P} slots on {num_gpus} GPUs"
    assert (logcnt >= 1).all(), "an expert has no replica"
    assert (logcnt.sum(1) == P).all(), "replica counts do not add up to the slots"
    assert ((phy2log >= 0) & (phy2log < n)).all(), "a slot holds no valid expert"
    for l in range(L):
        for e in range(n):
            slots = log2phy[l, e][log2phy[l, e] >= 0]
            assert len(slots) == logcnt[l, e], f"layer {l} expert {e}: {len(slots)} slots, count {logcnt[l, e]}"
            assert (phy2log[l, slots] == e).all(), f"layer {l} expert {e}: log2phy and phy2log disagree"


def keep_in_place(old: torch.Tensor, new: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """`new` [L, P] with the slots of each GPU reordered so that an expert the GPU already held
    stays in its old slot where possible. Same experts per GPU, so the same balance; fewer
    slots to move."""
    L, P = new.shape
    S = P // num_gpus
    out = new.clone()
    for l in range(L):
        for g in range(num_gpus):
            was, want = old[l, g * S:(g + 1) * S].tolist(), new[l, g * S:(g + 1) * S].tolist()
            place, rest = [None] * S, []
            for e in want:
                i = next((i for i in range(S) if place[i] is None and was[i] == e), None)
                if i is None:
                    rest.append(e)
                else:
                    place[i] = e
            free = iter(i for i in range(S) if place[i] is None)
            for e in rest:
                place[next(free)] = e
            out[l, g * S:(g + 1) * S] = torch.tensor(place)
    return out


def colocated_replicas(phy2log: torch.Tensor, num_gpus: int) -> int:
    """How many slots hold an expert that an earlier slot of the same GPU already holds."""
    L, P = phy2log.shape
    per_gpu = phy2log.view(L, num_gpus, P // num_gpus)
    return sum(len(row) - len(set(row)) for row in per_gpu.reshape(L * num_gpus, -1).tolist())


# ----------------------------------------------------------------------------- metrics
def replica_load(logical: torch.Tensor, phy2log: torch.Tensor) -> torch.Tensor:
    """Expected load per slot [L, P] when each expert's load [L, N] splits evenly over its
    replicas (what the routing rule does, up to one token per expert and step)."""
    cnt = torch.zeros_like(logical, dtype=torch.double).scatter_add_(
        1, phy2log, torch.ones_like(phy2log, dtype=torch.double))
    return (logical.double() / cnt).gather(1, phy2log)


def fold_to_logical(phys: torch.Tensor, phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Load per slot [..., L, P] -> load per logical expert [..., L, N] (sums the replicas)."""
    idx = phy2log.expand_as(phys)
    return torch.zeros(*phys.shape[:-1], num_logical, dtype=phys.dtype, device=phys.device).scatter_add_(-1, idx, phys)


def balance_stats(slot_load: torch.Tensor, ep_size: int) -> dict:
    """Per-rank load and balance of a load per slot [L, P] on `ep_size` simulated ranks.

    balancedness per layer = mean_r(load_r) / max_r(load_r); straggler = max / mean; both
    averaged over the layers that saw any token (the ratio first). modelled_moe_time: the
    step waits for its busiest rank in every layer, sum_l max_r, against sum_l mean_r."""
    L, P = slot_load.shape
    if P % ep_size:
        raise ValueError(f"{P} slots cannot be split over ep_size={ep_size} ranks")
    ranks = slot_load.double().view(L, ep_size, P // ep_size).sum(-1)          # [L, ep]
    mean, mx = ranks.mean(1), ranks.max(1).values
    busy = mx > 0
    bal = torch.where(busy, mean / mx.clamp(min=1e-30), torch.nan)
    strag = torch.where(busy, mx / mean.clamp(min=1e-30), torch.nan)
    return {
        "balancedness": float(bal[busy].mean()) if busy.any() else None,
        "straggler": float(strag[busy].mean()) if busy.any() else None,
        "balancedness_per_layer": [None if b != b else round(float(b), 4) for b in bal.tolist()],
        "rank_load": [round(float(x), 2) for x in ranks.sum(0).tolist()],
        "rank_load_per_layer": [[round(float(x), 2) for x in r] for r in ranks.tolist()],
        "modelled_moe_time": {"max_rank": float(mx.sum()), "mean_rank": float(mean.sum())},
    }


def trivial_placement(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """The start: slot s holds expert s mod num_logical (the extra slots copy experts 0, 1, ...)."""
    return (torch.arange(num_physical) % num_logical).repeat(num_layers, 1)


# ----------------------------------------------------------------------------- 1. recorder
class LoadRecorder:
    """Tokens per physical slot per step, for the last `window` steps, on the device.

    `load[L, P]` is the running count the MoE layers add into (layer l's `ReplicaMap` holds the
    view `load[l]`, which is also the layer's `expert_load`); `advance()` closes a step: the count goes into the ring
    `window[W, L, P]`, `total` keeps the window's sum, the count restarts from zero."""

    def __init__(self, num_layers: int, num_physical: int, window: int, device):
        if window < 1:
            raise ValueError(f"the load window must hold at least one step, got {window}")
        self.window_size = window
        self.load = torch.zeros(num_layers, num_physical, dtype=torch.long, device=device)
        self.window = torch.zeros(window, num_layers, num_physical, dtype=torch.long, device=device)
        self.total = torch.zeros(num_layers, num_physical, dtype=torch.long, device=device)
        self.steps = 0                        # steps closed since the last reset

    def advance(self) -> None:
        """Close one engine step (host side, after its launch; in-place device ops, no sync)."""
        slot = self.window[self.steps % self.window_size]
        self.total += self.load - slot        # the oldest step leaves the window, this one enters
        slot.copy_(self.load)
        self.load.zero_()
        self.steps += 1

    def reset(self) -> None:
        for t in (self.load, self.window, self.total):
            t.zero_()
        self.steps = 0

    def steps_in_window(self) -> int:
        return min(self.steps, self.window_size)

    def per_step(self) -> torch.Tensor:
        """The window's steps, oldest first [steps, L, P] (host copy; a sync)."""
        n, W = self.steps_in_window(), self.window_size
        order = [(self.steps - n + i) % W for i in range(n)]
        return self.window[order].cpu()


# ----------------------------------------------------------------------------- 3. the forward's map and the move
class ReplicaMap:
    """What one MoE layer's forward reads to send (token, logical expert) to a slot and count
    it. Fixed shapes, updated in place only: `log2phy [N, 1 + num_redundant]` (-1 padded),
    `logcnt [N]`, `step` (a device counter shared by the layers) and `load [P]` (this layer's
    row of the recorder)."""

    def __init__(self, log2phy: torch.Tensor, logcnt: torch.Tensor, step: torch.Tensor, load: torch.Tensor,
                 record: bool = True):
        self.log2phy, self.logcnt, self.step, self.load, self.record = log2phy, logcnt, step, load, record
        if log2phy.is_cuda:         # one Triton launch per layer (kernels/replicas.py)
            from kernels.replicas import map_to_replicas as fn
        else:                       # its PyTorch reference
            from kernels.replicas import map_to_replicas_ref as fn
        self._map = fn

    def __call__(self, ids: torch.Tensor, ctx=None) -> torch.Tensor:
        """Physical slot of each (token, expert) of `ids [T, k]`: replica (t + step) mod
        logcnt[e] of expert e; with `record`, the pairs of rows below `ctx.cu_seqlens_q[-1]`
        are counted into `load` (every row without a `cu_seqlens_q`)."""
        return self._map(ids, self.log2phy, self.logcnt, self.step, getattr(ctx, "cu_seqlens_q", None),
                         self.load if self.record else None)

    def update(self, log2phy: torch.Tensor, logcnt: torch.Tensor) -> None:
        """A new placement, written into the same tensors (a graph holds their addresses)."""
        self.log2phy.copy_(log2phy)
        self.logcnt.copy_(logcnt)


class ExpertBalancer:
    """EPLB in a running engine: told of each launch (`launched`, which closes the step in the
    recorder) and an observer of committed step results (engine.py `observers`: rebalancing).

    Built by the engine before any graph is captured: it widens every MoE layer to
    `num_logical + num_redundant` slots (the trivial placement), gives each layer a
    `ReplicaMap` and a view of the recorder, and from then on only writes in place."""

    def __init__(self, model, config, device):
        cfg = config
        self.moes = model.moe_layers()
        if not self.moes:
            raise ValueError("eplb=True needs a mixture-of-experts target; this model has no MoE layer")
        self.num_logical = n = self.moes[0].n_experts
        self.num_redundant = r = cfg.eplb_num_redundant_experts
        self.num_physical = p = n + r
        self.ep_size, self.policy = cfg.eplb_ep_size, cfg.eplb_policy
        self.num_groups, self.num_nodes = cfg.eplb_num_groups, cfg.eplb_num_nodes
        self.interval, self.device = cfg.eplb_interval, torch.device(device)
        if p % self.ep_size:
            raise ValueError(f"{n} experts + {r} redundant = {p} slots cannot be split over "
                             f"eplb_ep_size={self.ep_size} ranks; choose num_redundant_experts so that "
                             f"the sum is a multiple of the EP size")
        # the policy's arguments are checked once here, so a rebalance cannot fail later
        rebalance_experts(torch.ones(1, n), p, self.num_groups, self.num_nodes, self.ep_size, self.policy)
        L = len(self.moes)
        self.phy2log = trivial_placement(L, n, p)
        log2phy, logcnt = inverse_map(self.phy2log, n, width=1 + r)
        self.step = torch.zeros((), dtype=torch.long, device=self.device)
        self.recorder = LoadRecorder(L, p, cfg.eplb_window, self.device)
        self.maps = []
        with torch.no_grad():
            for l, moe in enumerate(self.moes):
                ex = moe.experts
                for name in ("gate_proj", "up_proj", "down_proj"):    # slot s holds expert s mod n
                    w = getattr(ex, name)
                    setattr(ex, name, torch.nn.Parameter(w[self.phy2log[l].to(w.device)].contiguous(),
                                                         requires_grad=False))
                m = ReplicaMap(log2phy[l].to(self.device), logcnt[l].to(self.device), self.step,
                               self.recorder.load[l])
                self.maps.append(m)
                moe.replicas = m
                moe.expert_load = m.load          # the layer's counts, per physical slot
                moe.record_load = True
        g = self.moes[0].experts.gate_proj
        self.staging = torch.empty(g.numel(), dtype=g.dtype, device=g.device)   # one layer's weights
        self.steps = 0
        self.rebalances: list[dict] = []
        self._summary, self._pending = None, None

    @property
    def recording(self) -> bool:
        return self.maps[0].record

    def set_recording(self, on: bool) -> None:
        """Count tokens per slot (the default) or only map them to replicas: a benchmark's control
        (`bench eplb`), not a serving knob. The forward reads the choice when it is traced, so
        CUDA graphs captured before must be captured again. Rebalancing needs the counts."""
        if not on and self.interval:
            raise ValueError("rebalancing (eplb_interval > 0) needs the recorder: recording can be "
                             "turned off only with eplb_interval=0")
        for m, moe in zip(self.maps, self.moes):
            m.record = moe.record_load = on

    # -- the observer ---------------------------------------------------------------------
    def launched(self) -> None:
        """Right after a step's forward is enqueued: close it in the recorder (in-place device ops,
        ordered after that forward and before the next). At launch, not at commit: the overlapped
        loop launches step n+1 before it commits step n, and both would land in one window row."""
        self.recorder.advance()
        self.step += 1

    def observe(self, result) -> None:
        """After each committed step: every `interval` steps, rebalance."""
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            self.rebalance()
        elif self.steps % SUMMARY_EVERY == 0:
            self._queue_summary()

    # -- the move -------------------------------------------------------------------------
    @torch.no_grad()
    def rebalance(self) -> dict | None:
        """A new placement from the window, moved into place between two steps. Returns the
        record appended to `rebalances` (times, slots moved, balance before and predicted
        after), or None when the window saw no token."""
        t0 = time.perf_counter()
        slot_load = self.recorder.total.to("cpu", copy=True)      # waits for the step in flight
        if not int(slot_load.sum()):
            return None                                           # no traffic in the window: keep the placement
        t_read = time.perf_counter()
        logical = fold_to_logical(slot_load, self.phy2log, self.num_logical)
        new_p2l, _, _ = rebalance_experts(logical, self.num_physical, self.num_groups, self.num_nodes,
                                          self.ep_size, self.policy)
        new_p2l = keep_in_place(self.phy2log, new_p2l, self.ep_size)
        log2phy, logcnt = inverse_map(new_p2l, self.num_logical, width=1 + self.num_redundant)
        t_place = time.perf_counter()
        moved = 0
        for l, moe in enumerate(self.moes):
            moved += self._move(moe.experts, self.phy2log[l], new_p2l[l])
            self.maps[l].update(log2phy[l].to(self.device), logcnt[l].to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)                   # the pause is the move, measured
        before = balance_stats(slot_load, self.ep_size)
        after = balance_stats(replica_load(logical, new_p2l), self.ep_size)
        self.phy2log = new_p2l
        self.recorder.reset()                                     # the window describes one placement
        t1 = time.perf_counter()
        rec = {"step": self.steps, "seconds": t1 - t0, "read_s": t_read - t0, "placement_s": t_place - t_read,
               "move_s": t1 - t_place, "moved_slots": moved,
               "window_tokens": int(slot_load.sum()),
               "balancedness_before": before["balancedness"], "straggler_before": before["straggler"],
               "balancedness_after_predicted": after["balancedness"],
               "straggler_after_predicted": after["straggler"],
               "colocated_replicas": colocated_replicas(new_p2l, self.ep_size)}
        self.rebalances.append(rec)
        self._summary, self._pending = None, None
        return rec

    def _move(self, experts, old: torch.Tensor, new: torch.Tensor) -> int:
        """Give every slot whose expert changes the weights of a slot that holds that expert now:
        gather the sources into the staging buffer, then copy into place (same storage)."""
        dst = (old != new).nonzero().flatten()
        if not len(dst):
            return 0
        holder = {}
        for s, e in enumerate(old.tolist()):
            holder.setdefault(e, s)
        src = torch.tensor([holder[e] for e in new[dst].tolist()], device=self.device)
        dst = dst.to(self.device)
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = getattr(experts, name)
            buf = self.staging[:len(dst) * w[0].numel()].view(len(dst), *w.shape[1:])
            torch.index_select(w, 0, src, out=buf)                # staging: nothing read is overwritten
            w.index_copy_(0, dst, buf)
        return len(dst)

    # -- metrics --------------------------------------------------------------------------
    def stats(self) -> dict:
        """Balance of the current window (exact: reads the device, a sync) and the history."""
        return self._stats(self.recorder.total.to("cpu", copy=True))

    def summary(self) -> dict | None:
        """What /metrics shows: the stats of a host copy made at most SUMMARY_EVERY steps ago
        without a sync (the server calls this after every loop iteration)."""
        if self._pending is not None:
            host, event = self._pending
            if event is None or event.query():
                self._summary, self._pending = self._stats(host), None
        if self._summary is None and self._pending is None:
            self._queue_summary()
        return self._summary

    def _queue_summary(self) -> None:
        cuda = self.device.type == "cuda"
        host = torch.empty(self.recorder.total.shape, dtype=torch.long, pin_memory=cuda)
        host.copy_(self.recorder.total, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (host, event)

    def _stats(self, slot_load: torch.Tensor) -> dict:
        s = balance_stats(slot_load, self.ep_size)
        s.update(ep_size=self.ep_size, num_logical=self.num_logical, num_physical=self.num_physical,
                 num_redundant=self.num_redundant, policy=self.policy, interval=self.interval,
                 steps=self.steps, window_steps=self.recorder.steps_in_window(),
                 window_tokens=int(slot_load.sum()), rebalances=len(self.rebalances),
                 last_rebalance=self.rebalances[-1] if self.rebalances else None,
                 colocated_replicas=colocated_replicas(self.phy2log, self.ep_size),
                 phy2log=self.phy2log.tolist())
        return s
