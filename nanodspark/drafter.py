"""DSpark's semi-autoregressive block drafter (paper sections 2.2, 3.1, 3.2).

Three parts, one forward:

1. **Parallel backbone** (DFlash-style KV injection). The target's hidden states after a few
   chosen layers are concatenated and projected: `ctx = RMSNorm(fc([h_l1; ...; h_lm]))`. Every
   draft layer projects `ctx` with its *own* k/v projections ("injection") and caches the result
   in the drafter's paged KV, one entry per committed target position. A draft block
   `[anchor, mask x (gamma-1)]` at positions `a .. a+gamma-1` then runs through the draft layers
   in one pass: its queries attend to the cached context (positions `< a`, strictly before the
   anchor) and bidirectionally to the block itself. Every draft position is a prediction:
   position k predicts the token at `a + k + 1`, so gamma inputs give gamma base logits `U_k`
   through the target's frozen, shared LM head.
2. **Markov head** (section 3.1, Eq. 5). A low-rank bigram bias `B(x_{k-1}, .) = W2 W1[x_{k-1}]`
   is added to position k's base logits while sampling left to right; position 0 conditions on
   the anchor. The draft distribution of position k is therefore an exact softmax given the
   sampled prefix, which is what lossless rejection sampling needs (verify.py).
3. **Confidence head** (section 3.2, Eq. 7).
   `c_k = sigmoid((w . [h_k ; W1[x_{k-1}]] + b) / T_k + s_k)`: the probability that draft k
   survives verification given that the drafts before it did. `T_k` are the Sequential
   Temperature Scaling temperatures and `s_k` logit shifts (our addition; identity / zero until
   `calibration.fit_sts_shifted` sets them; a checkpoint without `sts_shift` loads with zeros).
   Cumulative survival `a_k = c_1 ... c_k` feeds the cost scheduler.

Invariants: the drafter's context cache holds, for every committed position `p` of a request from
its context start on (0 unless the context lapsed: speculative.py), the injected K/V of the target
features at `p`, and the block reads no key below that start; the anchor's own features are
never in it (the anchor has not been through the target yet). The embedding and LM head are the target's
(frozen, not stored in the drafter checkpoint). `gamma` at serving time equals the trained one.
Saved as `config.json` + `model.safetensors`, like the target. Walkthrough chapter 05.
Training runs the same backbone without the paged cache: drafter_training.py. With dummy
weights (`Drafter.random`, the engine's `load_format="dummy"`) only the config is needed; a
target without one gets `DrafterConfig.dspark_default`, the shape DSpark's released drafters have.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .calibration import apply_temperatures
from .config import ModelConfig
from .model import (TORCH_OPS, DecoderLayer, GroupMeta, Ops, PagedAttentionContext, RMSNorm, apply_rope,
                    rope_cos_sin)
from .paged_kv import table_cache_index
from .sampling import GREEDY_BELOW, STREAM_DRAFT, SamplingTensors, gumbel_argmax, probs_from_logits


# DSpark's released drafters (DeepSpec config/dspark, paper section 4.1): `DrafterConfig.dspark_default`
DSPARK_DRAFT_LAYERS = 5
DSPARK_GAMMA = 7
DSPARK_MARKOV_RANK = 256
QWEN3_MASK_TOKEN_ID = 151669


@dataclass
class DrafterConfig:
    target_layer_ids: list[int]          # target layers whose outputs feed the context (never the last)
    hidden_size: int                     # = the target's (shared embedding and LM head)
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    gamma: int = 5                       # draft block size: gamma inputs, gamma drafts
    mask_token_id: int = 3               # input id of the masked positions
    markov_rank: int = 64                # 0 = no Markov head (the DFlash baseline)
    confidence: bool = True              # False = no confidence head (the DFlash baseline)
    vocab_size: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    architecture: str = "DSparkDrafter"

    @classmethod
    def for_target(cls, target: ModelConfig, **kw) -> "DrafterConfig":
        n = target.num_hidden_layers
        default_layers = sorted({max(0, n // 4), n // 2, n - 2}) if n > 2 else [0]
        kw.setdefault("target_layer_ids", default_layers)
        return cls(hidden_size=target.hidden_size, num_attention_heads=target.num_attention_heads,
                   num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                   vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, **kw)

    @classmethod
    def dspark_default(cls, target: ModelConfig) -> "DrafterConfig":
        """The drafter DSpark's authors ship for a dense Qwen3 target, derived from `target`
        (DeepSpec's released `config/dspark/*` and the paper, section 4.1): `DSPARK_DRAFT_LAYERS` = 5 draft
        layers, each a decoder layer of the target's shape (hidden size, heads, head_dim, MLP
        width: DeepSpec deep-copies the target config); block size gamma = `DSPARK_GAMMA` = 7 (the
        released "block7" checkpoints); a vanilla Markov head of rank `DSPARK_MARKOV_RANK` = 256
        and a confidence head; five target layers spread over depth, 1, 1+s, ..., 1+4s with
        s = (L-4)//4, which gives DeepSpec's [1, 9, 17, 25, 33] for Qwen3-8B (36 layers) and
        [1, 10, 19, 28, 37] for Qwen3-14B (40). Qwen3's mask token id is 151669.

        What is ours: nanodspark's draft layers are dense, so a MoE target's drafter gets a dense
        MLP of the target's `intermediate_size` (Qwen3-30B-A3B: 6144); a target too shallow for
        five spread layers (fewer than 9) keeps `for_target`'s; a vocabulary without Qwen3's mask
        id keeps the default mask id. Weights are not part of a config: this is for dummy weights
        (step costs), or the starting shape of a drafter to train."""
        n = target.num_hidden_layers
        kw = dict(num_layers=DSPARK_DRAFT_LAYERS, gamma=DSPARK_GAMMA, markov_rank=DSPARK_MARKOV_RANK,
                  intermediate_size=target.intermediate_size or target.moe_intermediate_size * max(
                      1, target.num_experts_per_tok))
        if n >= 9:
            step = (n - 4) // 4
            kw["target_layer_ids"] = [1 + i * step for i in range(5)]
        if target.vocab_size > QWEN3_MASK_TOKEN_ID:
            kw["mask_token_id"] = QWEN3_MASK_TOKEN_ID
        return cls.for_target(target, **kw)

    def check_target(self, target: ModelConfig, where: str = "the drafter") -> None:
        """Refuse a target this drafter cannot serve: another hidden size or vocabulary, or
        target layers it does not have (or its last, whose output is normed)."""
        if self.hidden_size != target.hidden_size or self.vocab_size != target.vocab_size:
            raise ValueError(f"{where} was built for hidden {self.hidden_size} / vocab {self.vocab_size}, "
                             f"the target has {target.hidden_size} / {target.vocab_size}")
        if max(self.target_layer_ids) >= target.num_hidden_layers - 1:
            raise ValueError(f"{where} reads a target layer the target does not have (or its last layer)")

    def attention_config(self) -> ModelConfig:
        """A target-style config for the draft layers (all full attention, dense MLP)."""
        return ModelConfig(architecture="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)


class DraftLayer(DecoderLayer):
    """The target's pre-norm decoder layer (same parameters and names; the draft config has no
    experts, so its MLP is dense); its attention context also holds the injected context K/V."""

    def context_kv(self, ctx: torch.Tensor, cos, sin):
        """Injection: this layer's k/v projections of the context features (no input norm)."""
        a = self.self_attn
        k = a.k_proj(ctx).view(ctx.shape[0], a.n_kv, a.head_dim)
        v = a.v_proj(ctx).view(ctx.shape[0], a.n_kv, a.head_dim)
        if a.k_norm is not None:
            k = a.k_norm(k)
        return apply_rope(k, cos, sin), v


@dataclass
class DraftKV:
    """The drafter's paged context cache `[L, 2, blocks, bs, Hkv, D]` seen as one KV group."""
    cache: torch.Tensor

    def layer(self, i: int):
        return "draft", self.cache[i, 0], self.cache[i, 1]


@dataclass
class Draft:
    """One drafting pass over R requests."""
    tokens: torch.Tensor          # [R, gamma] sampled draft tokens
    probs: torch.Tensor | None    # [R, gamma, V] the Markov-corrected draft distributions (None if greedy-only)
    conf_logits: torch.Tensor     # [R, gamma] raw confidence logits z_k (before STS)
    confidence: torch.Tensor      # [R, gamma] calibrated conditional confidences c_k
    survival: torch.Tensor = field(init=False)  # [R, gamma] cumulative products a_k

    def __post_init__(self):
        self.survival = torch.cumprod(self.confidence, dim=-1)


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.config = cfg
        acfg = cfg.attention_config()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(acfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.markov_rank:
            self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
            self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
            nn.init.zeros_(self.markov_w2.weight)  # starts as the plain DFlash drafter
        if cfg.confidence:
            self.confidence_head = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)
        self.register_buffer("sts_temperature", torch.ones(cfg.gamma))
        self.register_buffer("sts_shift", torch.zeros(cfg.gamma))   # logit shift (calibration.fit_sts_shifted)
        # Shared with the target and frozen; kept out of state_dict() by _shared.
        self._shared = (embed, lm_head)

    @property
    def embed(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._shared[1]

    # -- the three parts ---------------------------------------------------------------------
    def context_features(self, captured: list[torch.Tensor]) -> torch.Tensor:
        return self.hidden_norm(self.fc(torch.cat(captured, dim=-1)))

    def backbone(self, block_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Block tokens [N] at positions [N] -> final hidden states [N, H]. `ctx` is an attention
        context (serving: the paged one built in `block_hidden`; training: drafter_training.py)."""
        x = self.embed(block_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return ctx.ops.add_rmsnorm(x, residual, self.norm)[0]

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor | float:
        # BEGIN STUDENT drafter markov-bias
        return self.markov_w2(self.markov_w1(prev)).float() if self.config.markov_rank else 0.0
        # END STUDENT drafter

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        # BEGIN STUDENT drafter confidence-logit
        if not self.config.confidence:
            return torch.zeros(h.shape[:-1], device=h.device)
        feats = [h] + ([self.markov_w1(prev)] if self.config.markov_rank else [])
        return self.confidence_head(torch.cat(feats, dim=-1)).squeeze(-1).float()
        # END STUDENT drafter

    # -- inference ---------------------------------------------------------------------------
    def inject(self, captured: list[torch.Tensor], positions: torch.Tensor, cache_index: torch.Tensor,
               cache: torch.Tensor, ops: Ops = TORCH_OPS) -> None:
        """Store the context K/V of committed positions at `cache_index` (a negative index stores
        nothing: a rejected draft, a replay row, a padding row). cache: [L, 2, blocks, bs, Hkv, D].
        Every row is computed and the store skips the negative ones, so no host sync is needed."""
        feats = self.context_features(captured)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, feats.dtype)
        for i, layer in enumerate(self.layers):
            ops.kv_norm_rope_store(layer.self_attn, feats, cos, sin, cache[i, 0], cache[i, 1], cache_index)

    def block_hidden(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, cache: torch.Tensor,
                     block_tables: torch.Tensor, block_size: int, ops: Ops = TORCH_OPS,
                     kv_start: torch.Tensor | None = None) -> torch.Tensor:
        """The parallel backbone over the blocks `[anchor, mask x (gamma-1)]` of R requests whose
        context is cached below `anchor_pos`: hidden states [R, gamma, H].

        The block's own K/V are stored at the cache entries of positions anchor .. anchor + gamma - 1
        (reserved with the verify window; the injection of committed positions overwrites them
        later), and every block query reads all keys below anchor + gamma: the cached context
        and, bidirectionally, the block itself. `kv_start` (int32 [R], None: 0) is each request's
        first context position: keys below it are never read (a lapsed context, speculative.py)."""
        # BEGIN STUDENT drafter block-pass
        R, g = anchors.shape[0], self.config.gamma
        dev = anchors.device
        ids = torch.full((R, g), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        pos = anchor_pos[:, None] + torch.arange(g, device=dev)[None, :]
        meta = GroupMeta(block_tables, table_cache_index(block_tables, pos, block_size).reshape(-1),
                         (anchor_pos + g).to(torch.int32), kv_start)
        cu = (torch.arange(R + 1, device=dev) * g).to(torch.int32)
        ctx = PagedAttentionContext(DraftKV(cache), cu, g, {"draft": meta}, ops, causal=False)
        return self.backbone(ids.reshape(-1), pos.reshape(-1), ctx).view(R, g, -1)
        # END STUDENT drafter

    @torch.inference_mode()
    def propose(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, cache: torch.Tensor,
                block_tables: torch.Tensor, block_size: int, st: SamplingTensors | None,
                ops: Ops = TORCH_OPS, stream: int = STREAM_DRAFT, kv_start: torch.Tensor | None = None) -> Draft:
        """One drafting pass for R requests: the parallel backbone (`block_hidden`), then the
        sequential stage, position by position: base logits plus the Markov bias of the previous
        token (the anchor for position 0), the confidence of the position, and its token. Sampling (st; None =
        every request greedy) draws position k with the request's keyed noise on `stream` (DRAFT; TARGET
        for coupled drafts, verify.py) at the position it proposes, anchor + k + 1. No host sync:
        this runs inside a CUDA graph. `kv_start`: each request's first context position (`block_hidden`)."""
        h = self.block_hidden(anchors, anchor_pos, cache, block_tables, block_size, ops, kv_start)
        if type(self.lm_head) is nn.Linear:
            base = ops.linear(h.reshape(-1, h.shape[-1]), self.lm_head.weight).float().view(*h.shape[:2], -1)
        else:                                  # a vocab-parallel head gathers its shards itself
            base = self.lm_head(h).float()
        # BEGIN STUDENT drafter sequential
        prev, toks, probs, zs = anchors, [], [], []
        for k in range(self.config.gamma):  # the sequential stage: cheap, one bigram bias per position
            logits = base[:, k] + self.markov_bias(prev)
            zs.append(self.confidence_logit(h[:, k], prev))
            t = logits.argmax(-1)
            if st is not None:
                p = probs_from_logits(logits, st)
                # the draft stream is keyed by the anchor too: fresh noise when a later step
                # proposes this position again (verify.py); coupled drafts use the target's own
                drawn = gumbel_argmax(torch.log(p), st.seed, anchor_pos + 1 + k, stream,
                                      anchor_pos if stream == STREAM_DRAFT else None)
                t = torch.where(st.temperature < GREEDY_BELOW, t, drawn)
                probs.append(p)
            toks.append(t)
            prev = t
        # END STUDENT drafter
        z = torch.stack(zs, 1)
        conf = apply_temperatures(z, self.sts_temperature, self.sts_shift)
        return Draft(torch.stack(toks, 1), torch.stack(probs, 1) if probs else None, z, conf)

    def fuse(self) -> "Drafter":
        for layer in self.layers:
            if layer.self_attn.qkv_weight is None:
                layer.fuse()
        return self

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype: torch.dtype | None = None) -> None:
        """config.json + model.safetensors; `dtype` casts the weights (STS temperatures and
        shifts stay fp32)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(self.config), indent=2))
        state = {k: (v if dtype is None or k.startswith("sts_") else v.to(dtype)).detach().cpu().contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(cls, path: str | Path, target: nn.Module, device="cpu", dtype=torch.float32) -> "Drafter":
        path = Path(path)
        if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
            raise FileNotFoundError(f"{path} is not a drafter checkpoint (config.json + model.safetensors)")
        cfg = DrafterConfig(**json.loads((path / "config.json").read_text()))
        cfg.check_target(target.config, f"drafter {path}")
        d = cls(cfg, target.model.embed_tokens, target.lm_head)
        state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
        missing, unexpected = d.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "sts_shift"]     # checkpoints calibrated with plain STS
        if missing or unexpected:
            raise ValueError(f"drafter checkpoint {path}: missing {missing}, unexpected {unexpected}")
        return d.to(device=device, dtype=dtype).eval()

    @classmethod
    def random(cls, cfg: DrafterConfig, target: nn.Module, device="cpu", dtype=torch.float32,
               seed: int = 0) -> "Drafter":
        """A drafter of `cfg` for `target` with dummy weights (loader.fill_random_, the target's
        rule), allocated directly on `device` at `dtype`; STS is the identity (temperatures 1,
        shifts 0), as in an uncalibrated checkpoint."""
        from .loader import fill_random_
        cfg.check_target(target.config, "the dummy drafter")
        with torch.device("meta"):
            d = cls(cfg, target.model.embed_tokens, target.lm_head)
        d = d.to(dtype).to_empty(device=device)
        fill_random_(d, seed)
        with torch.no_grad():
            d.sts_temperature.fill_(1.0)
            d.sts_shift.zero_()
        for p in d.parameters():
            p.requires_grad_(False)
        return d.eval()
