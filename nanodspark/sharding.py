"""What each tensor-parallel rank holds of the target, and the layers that communicate.

What is split (rank r of N tensor-parallel ranks; `ShardLayout` computes every range)
    * **Attention**: the query heads, H/N per rank; q/k/v_proj are column-parallel (each rank
      holds the rows of its heads), o_proj is row-parallel (the columns of its heads). KV heads
      split the same way, or, when there are fewer KV heads than ranks, each rank keeps the one
      KV head its query heads read (replicated across the ranks that share it). Each rank's
      paged KV cache therefore holds only its own KV heads (`local_config`).
    * **Dense MLP**: gate/up column-parallel, down row-parallel (I/N of the intermediate each).
    * **MoE**: the router is replicated. The N ranks form `ep` expert groups of N/ep ranks:
      expert group g owns experts [g E/ep, (g+1) E/ep) ("EP"), and inside a group each expert's
      intermediate dimension is split N/ep ways (TP within the expert). ep = 1 is pure TP of
      every expert, ep = N pure EP (whole experts per rank). `ExpertShard.localize` points the
      (token, expert) pairs of other ranks' experts at local expert 0 with weight 0.
    * **Embedding and LM head**: vocab-parallel, ceil(V/N) rows each (the last rank's padded with
      zeros; tied embeddings stay tied). The embedding zeroes the ids outside its rows and
      all-reduces; the LM head computes its logit columns and all-gathers them.
    * **Replicated**: the norms, the router, the drafter (small; its own layers never
      communicate, its embedding and LM head are the target's vocab-parallel ones), the device
      state and the sampling.

Where the collectives are (per forward of the target, L layers)
    * 1 all-reduce after the embedding; 1 after o_proj and 1 after down_proj (or after the MoE
      output) in every layer: `model.tp_reduce`, called with the group that the forward's
      attention context carries (`PagedAttentionContext.tp`); 1 all-gather of the logits.
      So 2L + 1 all-reduces and one all-gather; the drafter adds one all-reduce (its block's
      embedding) and one all-gather (its logits).
    * MoE tokens are *not* dispatched with an all-to-all: under tensor parallelism every rank
      already holds every token (the attention output was all-reduced), so each rank runs its
      experts on the pairs routed to them and the MoE's partial sums join the same single
      all-reduce as a dense MLP. An all-to-all only pays when ranks hold different tokens
      (data-parallel attention), which this engine does not do.

Pure arithmetic and modules, no process group: the loader shards with `ShardLayout` and `shard_model`
(`plan_reads` says which slice of each checkpoint tensor a rank reads); the process group that
runs the ranks is distributed.py. Walkthrough chapter 14.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


# ----------------------------------------------------------------------------- what each rank holds
@dataclass(frozen=True)
class ShardLayout:
    """Which slice of the target rank `rank` of `size` holds; pure arithmetic, no process group
    (the loader shards with it, and the loader test uses it in one process)."""
    rank: int = 0
    size: int = 1            # tensor-parallel ranks (the world)
    ep_size: int = 1         # expert groups among them (divides size)

    @property
    def moe_tp(self) -> int:           # ranks sharing one expert group
        return self.size // self.ep_size

    def check(self, cfg: ModelConfig) -> None:
        n = self.size
        problems = []
        if cfg.num_attention_heads % n:
            problems.append(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of {n}")
        kv = cfg.num_key_value_heads
        if kv % n and n % kv:
            problems.append(f"num_key_value_heads={kv} neither divides nor is a multiple of {n}")
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) and cfg.intermediate_size % n:
            problems.append(f"intermediate_size={cfg.intermediate_size} is not a multiple of {n}")
        if self.ep_size < 1 or n % self.ep_size:
            problems.append(f"expert_parallel_size={self.ep_size} does not divide tensor_parallel_size={n}")
        elif cfg.num_experts:
            if cfg.num_experts % self.ep_size:
                problems.append(f"num_experts={cfg.num_experts} is not a multiple of "
                                f"expert_parallel_size={self.ep_size}")
            if cfg.moe_intermediate_size % self.moe_tp:
                problems.append(f"moe_intermediate_size={cfg.moe_intermediate_size} is not a multiple of "
                                f"{self.moe_tp} (tensor_parallel_size / expert_parallel_size)")
        elif self.ep_size > 1:
            problems.append("expert_parallel_size > 1 needs a mixture-of-experts model")
        if problems:
            raise ValueError(f"cannot split this {cfg.architecture} model over {n} ranks: " + "; ".join(problems))

    def heads(self, cfg: ModelConfig) -> tuple[int, int, int, int]:
        """(first q head, q heads, first kv head, kv heads) of this rank."""
        nq = cfg.num_attention_heads // self.size
        kv = cfg.num_key_value_heads
        if kv >= self.size:
            nkv = kv // self.size
            return self.rank * nq, nq, self.rank * nkv, nkv
        return self.rank * nq, nq, self.rank * kv // self.size, 1   # replicated KV head

    def split(self, n: int) -> tuple[int, int]:
        """(start, count) of an evenly split dimension."""
        c = n // self.size
        return self.rank * c, c

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of the vocab shard; rows = ceil(V / N) on every rank (padded)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, per

    def experts(self, cfg: ModelConfig) -> tuple[int, int, int, int]:
        """(first expert, experts, first intermediate column, columns) of this rank's MoE slice."""
        ne = cfg.num_experts // self.ep_size
        ni = cfg.moe_intermediate_size // self.moe_tp
        return (self.rank // self.moe_tp) * ne, ne, (self.rank % self.moe_tp) * ni, ni


def local_config(cfg: ModelConfig, layout: ShardLayout) -> ModelConfig:
    """The config as one rank's attention sees it (its q and kv heads): what sizes its KV cache."""
    _, nq, _, nkv = layout.heads(cfg)
    return dataclasses.replace(cfg, num_attention_heads=nq, num_key_value_heads=nkv)


# ----------------------------------------------------------------------------- the group
class TPGroup:
    """The tensor-parallel process group and the two collectives the model uses. Counts calls;
    with `timing` on it also sums the host time spent in them (synchronising on CUDA)."""

    def __init__(self, group, size: int, rank: int, backend: str):
        self.group, self.size, self.rank, self.backend = group, size, rank, backend
        self.calls = 0
        self.timing = False
        self.seconds = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        x = x.contiguous()
        self.calls += 1
        if not self.timing:
            dist.all_reduce(x, group=self.group)
            return x
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.seconds += time.perf_counter() - t0
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank order."""
        import torch.distributed as dist
        x = x.contiguous()
        self.calls += 1
        if self.backend == "nccl":
            out = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------- parallel layers
class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the embedding; the others' ids contribute zeros, and one
    all-reduce sums the ranks' parts into the full embedding."""

    def __init__(self, rows: int, dim: int, first: int, vocab_size: int, tp: TPGroup | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.first, self.rows, self.vocab_size, self.tp = first, rows, vocab_size, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(x) if self.tp is not None else x


class VocabParallelLMHead(nn.Module):
    """The logit columns [first, first + rows) of the LM head; one all-gather joins them (and
    drops the padding columns past the vocabulary)."""

    def __init__(self, rows: int, dim: int, first: int, vocab_size: int, tp: TPGroup | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.first, self.rows, self.vocab_size, self.tp = first, rows, vocab_size, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = F.linear(h, self.weight)
        if self.tp is not None:
            y = self.tp.all_gather_last(y)
        return y[..., :self.vocab_size]


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts [first, first + count) of an MoE layer (the trivial placement: one
    replica per expert; EPLB's physical slots would replace the contiguous range)."""
    first: int
    count: int

    def localize(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids -> local ones; pairs of other ranks' experts go to local expert 0
        with weight 0, so they add nothing. They are still computed: the grouped kernels take
        ids in [0, E) only, and dropping pairs would change the shapes a CUDA graph holds
        (a "skip" id in kernels/moe.py's align_pairs is the follow-up that saves this work)."""
        mine = (ids >= self.first) & (ids < self.first + self.count)
        return torch.where(mine, ids - self.first, 0), torch.where(mine, weights, torch.zeros_like(weights))


# ----------------------------------------------------------------------------- sharding a model
@dataclass(frozen=True)
class Read:
    """How one checkpoint tensor becomes (part of) one local parameter: rows or columns
    [start, stop) of it (`dim` None: all of it), stored at `index` of a stacked parameter."""
    param: str
    dim: int | None = None
    start: int = 0
    stop: int = 0
    index: int | None = None       # the local expert slot of a stacked experts parameter


def _linear(inp: int, out: int, bias: bool) -> nn.Linear:
    return nn.Linear(inp, out, bias=bias)


def shard_model(model: nn.Module, layout: ShardLayout, tp: TPGroup | None = None) -> None:
    """Give a freshly built `CausalLM` (on the meta device) this rank's local shapes: smaller
    Linear and Experts modules, local head counts, vocab-parallel embedding and LM head, the
    expert shard of each MoE layer. Weights are filled afterwards (`plan_reads`, loader.py)."""
    from .model import MLP, Experts, MoE
    cfg = model.config
    layout.check(cfg)
    H, D = cfg.hidden_size, cfg.head_dim
    q0, nq, kv0, nkv = layout.heads(cfg)
    for layer in model.model.layers:
        a = layer.self_attn
        bias = a.q_proj.bias is not None
        a.q_proj, a.k_proj, a.v_proj = _linear(H, nq * D, bias), _linear(H, nkv * D, bias), _linear(H, nkv * D, bias)
        a.o_proj = _linear(nq * D, H, bias and layout.rank == 0)       # a row-parallel bias is added once
        a.n_heads, a.n_kv = nq, nkv
        if isinstance(layer.mlp, MLP):
            _, ni = layout.split(cfg.intermediate_size)
            m = layer.mlp
            m.gate_proj, m.up_proj, m.down_proj = _linear(H, ni, False), _linear(H, ni, False), _linear(ni, H, False)
        elif isinstance(layer.mlp, MoE):
            e0, ne, _, ni = layout.experts(cfg)
            layer.mlp.experts = Experts(ne, H, ni)
            layer.mlp.ep = ExpertShard(e0, ne) if layout.ep_size > 1 else None
    v0, rows = layout.vocab(cfg.vocab_size)
    model.model.embed_tokens = VocabParallelEmbedding(rows, H, v0, cfg.vocab_size, tp)
    model.lm_head = VocabParallelLMHead(rows, H, v0, cfg.vocab_size, tp)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


_LAYER = r"^model\.layers\.(\d+)\."
_EXPERT = re.compile(_LAYER + r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def plan_reads(cfg: ModelConfig, layout: ShardLayout, keys: list[str], local: set[str]) -> dict[str, Read | None]:
    """For each checkpoint key: what this rank reads of it (None: another rank's, skipped).
    `local` are the names of the local model's parameters; a key that no rule knows and that the
    local model does not have is left out (the loader reports it as unexpected)."""
    D = cfg.head_dim
    q0, nq, kv0, nkv = layout.heads(cfg)
    i0, ni = layout.split(cfg.intermediate_size) if cfg.intermediate_size else (0, 0)
    v0, rows = layout.vocab(cfg.vocab_size)
    q_rows, kv_rows = (0, q0 * D, (q0 + nq) * D), (0, kv0 * D, (kv0 + nkv) * D)
    rules = {   # suffix -> (dim, start, stop); a Linear's weight is [out, in]
        "self_attn.q_proj.weight": q_rows, "self_attn.q_proj.bias": q_rows,
        "self_attn.k_proj.weight": kv_rows, "self_attn.k_proj.bias": kv_rows,
        "self_attn.v_proj.weight": kv_rows, "self_attn.v_proj.bias": kv_rows,
        "self_attn.o_proj.weight": (1, q0 * D, (q0 + nq) * D),
        "mlp.gate_proj.weight": (0, i0, i0 + ni), "mlp.up_proj.weight": (0, i0, i0 + ni),
        "mlp.down_proj.weight": (1, i0, i0 + ni),
    }
    plan: dict[str, Read | None] = {}
    for k in keys:
        m = _EXPERT.match(k)
        if m:
            e0, ne, j0, nj = layout.experts(cfg)
            layer, e, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            if not e0 <= e < e0 + ne:
                plan[k] = None
            else:
                plan[k] = Read(f"model.layers.{layer}.mlp.experts.{proj}", 1 if proj == "down_proj" else 0,
                               j0, j0 + nj, e - e0)
            continue
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            plan[k] = Read(k, 0, v0, min(v0 + rows, cfg.vocab_size)) if k in local else None
            continue
        suffix = re.sub(_LAYER, "", k)
        if suffix == "self_attn.o_proj.bias":
            plan[k] = Read(k) if k in local else None          # rank 0 only
        elif suffix in rules and k in local:
            plan[k] = Read(k, *rules[suffix])
        elif k in local:
            plan[k] = Read(k)                                   # replicated (norms, router)
    return plan
