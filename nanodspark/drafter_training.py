"""The drafter's training pass: the serving forward of drafter.py without the paged cache.

Training (train_heads.py) and teacher-forced evaluation (lab/text_proxy.py) run many anchors of
a sequence at once. `training_attention` is the block pass's attention as one dense mask: block
`(b, a)` reads the context positions `< anchors[b, a]` of its own sequence and its own gamma
block positions both ways, never another block, which is what `Drafter.block_hidden` computes
from the paged cache (tests/test_drafter.py holds the two together). `block_pass` is the
teacher-forced pass the loss is built on. The serving path never imports this file.
Walkthrough chapter 05.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .drafter import Drafter
from .model import TORCH_OPS, DenseAttentionContext, Ops, rope_cos_sin


def training_attention(ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor], anchors: torch.Tensor,
                       gamma: int):
    """Attention for training (train_heads.py), over a batch of B sequences at once.

    ctx_k / ctx_v: per draft layer, the injected context K/V `[B, S, Hkv, D]`; anchors `[B, A]`.
    Block (b, a) may attend the context positions `< anchors[b, a]` of its own sequence and its
    own gamma draft positions (bidirectionally); blocks never see each other. Queries arrive flattened in
    (sequence, anchor, draft position) order, `[B*A*gamma, H, D]`."""
    B, A = anchors.shape
    S = ctx_k[0].shape[1]
    dev = anchors.device
    # BEGIN STUDENT drafter training-mask
    ctx_ok = torch.arange(S, device=dev)[None, None, :] < anchors[:, :, None]           # [B, A, S]
    blk = torch.arange(A, device=dev).repeat_interleave(gamma)
    own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)                              # [B, Ag, Ag]
    mask = torch.cat([ctx_ok.repeat_interleave(gamma, 1), own], dim=2)[:, None]         # [B, 1, Ag, S+Ag]
    # END STUDENT drafter

    def attend(layer, q, k, v, scale):
        def heads(t):  # [B*A*g, H, D] -> [B, H, A*g, D]
            return t.view(B, A * gamma, t.shape[1], t.shape[2]).transpose(1, 2)
        kk = torch.cat([ctx_k[layer].transpose(1, 2), heads(k)], dim=2)
        vv = torch.cat([ctx_v[layer].transpose(1, 2), heads(v)], dim=2)
        o = F.scaled_dot_product_attention(heads(q), kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(B * A * gamma, o.shape[1], o.shape[3])
    return FunctionContext(attend)


@dataclass
class FunctionContext:
    """An attention context around `fn(layer, q, k, v, scale)` (plain torch ops)."""
    fn: object
    ops: Ops = TORCH_OPS

    def attend(self, attn, qkv, cos, sin):
        q, k, v = attn.split_norm_rope(qkv, cos, sin)
        return self.fn(attn.layer_idx, q, k, v, attn.scale)


@dataclass
class BlockPass:
    """One teacher-forced drafter pass over anchors of a padded batch (all tensors [B, A, gamma, ...]).

    logits: drafter logits (Markov bias added); p_target: the target's next-token distribution
    at each draft position; labels: the true next tokens; prev: the true token at each draft
    position (what the teacher-forced Markov head saw); valid: the position's label lies inside its sequence;
    h: the drafter's hidden states (for the confidence head).
    """
    logits: torch.Tensor
    p_target: torch.Tensor
    labels: torch.Tensor
    prev: torch.Tensor
    valid: torch.Tensor
    h: torch.Tensor


def block_pass(drafter: Drafter, target, seqs: list[dict], gamma: int, n_anchors: int, device,
               gen: torch.Generator) -> BlockPass:
    """The teacher-forced pass that training (and any teacher-forced evaluation) is built on.

    One target forward over the padded batch (each sequence = prompt + response, token lists),
    then one drafter pass over `n_anchors` random anchors per sequence whose next token is a
    response token: each anchor's block `[x_a, mask x (gamma-1)]` attends to the target features
    before it (`training_attention`), and the Markov head sees the true previous tokens."""
    cfg = drafter.config
    B = len(seqs)
    lens = torch.tensor([len(s["prompt"]) + len(s["response"]) for s in seqs])
    S = int(lens.max())
    ids = torch.zeros(B, S, dtype=torch.long)
    anchors = torch.zeros(B, n_anchors, dtype=torch.long)
    has = torch.zeros(B, n_anchors, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, :lens[b]] = torch.tensor(s["prompt"] + s["response"])
        cand = torch.arange(len(s["prompt"]) - 1, int(lens[b]) - 1)   # the next token is a response token
        pick = cand[torch.randperm(len(cand), generator=gen)[:n_anchors]].sort().values
        anchors[b, :len(pick)], has[b, :len(pick)] = pick, True
    ids, anchors, has, lens = ids.to(device), anchors.to(device), has.to(device), lens.to(device)
    flat_ids = ids.view(-1)
    with torch.no_grad():  # padding sits after each sequence, so causal attention ignores it
        out = target(flat_ids, torch.arange(S, device=device).repeat(B), DenseAttentionContext(B, S),
                     capture_layers=tuple(cfg.target_layer_ids))
    k = torch.arange(gamma, device=device)
    row0 = (torch.arange(B, device=device) * S)[:, None, None]
    pos = anchors[:, :, None] + k                                           # [B, A, g] draft positions
    valid = has[:, :, None] & (pos + 1 < lens[:, None, None])              # label inside the sequence
    rows = row0 + pos.clamp(max=S - 1)
    labels = flat_ids[row0 + (pos + 1).clamp(max=S - 1)]
    prev = flat_ids[rows]                                                   # teacher forcing: x_{a+k}
    block = torch.full_like(pos, cfg.mask_token_id)
    block[:, :, 0] = flat_ids[row0[:, :, 0] + anchors]
    ctx = drafter.context_features([c.detach() for c in out.captured])
    cos, sin = rope_cos_sin(torch.arange(S, device=device).repeat(B), cfg.head_dim, cfg.rope_theta, ctx.dtype)
    kv = [layer.context_kv(ctx, cos, sin) for layer in drafter.layers]
    attend = training_attention([kk.view(B, S, *kk.shape[1:]) for kk, _ in kv],
                                [vv.view(B, S, *vv.shape[1:]) for _, vv in kv], anchors, gamma)
    h = drafter.backbone(block.reshape(-1), pos.reshape(-1), attend).view(B, n_anchors, gamma, -1)
    logits = drafter.lm_head(h).float() + (drafter.markov_bias(prev) if cfg.markov_rank else 0.0)
    with torch.no_grad():
        p_t = torch.softmax(target.compute_logits(out.hidden[rows.reshape(-1)]), -1).view(logits.shape)
    return BlockPass(logits, p_t, labels, prev, valid, h)
