"""The target model: a Qwen3-family decoder run over a packed ragged batch.

Idea. One forward takes a flat list of tokens `input_ids[T]` with their absolute `positions[T]`.
Request r owns rows `cu_seqlens_q[r]:cu_seqlens_q[r+1]`: a prefill chunk, one decode token or a
verify window; the model itself never cares which. Everything about *where keys and values
live* is delegated to an attention context passed in by the caller (`ctx.attend`):

* `PagedAttentionContext` stores K/V into the paged cache and attends over it (serving);
* `DenseAttentionContext` runs plain causal attention over `[batch, seq]` (training);
* the drafter brings its own context (block attention over injected target features).

Architecture (Hugging Face names, so checkpoints load key for key): token embedding; per layer
RMSNorm -> attention (GQA; Qwen3 normalises q and k per head before rotate-half RoPE; Llama does
not) -> residual -> RMSNorm -> SwiGLU MLP or a top-k mixture of experts -> residual; final
RMSNorm; LM head (tied or not). Per-layer attention type comes from `layer_types`
(`full_attention` / `sliding_attention`).

Invariants. The MoE experts of a layer are stored stacked (`[E, out, in]`); the loader maps
them to and from the per-expert Hugging Face keys. EPLB (eplb.py) may widen a layer to more
expert slots than logical experts (replicas of hot experts) and give it a `ReplicaMap` that
sends each (token, expert) to one replica's slot; `MoE.expert_load` counts the tokens routed
to each slot while `record_load` is on. No module-level mutable state.
Tensor parallel (distributed.py): the loader gives the modules local shapes; the forward sums
partial outputs with `tp_reduce` after o_proj, down_proj and the MoE, over `ctx.tp`.
Checked against `transformers` in `tests/test_model.py`. Walkthrough chapter 01.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import FULL, SLIDING, ModelConfig


# ----------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding:
    """A config's RoPE, computed once: inverse frequencies (fp32) and the scale of cos/sin.

    Types as in transformers 5 (`ModelConfig.rope_type`; the formulas of its RoPE utilities):
    default; linear (positions divided by `factor`); dynamic (NTK: plain RoPE up to
    max_position_embeddings, the only range served, `ModelConfig.check_max_model_len`); llama3
    (low frequencies divided by `factor`, high ones kept, a smooth ramp between, by wavelength
    against the original context); yarn (per-frequency blend of interpolation and extrapolation
    over a ramp set by beta_fast/beta_slow, and cos/sin scaled by its attention factor, mscale).
    None of them depends on the positions, so a forward only multiplies positions by a cached
    tensor: no host sync, nothing recomputed (CUDA-graph safe once a first, eager forward has put
    the table on the device).
    """

    def __init__(self, head_dim: int, theta: float, rope_type: str = "default", params: dict | None = None):
        p = params or {}
        # explicit device: models are built under torch.device("meta") by the loader
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        scale = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / p["factor"]
        elif rope_type == "llama3":
            factor, lo, hi, old = (p[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"))
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
            smooth = (old / wavelen - lo) / (hi - lo)
            medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
            inv_freq = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
        elif rope_type == "yarn":
            inv_freq, scale = _yarn(head_dim, theta, p)
        elif rope_type not in ("default", "dynamic"):
            raise ValueError(f"unsupported rope type {rope_type!r}")
        self.inv_freq, self.attention_scaling = inv_freq, float(scale)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "RotaryEmbedding":
        return cls(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        t = self._on_device.get(device)
        if t is None:
            t = self._on_device[device] = self.inv_freq.to(device)
        return t


def _yarn(dim: int, theta: float, p: dict) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and attention factor (transformers' `_compute_yarn_parameters`)."""
    factor, old = p["factor"], p["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):   # the dimension whose wavelength makes `rotations` turns in `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, attn


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 rope: RotaryEmbedding | None = None):
    """cos/sin tables `[T, head_dim]` for the rotate-half RoPE layout, computed in fp32.

    rope: a model's `RotaryEmbedding` (scaled frequencies and cos/sin scale, precomputed); None
    = plain RoPE of `theta` (the drafter). Device work only: positions never leave the device."""
    if rope is None:
        inv_freq, scale = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                                        dtype=torch.float32) / head_dim)), 1.0
    else:
        inv_freq, scale = rope.inv_freq_on(positions.device), rope.attention_scaling
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.window_of(layer_idx)
        self.scale = self.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_weight = self.qkv_bias = None     # set by fuse(): one GEMM for q, k and v

    def fuse(self) -> None:
        """One weight for the three projections; q/k/v_proj become views of it (same storage)."""
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_bias = None if self.q_proj.bias is None else torch.cat(
            [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])

    def project(self, x: torch.Tensor, ops: "Ops") -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D]: q heads, then k heads, then v heads."""
        if self.qkv_weight is not None:
            return ops.linear(x, self.qkv_weight, self.qkv_bias)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def split_norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The reference of kernels/fused.py: q [T,Hq,D], k [T,Hkv,D] normalised (Qwen3) and
        rotated; v [T,Hkv,D]."""
        T, D = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.n_heads * D, self.n_kv * D, self.n_kv * D], dim=-1)
        q, k, v = q.reshape(T, self.n_heads, D), k.reshape(T, self.n_kv, D), v.reshape(T, self.n_kv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx) -> torch.Tensor:
        o = ctx.attend(self, self.project(x, ctx.ops), cos, sin)
        return tp_reduce(ctx.ops.linear(o.reshape(x.shape[0], -1), self.o_proj.weight, self.o_proj.bias), ctx)


def tp_reduce(x: torch.Tensor, ctx) -> torch.Tensor:
    """Sum a row-parallel block's partial outputs over the tensor-parallel ranks: the group the
    forward's attention context carries (`ctx.tp`, distributed.py). A no-op in one process and
    for contexts without a group (the drafter's own layers are replicated)."""
    tp = getattr(ctx, "tp", None)
    return x if tp is None else tp.all_reduce(x)


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the weights of `linears` along their outputs and make each weight a view of
    the result, so the model keeps its Hugging Face parameters without holding them twice."""
    fused = torch.cat([l.weight.detach() for l in linears])
    start = 0
    for l in linears:
        n = l.weight.shape[0]
        l.weight = nn.Parameter(fused[start:start + n], requires_grad=False)
        start += n
    return fused


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up_weight = None                # set by fuse(): one GEMM for gate and up

    def fuse(self) -> None:
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x, ctx):
        if self.gate_up_weight is not None:
            return tp_reduce(ctx.ops.linear(ctx.ops.silu_mul(ctx.ops.linear(x, self.gate_up_weight)),
                                            self.down_proj.weight), ctx)
        return tp_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), ctx)


class Experts(nn.Module):
    """E SwiGLU experts stored stacked: gate/up `[E, I, H]`, down `[E, H, I]`. Row e is expert
    slot e: the logical expert e, or, once EPLB has widened the layer, whichever replica the
    placement put there (eplb.py)."""

    def __init__(self, n: int, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(n, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, inter))
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)


class MoE(nn.Module):
    """Softmax router, top-k experts, optional renormalisation of the top-k weights.

    With EPLB (eplb.py) `replicas` maps the router's logical ids to physical expert slots and
    counts the pairs per slot into `expert_load`; without, slot e is expert e."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.register_buffer("expert_load", torch.zeros(cfg.num_experts, dtype=torch.long), persistent=False)
        self.record_load = False
        self.ep = None            # expert parallel: this rank's ExpertShard (distributed.py)
        self.replicas = None      # EPLB: an eplb.ReplicaMap, logical expert -> physical slot (None: identity)

    def route(self, x: torch.Tensor, ops: "Ops | None" = None):
        if ops is not None and ops.route_topk is not None:    # the same, fused (kernels/moe.py)
            weights, ids = ops.route_topk(ops.linear(x, self.gate.weight), self.top_k, self.norm_topk)
            return weights.to(x.dtype), ids
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        weights, ids = self.route(x, ctx.ops)
        if self.replicas is not None:    # EPLB: each (token, expert) to a replica's slot, counted there
            ids = self.replicas(ids, ctx)
        elif self.record_load:   # on the device, no host sync (a scatter, not a bincount)
            flat = ids.flatten()
            self.expert_load.scatter_add_(0, flat, torch.ones_like(flat))
        if self.ep is not None:
            ids, weights = self.ep.localize(ids, weights)
        w = self.experts
        return tp_reduce(ctx.ops.experts(x, ids, weights, w.gate_proj, w.up_proj, w.down_proj), ctx)


def torch_experts(x, ids, weights, w_gate, w_up, w_down) -> torch.Tensor:
    """The reference MoE FFN: group the (token, slot) pairs by expert and run each expert on its
    group. It reads the group sizes on the host (one sync per layer), so it cannot be captured
    in a CUDA graph; kernels/moe.py is the graph-safe version."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=w_gate.shape[0])
    order = torch.argsort(flat, stable=True)           # group (token, slot) pairs by expert
    token_of = order // top_k
    xs = x[token_of]
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts.tolist()):            # the host sync
        if n:
            seg = xs[start:start + n]
            h = F.silu(seg @ w_gate[e].t()) * (seg @ w_up[e].t())
            out[start:start + n] = h @ w_down[e].t()
        start += n
    out = out * weights.flatten()[order][:, None]
    return torch.zeros_like(x).index_add_(0, token_of, out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, i)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, residual, cos, sin, ctx):
        """Pre-norm block on the residual stream: takes the previous block's output `x` and the
        stream before it (None for the first layer), returns this block's output and stream.
        Adding `x` to the stream is fused with the norm that follows it (ops.add_rmsnorm)."""
        h, residual = ctx.ops.add_rmsnorm(x, residual, self.input_layernorm)
        x = self.self_attn(h, cos, sin, ctx)
        h, residual = ctx.ops.add_rmsnorm(x, residual, self.post_attention_layernorm)
        return self.mlp(h, ctx), residual

    def fuse(self) -> None:
        self.self_attn.fuse()
        if isinstance(self.mlp, MLP):
            self.mlp.fuse()


class DecoderStack(nn.Module):
    """`model.*` in Hugging Face naming."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ModelOutput:
    hidden: torch.Tensor                          # [T, H] after the final norm
    captured: list[torch.Tensor] = field(default_factory=list)  # raw outputs of the requested layers


class CausalLM(nn.Module):
    """Qwen3 / Qwen3-MoE / Llama causal LM over a packed token list."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.rotary = RotaryEmbedding.from_config(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
                capture_layers: tuple[int, ...] = ()) -> ModelOutput:
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype, self.rotary)
        captured, residual = [], None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, ctx)
            if i in capture_layers:
                captured.append(x + residual)           # the layer's output (the stream after it)
        return ModelOutput(ctx.ops.add_rmsnorm(x, residual, self.model.norm)[0], captured)

    def fuse(self) -> "CausalLM":
        """Fuse q/k/v and gate/up weights for the Triton path (one GEMM each); idempotent."""
        for layer in self.model.layers:
            if layer.self_attn.qkv_weight is None:
                layer.fuse()
        return self

    def compute_logits(self, hidden: torch.Tensor, ops: "Ops | None" = None) -> torch.Tensor:
        # a vocab-parallel head (distributed.py) gathers its shards in its own forward
        if ops is None or type(self.lm_head) is not nn.Linear:
            return self.lm_head(hidden).float()
        return ops.linear(hidden, self.lm_head.weight).float()

    def moe_layers(self) -> list[MoE]:
        return [l.mlp for l in self.model.layers if isinstance(l.mlp, MoE)]


# ----------------------------------------------------------------------------- attention contexts
def kv_groups(cfg: ModelConfig) -> dict[str, list[int]]:
    """Layer indices of each KV group: 'full' (prefix cacheable) and 'sliding' (window)."""
    groups = {FULL: [], SLIDING: []}
    for i, t in enumerate(cfg.layer_types):
        groups[t].append(i)
    return {("full" if t == FULL else "sliding"): ls for t, ls in groups.items() if ls}


class KVCache:
    """The device tensors of the paged KV cache, one per group:
    `[n_layers_in_group, 2, num_blocks, block_size, n_kv_heads, head_dim]`."""

    def __init__(self, cfg: ModelConfig, num_blocks: dict[str, int], block_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.block_size = block_size
        self.groups = kv_groups(cfg)                # group name -> its layer ids
        self.group_of: dict[int, tuple[str, int]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        for g, layers in self.groups.items():
            for j, i in enumerate(layers):
                self.group_of[i] = (g, j)
            self.tensors[g] = torch.zeros(len(layers), 2, num_blocks[g], block_size,
                                          cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)

    def layer(self, i: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        g, j = self.group_of[i]
        t = self.tensors[g]
        return g, t[j, 0], t[j, 1]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, n_layers: int, block_size: int, dtype: torch.dtype) -> int:
        return n_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()


@dataclass
class GroupMeta:
    """Per-KV-group addressing of one forward."""
    block_tables: torch.Tensor          # int32 [B, max_blocks]
    cache_index: torch.Tensor           # int64 [T]: where each row's K/V goes; -1 = do not store
    kv_lens: torch.Tensor               # int32 [B], cached tokens including this forward's
    kv_start: torch.Tensor | None = None  # int32 [B], first position attention may read


@dataclass(frozen=True)
class Ops:
    """The kernels one forward runs. `TORCH_OPS` is the reference (plain PyTorch, runs anywhere,
    defines the semantics); `triton_ops()` fuses the small ops (kernels/fused.py), runs the MoE
    without a host sync (kernels/moe.py) and attends with kernels/paged_attention.py."""
    name: str
    add_rmsnorm: Callable        # (x, residual | None, norm: RMSNorm) -> (norm(x + residual), x + residual)
    norm_rope_store: Callable    # (attn, qkv, cos, sin, k_cache, v_cache, cache_index) -> q, K/V stored
    kv_norm_rope_store: Callable  # (attn, x, cos, sin, k_cache, v_cache, cache_index): K/V of x only (no q)
    paged_attention: Callable    # kernels.paged_attention's contract
    silu_mul: Callable           # gate_up [T, 2I] -> silu(gate) * up
    experts: Callable            # (x, ids, weights, w_gate, w_up, w_down) -> [T, H]
    linear: Callable = F.linear  # (x, w, b=None) -> x @ w.T + b
    route_topk: Callable | None = None   # (router logits, k, renorm) -> (weights fp32, ids); None: torch


def _torch_add_rmsnorm(x, residual, norm: RMSNorm):
    if residual is not None:
        x = x + residual
    return norm(x), x


def _torch_norm_rope_store(attn: Attention, qkv, cos, sin, k_cache, v_cache, cache_index):
    from kernels.reference import store_kv_ref
    q, k, v = attn.split_norm_rope(qkv, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, cache_index)
    return q


def _torch_kv_norm_rope_store(attn: Attention, x, cos, sin, k_cache, v_cache, cache_index):
    from kernels.reference import store_kv_ref
    T, D = x.shape[0], attn.head_dim
    k = attn.k_proj(x).view(T, attn.n_kv, D)
    v = attn.v_proj(x).view(T, attn.n_kv, D)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    store_kv_ref(apply_rope(k, cos, sin), v, k_cache, v_cache, cache_index)


def _torch_silu_mul(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def _torch_paged_attention(*args, **kwargs):
    from kernels.reference import paged_attention_batched      # the reference's rule, every request at once
    return paged_attention_batched(*args, **kwargs)


TORCH_OPS = Ops("torch", _torch_add_rmsnorm, _torch_norm_rope_store, _torch_kv_norm_rope_store,
                _torch_paged_attention, _torch_silu_mul, torch_experts)


def triton_ops(batch_invariant: bool = False) -> Ops:
    """The fused kernels; `batch_invariant`: with the fixed-order matmul, MoE and attention
    schedule of kernels/batch_invariant.py (a row's numbers independent of the batch)."""
    from kernels import paged_attention
    from kernels.fused import add_rmsnorm, qk_norm_rope_store, silu_mul
    from kernels.linear import SkinnyLinear
    from kernels.moe import fused_moe, route_topk
    linear = SkinnyLinear()      # the library's GEMM until `linear.tune` finds faster shapes
    name, experts = "triton", fused_moe
    if batch_invariant:
        from kernels import batch_invariant as bi
        name, linear, experts, paged_attention = "triton-bi", bi.linear, bi.experts, bi.attention

    def norm_rope_store(attn, qkv, cos, sin, k_cache, v_cache, cache_index):
        qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
        eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
        return qk_norm_rope_store(qkv, qn, kn, eps, cos, sin, k_cache, v_cache, cache_index,
                                  attn.n_heads, attn.n_kv, attn.head_dim)

    def kv_norm_rope_store(attn, x, cos, sin, k_cache, v_cache, cache_index):
        D = attn.n_heads * attn.head_dim
        if attn.qkv_weight is not None:    # the k and v rows of the fused weight: one GEMM
            kv = linear(x, attn.qkv_weight[D:], None if attn.qkv_bias is None else attn.qkv_bias[D:])
        else:
            kv = torch.cat([attn.k_proj(x), attn.v_proj(x)], dim=-1)
        kn = attn.k_norm.weight if attn.k_norm is not None else None
        eps = attn.k_norm.eps if attn.k_norm is not None else 0.0
        qk_norm_rope_store(kv, kn, kn, eps, cos, sin, k_cache, v_cache, cache_index, 0, attn.n_kv, attn.head_dim)

    return Ops(name, lambda x, r, norm: add_rmsnorm(x, r, norm.weight, norm.eps), norm_rope_store,
               kv_norm_rope_store, paged_attention, silu_mul, experts, linear, route_topk)


def torch_bi_ops() -> Ops:
    """The PyTorch reference made batch invariant (kernels/batch_invariant.py): every matrix
    product, expert and attention row computed alone. Needs the fused q/k/v and gate/up weights
    (`CausalLM.fuse`), so that every projection goes through `linear`. Norms, RoPE and SiLU are
    TORCH_OPS' (their reductions are over one row already)."""
    from kernels import batch_invariant as bi

    def kv_norm_rope_store(attn, x, cos, sin, k_cache, v_cache, cache_index):
        from kernels.reference import store_kv_ref
        D, T = attn.n_heads * attn.head_dim, x.shape[0]
        kv = bi.linear_ref(x, attn.qkv_weight[D:], None if attn.qkv_bias is None else attn.qkv_bias[D:])
        k, v = kv.view(T, 2 * attn.n_kv, attn.head_dim).split(attn.n_kv, dim=1)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        store_kv_ref(apply_rope(k, cos, sin), v, k_cache, v_cache, cache_index)

    return Ops("torch-bi", _torch_add_rmsnorm, _torch_norm_rope_store, kv_norm_rope_store, bi.attention_ref,
               _torch_silu_mul, bi.experts_ref, bi.linear_ref, bi.route_topk_ref)


def ops_for(backend: str, batch_invariant: bool = False) -> Ops:
    """'torch' (reference) or 'triton' (fused kernels); `batch_invariant`: their fixed-order
    versions (kernels/batch_invariant.py)."""
    if backend == "triton":
        return triton_ops(batch_invariant)
    return torch_bi_ops() if batch_invariant else TORCH_OPS


@dataclass
class PagedAttentionContext:
    """Store new K/V into the paged cache, then attend over it (see kernels/).

    `causal=False` lets every query row of a request read all of its keys (`< kv_lens`): the
    drafter's block attends bidirectionally to itself and to its cached context."""
    kv_cache: KVCache
    cu_seqlens_q: torch.Tensor          # int32 [B+1]
    max_q_len: int
    groups: dict[str, GroupMeta]
    ops: Ops = TORCH_OPS
    causal: bool = True
    tp: object = None                   # the tensor-parallel group (sharding.TPGroup); None = one process

    def attend(self, attn: Attention, qkv, cos, sin) -> torch.Tensor:
        g, k_cache, v_cache = self.kv_cache.layer(attn.layer_idx)
        meta = self.groups[g]
        q = self.ops.norm_rope_store(attn, qkv, cos, sin, k_cache, v_cache, meta.cache_index)
        kw = {} if self.causal else {"causal": False}
        return self.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, self.cu_seqlens_q, meta.kv_lens,
                                        scale=attn.scale, sliding_window=attn.window, kv_start=meta.kv_start,
                                        max_q_len=self.max_q_len, **kw)


@dataclass
class DenseAttentionContext:
    """Plain causal (optionally sliding-window) attention over a `[batch, seq]` block; training."""
    batch: int
    seq: int
    ops: Ops = TORCH_OPS
    tp: object = None                   # the tensor-parallel group (sharding.TPGroup); None = one process

    def attend(self, attn: Attention, qkv, cos, sin) -> torch.Tensor:
        q, k, v = attn.split_norm_rope(qkv, cos, sin)
        B, S, window, scale = self.batch, self.seq, attn.window, attn.scale
        q, k, v = (t.view(B, S, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        if window:
            i = torch.arange(S, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(B * S, o.shape[1], o.shape[3])
