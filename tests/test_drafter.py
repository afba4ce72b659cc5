"""The block drafter: inference (paged context) equals training (dense mask), causality of the
context, the Markov head's left-to-right conditioning, confidence/survival, checkpoints."""
import pytest
import torch

from nanodspark.drafter import Drafter
from nanodspark.drafter_training import training_attention
from nanodspark.sampling import SamplingTensors
from nanodspark.loader import load_model
from nanodspark.model import DenseAttentionContext, rope_cos_sin

from conftest import make_hf_model, random_drafter

GAMMA = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d, _ = make_hf_model("qwen3", tmp_path_factory.mktemp("t"), window=0, num_hidden_layers=4)
    return load_model(d)


def make(target, **kw):
    return random_drafter(target, gamma=GAMMA, num_layers=2, std=0.2, mask_token_id=5, **kw)


def features(target, ids, layers):
    S = len(ids)
    with torch.no_grad():
        return target(ids, torch.arange(S), DenseAttentionContext(1, S), capture_layers=tuple(layers)).captured


def dense_block_hidden(d, captured, ids, anchor):
    S = captured[0].shape[0]
    ctx = d.context_features(captured)
    cos, sin = rope_cos_sin(torch.arange(S), d.config.head_dim, d.config.rope_theta, ctx.dtype)
    kv = [l.context_kv(ctx, cos, sin) for l in d.layers]
    attend = training_attention([k[None] for k, _ in kv], [v[None] for _, v in kv], torch.tensor([[anchor]]), GAMMA)
    block = torch.full((GAMMA,), d.config.mask_token_id)
    block[0] = ids[anchor]
    return d.backbone(block, anchor + torch.arange(GAMMA), attend)


def test_paged_inference_equals_dense_training_path(target):
    d = make(target)
    torch.manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (23,))
    a = 17
    captured = features(target, ids, d.config.target_layer_ids)
    with torch.no_grad():
        want = dense_block_hidden(d, captured, ids, a)
        bs, nblocks = 4, 8
        cache = torch.zeros(d.config.num_layers, 2, nblocks, bs, d.config.num_key_value_heads, d.config.head_dim)
        table = torch.tensor([6, 2, 7, 0, 3, 5], dtype=torch.int32)   # scattered physical blocks
        pos = torch.arange(a)
        slots = table[pos // bs].long() * bs + pos % bs
        d.inject([c[:a] for c in captured], pos, slots, cache)
        got = d.block_hidden(ids[a:a + 1], torch.tensor([a]), cache, table[None], bs)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_block_reads_no_context_below_its_kv_start(target):
    """A lapsed context (speculative.py): with kv_start = s the block never reads keys below s.
    NaN stored there leaves it finite and equal to the same pass over any other values; the
    context from s to the anchor still counts (changing it changes the block)."""
    d = make(target)
    torch.manual_seed(2)
    ids = torch.randint(0, target.config.vocab_size, (23,))
    a, s, bs = 17, 9, 4
    captured = features(target, ids, d.config.target_layer_ids)
    table = torch.tensor([6, 2, 7, 0, 3, 5], dtype=torch.int32)
    pos = torch.arange(a)
    slots = table[pos // bs].long() * bs + pos % bs

    def block(fill_below, bump=0.0, kv_start=torch.tensor([s], dtype=torch.int32)):
        cache = torch.zeros(d.config.num_layers, 2, 8, bs, d.config.num_key_value_heads, d.config.head_dim)
        feats = [c[:a].clone() for c in captured]
        for c in feats:
            c[s] += bump
        d.inject(feats, pos, slots, cache)
        lo = slots[:s]
        cache.view(d.config.num_layers, 2, -1, *cache.shape[-2:])[:, :, lo] = fill_below
        return d.block_hidden(ids[a:a + 1], torch.tensor([a]), cache, table[None], bs, kv_start=kv_start)[0]

    with torch.no_grad():
        got = block(float("nan"))
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, block(3.0))
        assert not torch.allclose(block(0.0, bump=5.0), block(0.0))          # position s is read
        assert not torch.allclose(block(3.0, kv_start=None), block(0.0, kv_start=None))   # 0: all of it


def test_context_is_strictly_before_the_anchor(target):
    d = make(target)
    ids = torch.randint(0, target.config.vocab_size, (20,))
    a = 12
    captured = features(target, ids, d.config.target_layer_ids)
    with torch.no_grad():
        base = dense_block_hidden(d, captured, ids, a)
        later = [c.clone() for c in captured]
        for c in later:
            c[a:] += 5.0                                     # the anchor's own features and beyond
        torch.testing.assert_close(dense_block_hidden(d, later, ids, a), base)
        earlier = [c.clone() for c in captured]
        for c in earlier:
            c[a - 1] += 5.0
        assert not torch.allclose(dense_block_hidden(d, earlier, ids, a), base)


def test_markov_head_conditions_each_slot_on_the_sampled_previous_token(target):
    """Slot k's distribution is softmax(base_k + Markov bias of the token drawn at slot k-1): the
    draft distribution is exact given the sampled prefix (what rejection sampling needs), for
    greedy drafting (argmax) and sampled drafting alike."""
    d = make(target)
    with torch.no_grad():
        d.markov_w2.weight.normal_(0, 0.5)                 # a Markov bias strong enough to matter
    bs = 4
    cache = torch.randn(d.config.num_layers, 2, 4, bs, d.config.num_key_value_heads, d.config.head_dim)
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    anchor, pos = torch.tensor([11]), torch.tensor([9])
    st = SamplingTensors(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([5]))
    with torch.no_grad():
        greedy = d.propose(anchor, pos, cache.clone(), table, bs, None)
        sampled = d.propose(anchor, pos, cache.clone(), table, bs, st)
        base = d.lm_head(d.block_hidden(anchor, pos, cache.clone(), table, bs)[0]).float()
    for draft, probs in ((greedy, None), (sampled, sampled.probs)):
        prev = [11] + draft.tokens[0, :-1].tolist()
        for k in range(GAMMA):
            want = base[k] + d.markov_w2(d.markov_w1(torch.tensor(prev[k]))).float()
            if probs is None:
                assert draft.tokens[0, k] == want.argmax()
            else:
                torch.testing.assert_close(probs[0, k], torch.softmax(want, -1), atol=1e-5, rtol=1e-4)
    assert sampled.tokens.tolist() != greedy.tokens.tolist() or sampled.probs.max() > 0.99
    assert torch.allclose(greedy.survival, torch.cumprod(greedy.confidence, -1))
    assert ((greedy.confidence > 0) & (greedy.confidence < 1)).all()


def test_sts_temperature_scales_the_confidence(target):
    d = make(target)
    bs = 4
    cache = torch.randn(d.config.num_layers, 2, 4, bs, d.config.num_key_value_heads, d.config.head_dim)
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)

    def propose():
        with torch.no_grad():
            return d.propose(torch.tensor([11]), torch.tensor([9]), cache, table, bs, None)
    raw = propose()
    torch.testing.assert_close(raw.confidence, torch.sigmoid(raw.conf_logits))   # identity until calibrated
    temps = torch.tensor([1.0, 2.0, 4.0, 0.5])
    d.sts_temperature.copy_(temps)
    cal = propose()
    torch.testing.assert_close(cal.conf_logits, raw.conf_logits)                  # STS changes no logit
    torch.testing.assert_close(cal.confidence, torch.sigmoid(raw.conf_logits / temps))
    assert not torch.allclose(cal.confidence[0, 1:], raw.confidence[0, 1:])
    shifts = torch.tensor([0.0, -0.5, 0.25, 1.0])
    d.sts_shift.copy_(shifts)
    torch.testing.assert_close(propose().confidence, torch.sigmoid(raw.conf_logits / temps + shifts))


def test_save_load_roundtrip_and_errors(target, tmp_path):
    d = make(target)
    d.sts_temperature.copy_(torch.tensor([1.5, 2.0, 0.7, 1.0]))
    d.sts_shift.copy_(torch.tensor([0.1, -0.3, 0.0, 0.2]))
    d.save(tmp_path / "dr", dtype=torch.bfloat16)
    d2 = Drafter.load(tmp_path / "dr", target)
    assert torch.equal(d2.sts_temperature, d.sts_temperature) and torch.equal(d2.sts_shift, d.sts_shift)  # fp32 kept
    d.save(tmp_path / "dr")
    d2 = Drafter.load(tmp_path / "dr", target)
    for (k, a), (_, b) in zip(d.state_dict().items(), d2.state_dict().items()):
        assert torch.equal(a, b), k
    assert "embed" not in str(list(d.state_dict())) and "lm_head" not in str(list(d.state_dict()))
    other, _ = make_hf_model("qwen3", tmp_path / "o", vocab_size=100)
    with pytest.raises(ValueError, match="vocab"):
        Drafter.load(tmp_path / "dr", load_model(other))
    with pytest.raises(FileNotFoundError):
        Drafter.load(tmp_path / "missing", target)
    # a checkpoint calibrated with plain STS (no sts_shift) loads with zero shifts
    from safetensors.torch import load_file, save_file
    state = load_file(str(tmp_path / "dr" / "model.safetensors"))
    del state["sts_shift"]
    save_file(state, str(tmp_path / "dr" / "model.safetensors"))
    assert not Drafter.load(tmp_path / "dr", target).sts_shift.any()


def test_dflash_baseline_has_no_markov_or_confidence(target):
    d = make(target, markov_rank=0, confidence=False)
    assert not hasattr(d, "markov_w1") and not hasattr(d, "confidence_head")
    h = torch.randn(3, d.config.hidden_size)
    assert torch.equal(d.confidence_logit(h, torch.tensor([1, 2, 3])), torch.zeros(3))


def test_batched_training_attention_equals_one_sequence_at_a_time(target):
    """Two sequences of different lengths, padded into one batch: each block sees only its own
    sequence's context (padding and the other sequence change nothing)."""
    d = make(target)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, target.config.vocab_size, (n,), generator=g) for n in (19, 12)]
    anchors = [torch.tensor([4, 9, 15]), torch.tensor([2, 6, 10])]
    with torch.no_grad():
        alone = [torch.cat([dense_block_hidden(d, features(target, s, d.config.target_layer_ids), s, int(a))
                            for a in an]) for s, an in zip(seqs, anchors)]
        S = 19
        ids = torch.zeros(2, S, dtype=torch.long)
        ids[0], ids[1, :12] = seqs[0], seqs[1]
        out = target(ids.view(-1), torch.arange(S).repeat(2), DenseAttentionContext(2, S),
                     capture_layers=tuple(d.config.target_layer_ids))
        ctx = d.context_features(out.captured)
        cos, sin = rope_cos_sin(torch.arange(S).repeat(2), d.config.head_dim, d.config.rope_theta, ctx.dtype)
        kv = [l.context_kv(ctx, cos, sin) for l in d.layers]
        an = torch.stack(anchors)
        attend = training_attention([k.view(2, S, *k.shape[1:]) for k, _ in kv],
                                    [v.view(2, S, *v.shape[1:]) for _, v in kv], an, GAMMA)
        block = torch.full((2, 3, GAMMA), d.config.mask_token_id)
        block[:, :, 0] = torch.gather(ids, 1, an)
        pos = an[:, :, None] + torch.arange(GAMMA)
        h = d.backbone(block.reshape(-1), pos.reshape(-1), attend).view(2, 3 * GAMMA, -1)
    for b in range(2):
        torch.testing.assert_close(h[b], alone[b], atol=1e-5, rtol=1e-4)
