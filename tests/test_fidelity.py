"""Config fidelity against `transformers` 5 (issue 28): the sliding-window flags of Qwen3,
Qwen3-MoE and Llama and the RoPE variants real checkpoints use, read from the same config.json
by transformers (`from_pretrained`) and by our loader, compared on logits (a dense prefill and
token-by-token paged decoding, fp32) and on greedy tokens (our engine against a transformers
loop that recomputes the whole sequence each step). What we cannot serve exactly is refused.
"""
import json
import math
import re
import tempfile
from pathlib import Path

import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.config import FULL, SLIDING, ModelConfig, check_config
from nanodspark.loader import load_model
from nanodspark.model import DenseAttentionContext, RotaryEmbedding

from conftest import TINY, make_hf_model
from test_model import paged_decode_logits

S_, F_ = SLIDING, FULL
ATOL, RTOL = 3e-5, 1e-4          # fp32, as tests/test_model.py

# name: (kind, config-class overrides, config.json patch, keys dropped from config.json, expected layer types)
WINDOW_CASES = {
    # Qwen3 without layer_types (older checkpoints): layers >= max_window_layers slide
    "qwen3-max_window_layers": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), {},
                                ["layer_types"], [F_, F_, S_, S_]),
    "qwen3-layer_types": ("qwen3", dict(use_sliding_window=True, sliding_window=8, layer_types=[S_, F_, S_, F_]), {},
                          [], [S_, F_, S_, F_]),
    # sliding_window without use_sliding_window: no window anywhere
    "qwen3-flag_off": ("qwen3", {}, dict(use_sliding_window=False, sliding_window=8, max_window_layers=0),
                       ["layer_types"], [F_] * 4),
    # the issue: Qwen3-MoE with use_sliding_window and no layer_types slides in every layer
    "qwen3_moe-all_sliding": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), {}, [], [S_] * 4),
    "qwen3_moe-flag_off": ("qwen3_moe", dict(sliding_window=8), {}, [], [F_] * 4),
    # Llama has no sliding attention in transformers: the flags are ignored
    "llama-ignored": ("llama", {}, dict(use_sliding_window=True, sliding_window=8, max_window_layers=0,
                                        layer_types=[S_] * 4), [], [F_] * 4),
}
ROPE_CASES = {
    # every Llama 3.x checkpoint: the old `rope_scaling` key and a top-level rope_theta
    "llama-llama3": ("llama", {}, dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
        ["rope_parameters"], [F_] * 4),
    "llama-linear": ("llama", {}, dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
                     [], [F_] * 4),
    # Qwen3's long-context recipe
    "qwen3-yarn": ("qwen3", {}, dict(max_position_embeddings=256, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
                   ["rope_parameters"], [F_] * 4),
    "qwen3_moe-yarn-mscale": ("qwen3_moe", {}, dict(rope_parameters=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.5,
        beta_fast=16, beta_slow=2, truncate=False, rope_theta=20000.0)), [], [F_] * 4),
    # factor null: derived from max_position_embeddings / original_max_position_embeddings
    "llama-yarn-attention_factor": ("llama", {}, dict(rope_scaling=dict(
        type="yarn", factor=None, original_max_position_embeddings=128, attention_factor=0.9)),
        ["rope_parameters"], [F_] * 4),
    # served up to max_position_embeddings (128 here), where transformers' dynamic is plain RoPE
    "llama-dynamic": ("llama", {}, dict(max_position_embeddings=128, rope_scaling=dict(type="dynamic", factor=2.0)),
                      ["rope_parameters"], [F_] * 4),
}
PROMPT, NEW = 72, 24              # positions up to 95: past every original context above, past the windows


def build(kind, tmp, over, patch, drop):
    """A random tiny checkpoint by transformers, its config.json patched; both sides load it.

    The norms' weights are set near 1 (make_hf_model draws them near 0), so that attention is
    not near-uniform: positions (RoPE) and windows then move the logits by O(1)."""
    import transformers as tf
    d, m = make_hf_model(kind, tmp, **over)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    m.save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    c.update(patch)
    for k in drop:
        c.pop(k, None)
    (d / "config.json").write_text(json.dumps(c))
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return d, hf, load_model(d, dtype=torch.float32)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", list(WINDOW_CASES) + list(ROPE_CASES))
def test_matches_transformers(name, tmp_path):
    kind, over, patch, drop, layer_types = {**WINDOW_CASES, **ROPE_CASES}[name]
    d, hf, ours = build(kind, tmp_path, over, patch, drop)
    cfg = ours.config
    assert cfg.layer_types == layer_types
    if SLIDING in layer_types:
        assert cfg.sliding_window == 8
    torch.manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (PROMPT + NEW,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        dense = ours.compute_logits(ours(ids, torch.arange(len(ids)), DenseAttentionContext(1, len(ids))).hidden)
        paged = paged_decode_logits(ours, ids, chunk=PROMPT - 5)
    torch.testing.assert_close(dense, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(paged, ref, atol=ATOL, rtol=RTOL)
    prompt = ids[:PROMPT].tolist()
    llm = LLM(str(d), drafter_path="none", use_tqdm=False, block_size=4, attention_backend="torch", dtype="float32")
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))[0].token_ids
    assert got == hf_greedy(hf, prompt, NEW)


def test_the_parity_cases_are_not_vacuous(tmp_path):
    """Reading a flag or a RoPE type wrongly moves these models' logits by O(1): plain RoPE in
    place of llama3, and full attention in place of the issue's all-sliding Qwen3-MoE (the old
    reading), give other logits."""
    torch.manual_seed(4)
    ids = torch.randint(0, 320, (PROMPT,))

    def logits(m):
        with torch.no_grad():
            return m.compute_logits(m(ids, torch.arange(PROMPT), DenseAttentionContext(1, PROMPT)).hidden)
    kind, over, patch, drop, _ = ROPE_CASES["llama-llama3"]
    _, _, ours = build(kind, tmp_path / "rope", over, patch, drop)
    scaled = logits(ours)
    ours.rotary = RotaryEmbedding(ours.config.head_dim, ours.config.rope_theta)
    assert (scaled - logits(ours)).abs().max() > 0.1
    kind, over, patch, drop, _ = WINDOW_CASES["qwen3_moe-all_sliding"]
    d, _, ours = build(kind, tmp_path / "window", over, patch, drop)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "layer_types": [F_] * 4}))   # our extension: honoured
    full = load_model(d)
    assert full.config.layer_types == [F_] * 4 and (logits(ours) - logits(full)).abs().max() > 0.1


# ----------------------------------------------------------------------------- config semantics, no weights
def hf_config(d: dict):
    import transformers as tf
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(d))
        return tf.AutoConfig.from_pretrained(tmp)


def hf_windows(kind: str, c) -> list[int]:
    """The window transformers' modeling code gives each layer (0 = full attention)."""
    n = c.num_hidden_layers
    if kind == "llama":
        return [0] * n
    if kind == "qwen3_moe":
        return [c.sliding_window or 0] * n
    return [c.sliding_window if t == SLIDING else 0 for t in c.layer_types]


ARCH = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "llama"])
def test_window_flags_read_as_transformers_reads_them(kind):
    """Every combination of the four flags (present or not): the same window per layer as
    transformers, or a refusal naming the field where transformers could not run it either."""
    n = 0
    for use in (None, False, True):
        for window in ("absent", None, 8):
            for first in (None, 0, 3):
                for types in (None, [S_, F_, S_, F_], [F_] * 4):
                    if kind == "qwen3_moe" and types is not None:
                        continue          # our extension (see config.py); the default model uses it
                    d = dict(TINY, model_type=kind, architectures=[ARCH[kind]])
                    if kind == "llama":
                        d.pop("head_dim")
                    for k, v in (("use_sliding_window", use), ("max_window_layers", first), ("layer_types", types)):
                        if v is not None:
                            d[k] = v
                    if window != "absent":
                        d["sliding_window"] = window
                    want = hf_windows(kind, hf_config(d))
                    if kind == "qwen3" and any(t == S_ for t in hf_config(d).layer_types) and not any(want):
                        with pytest.raises(ValueError, match="layer_types"):   # transformers fails in forward
                            ModelConfig.from_dict(d)
                        continue
                    cfg = ModelConfig.from_dict(d)
                    assert [cfg.window_of(i) for i in range(4)] == want, d
                    n += 1
    assert n > 20


ROPE_DICTS = [
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0}},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 1e6}},
    {"rope_theta": 7.0, "rope_scaling": {"type": "linear", "factor": 2.0, "rope_theta": 3000.0}},   # inner theta wins
    {"rope_scaling": {"type": "dynamic", "factor": 4.0}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3, "truncate": False}},
    {"rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256}},
    # both keys: transformers takes rope_scaling
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_scaling": {"rope_type": "yarn", "factor": 3.0}},
]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_rope_tables_equal_transformers(kind):
    """Inverse frequencies and cos/sin scale equal transformers' rotary embedding, per variant."""
    import transformers as tf
    rotary = {"qwen3": tf.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding,
              "llama": tf.models.llama.modeling_llama.LlamaRotaryEmbedding}[kind]
    for extra in ROPE_DICTS:
        d = dict(TINY, model_type=kind, architectures=[ARCH[kind]], head_dim=32, **extra)
        hf = rotary(hf_config(d))
        ours = RotaryEmbedding.from_config(ModelConfig.from_dict(d))
        torch.testing.assert_close(ours.inv_freq, hf.inv_freq, atol=0, rtol=1e-6, msg=str(extra))
        assert math.isclose(ours.attention_scaling, hf.attention_scaling, rel_tol=1e-12), extra


@pytest.mark.parametrize("patch, field", [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "mrope"}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"layer_types": [S_, F_, S_, F_], "sliding_window": 8}, "layer_types"),      # use_sliding_window is false
    ({"layer_types": [F_] * 3}, "layer_types"),
    ({"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 1}, "sliding_window"),
])
def test_unsupported_fields_are_refused_by_name(patch, field):
    d = dict(TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"], **patch)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict(d)


def test_dynamic_rope_is_refused_past_its_original_context(tmp_path):
    """transformers' dynamic NTK RoPE rescales every position by the longest sequence of the
    current forward call, so the same tokens get other logits in a longer call: a function of
    batch history, not of position, that a paged batched engine cannot reproduce. Up to
    max_position_embeddings it is plain RoPE (served, parity above); past it, refused."""
    kind, over, patch, drop, _ = ROPE_CASES["llama-dynamic"]
    d, hf, _ = build(kind, tmp_path, over, patch, drop)
    ids = torch.randint(0, 320, (160,))
    with torch.no_grad():
        short, long = hf(ids[None, :100]).logits[0], hf(ids[None]).logits[0, :100]
    assert (short - long).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"rope_type='dynamic'.*max_model_len=256"):
        LLM(str(d), drafter_path="none", use_tqdm=False, max_model_len=256)


# ----------------------------------------------------------------------------- the loader check
LLAMA31 = {   # the shape of a Llama 3.1 config.json, scaled down
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0",
    "use_cache": True, "vocab_size": 320, "some_future_flag": 3,
}


def test_loader_check_reads_only_the_config(tmp_path, capsys):
    from nanodspark import check
    d = tmp_path / "llama31"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA31))
    (d / "model.safetensors").write_bytes(b"")          # listed, never read
    assert check.main([str(d)]) == 0
    out = capsys.readouterr().out
    status = {line.split()[1]: line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert status["rope_scaling"] == status["rope_theta"] == status["mlp_bias"] == "honoured"
    assert status["pretraining_tp"] == status["use_cache"] == status["bos_token_id"] == "ignored"
    assert status["some_future_flag"] == "unknown"
    assert "rope: llama3, theta 500000" in out and "OK: loadable" in out
    # refused: a RoPE type we do not implement, and the sliding flags Llama ignores are said so
    (d / "config.json").write_text(json.dumps({**LLAMA31, "use_sliding_window": True, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}))
    assert check.main([str(d)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"refused\s+rope_scaling\s+'longrope' is not supported", out)
    assert re.search(r"ignored\s+use_sliding_window\s+transformers 5's Llama has no sliding attention", out)
    assert "REFUSED" in out


@pytest.mark.parametrize("extra", [{}, {"use_sliding_window": True, "sliding_window": 8},
                                   {"rope_scaling": {"rope_type": "su"}}, {"hidden_act": "relu"},
                                   {"layer_types": [S_] * 4, "use_sliding_window": True}])
def test_loader_check_agrees_with_the_load(extra):
    d = dict(TINY, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], **extra)
    report = check_config(d)
    try:
        ModelConfig.from_dict(d)
        loads = True
    except ValueError:
        loads = False
    assert report.ok == loads
    if extra.get("sliding_window") and "layer_types" not in extra:
        assert "4 of 4 layers sliding" in report.format()       # the case, said before loading
