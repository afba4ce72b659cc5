"""The shipped default pair: it loads, matches transformers, generates text, speculates losslessly."""
import json

import torch

from nanodspark import LLM, SamplingParams
from nanodspark.loader import DEFAULT_MODEL_DIR, load_model

from test_model import hf_logits_by_layer


def test_default_config_is_the_hybrid_moe_we_promise():
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert "full_attention" in cfg["layer_types"] and "sliding_attention" in cfg["layer_types"]
    assert cfg["sliding_window"] == 128 and cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    n = sum(p.numel() for p in load_model().parameters())
    assert n <= 16_000_000, n
    total = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.rglob("*.safetensors"))
    assert total < 48 * 2**20  # target + drafter must travel to the GPU with the code (64 MiB)
    assert all(f.stat().st_size <= 16 * 2**20 for f in DEFAULT_MODEL_DIR.rglob("*.safetensors"))


def test_default_matches_transformers_qwen3_moe():
    import transformers as tf
    ours = load_model(dtype=torch.float32)
    raw = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    hf = tf.Qwen3MoeForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32)
    hf.set_attn_implementation("eager")
    assert raw["layer_types"][-1] == "sliding_attention"
    ids = torch.randint(0, ours.config.vocab_size, (160,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_logits_by_layer(hf, ids, [ours.config.window_of(i) for i in range(ours.config.num_hidden_layers)])
        from nanodspark.model import DenseAttentionContext
        got = ours.compute_logits(ours(ids, torch.arange(160), DenseAttentionContext(1, 160)).hidden)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_default_generates_text_deterministically_and_speculation_is_lossless():
    prompt = "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(drafter_path="none", use_tqdm=False)
    a = plain.generate([prompt], greedy)[0]
    b = plain.generate([prompt], greedy)[0]
    assert a.token_ids == b.token_ids and a.text and isinstance(a.text, str)
    spec = LLM(use_tqdm=False)  # the shipped drafter is on by default
    assert spec.engine.drafter is not None
    s = spec.generate([prompt], greedy)[0]
    assert s.token_ids == a.token_ids and s.spec["steps"] > 0
