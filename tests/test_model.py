"""Our Qwen3 / Qwen3-MoE / Llama forward against `transformers` (code no one here wrote).

Random tiny models are built and saved by `transformers`, loaded by our loader, and compared
in fp32: a dense prefill (training context) and step-by-step decoding through the paged KV.
"""
import pytest
import torch

from nanodspark.loader import CheckpointError, load_model, save_model
from nanodspark.model import DenseAttentionContext, KVCache, GroupMeta, PagedAttentionContext

from conftest import make_hf_model

CASES = [("qwen3", 0, False), ("qwen3", 8, True), ("qwen3_moe", 0, False), ("qwen3_moe", 8, False),
         ("llama", 0, True)]


def hf_logits_by_layer(model, ids: torch.Tensor, windows: list[int]) -> torch.Tensor:
    """transformers' own layers, called one by one with a causal (or sliding) mask per layer.

    Needed because transformers' Qwen3-MoE has no per-layer `layer_types`."""
    m = model.model
    S = ids.shape[0]
    x = m.embed_tokens(ids[None])
    pos = torch.arange(S)[None]
    pe = m.rotary_emb(x, position_ids=pos)
    i = torch.arange(S)
    for li, layer in enumerate(m.layers):
        ok = i[None, :] <= i[:, None]
        if windows[li]:
            ok &= (i[:, None] - i[None, :]) < windows[li]
        mask = torch.zeros(S, S).masked_fill(~ok, float("-inf"))[None, None]
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        x = x[0] if isinstance(x, tuple) else x
    return model.lm_head(m.norm(x))[0]


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-w{c[1]}-tie{int(c[2])}")
def pair(request, tmp_path):
    kind, window, tie = request.param
    d, hf = make_hf_model(kind, tmp_path, window=window, tie=tie)
    hf.set_attn_implementation("eager")
    ours = load_model(d, dtype=torch.float32)
    return kind, window, hf, ours


def test_prefill_matches_transformers(pair):
    kind, window, hf, ours = pair
    torch.manual_seed(1)
    S = 40  # longer than the window, so sliding layers really slide
    ids = torch.randint(0, ours.config.vocab_size, (S,))
    with torch.no_grad():
        ref = hf_logits_by_layer(hf, ids, [ours.config.window_of(i) for i in range(ours.config.num_hidden_layers)])
        if kind != "qwen3_moe":  # the whole-model forward agrees with our layer-by-layer driver
            torch.testing.assert_close(hf(ids[None]).logits[0], ref, atol=2e-5, rtol=1e-4)
        out = ours(ids, torch.arange(S), DenseAttentionContext(1, S))
        got = ours.compute_logits(out.hidden)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def paged_decode_logits(model, ids: torch.Tensor, chunk: int, block_size: int = 4):
    """Prefill `chunk` tokens, then feed the rest one token per forward through the paged KV."""
    cfg = model.config
    S = ids.shape[0]
    n_blocks = (S + block_size - 1) // block_size
    cache = KVCache(cfg, {g: n_blocks + 1 for g in ("full", "sliding")}, block_size, torch.float32, "cpu")
    table = torch.randperm(n_blocks + 1)[:n_blocks].to(torch.int32)  # scattered physical blocks
    logits, start = [], 0
    while start < S:
        end = chunk if start == 0 else start + 1
        pos = torch.arange(start, end)
        kv_index = table[pos // block_size].long() * block_size + pos % block_size
        meta = GroupMeta(block_tables=table[None], cache_index=kv_index,
                         kv_lens=torch.tensor([end], dtype=torch.int32))
        ctx = PagedAttentionContext(cache, torch.tensor([0, end - start], dtype=torch.int32), end - start,
                                    {g: meta for g in cache.groups})
        out = model(ids[start:end], pos, ctx)
        logits.append(model.compute_logits(out.hidden))
        start = end
    return torch.cat(logits)


def test_paged_decode_matches_transformers(pair):
    kind, window, hf, ours = pair
    torch.manual_seed(2)
    S = 30
    ids = torch.randint(0, ours.config.vocab_size, (S,))
    with torch.no_grad():
        ref = hf_logits_by_layer(hf, ids, [ours.config.window_of(i) for i in range(ours.config.num_hidden_layers)])
        got = paged_decode_logits(ours, ids, chunk=11)
    torch.testing.assert_close(got, ref, atol=3e-5, rtol=1e-4)


def test_save_load_roundtrip_sharded(tmp_path):
    d, _ = make_hf_model("qwen3_moe", tmp_path / "a", window=8)
    m = load_model(d)
    paths = save_model(m, tmp_path / "b", max_shard_bytes=64 * 1024)
    assert len(paths) > 1 and (tmp_path / "b" / "model.safetensors.index.json").exists()
    m2 = load_model(tmp_path / "b")
    assert m2.config.layer_types == m.config.layer_types
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k


def test_clear_errors(tmp_path):
    d, _ = make_hf_model("qwen3", tmp_path / "m")
    import json
    from safetensors.torch import load_file, save_file
    st = load_file(str(d / "model.safetensors"))
    st.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing.*k_norm"):
        load_model(d)
    st["model.layers.1.self_attn.k_norm.weight"] = torch.zeros(3)
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(d)
    c = json.loads((d / "config.json").read_text())
    c["architectures"] = ["GPT2LMHeadModel"]
    c["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not read")
    c["architectures"] = ["Qwen3ForCausalLM"]
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(d)
