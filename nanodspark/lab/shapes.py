"""Model shapes the benchmarks build with random weights: no checkpoint, nothing to download.

A step's cost depends on a model's shapes, not on its weight values, so `bench tp` (one
forward) and `bench profile` / `profile-plain` (whole engine steps, `--shape NAME`) measure a
shape at full size with dummy weights (`load_format="dummy"`, loader.py). The two paper-scale
shapes are Qwen3-8B and Qwen3-30B-A3B as their Hugging Face `config.json` gives them (36
layers, hidden 4096, 32 q / 8 kv heads of 128, dense MLP 12288; 48 layers, hidden 2048,
32 q / 4 kv heads of 128, 128 experts top-8 of width 768; both vocab 151936, untied head).
`smollm2-135m` is the shape of the pretrained pair's target (a Llama: 30 layers, hidden 576, 9 q /
3 kv heads of 64, MLP 1536, vocab 49152, tied head) with the drafter `train_heads.py` trains for
it by default (`DRAFTERS`), so its step costs can be timed without staging its weights.
`tiny` (a dense layer then a MoE layer) and `tiny-dense` are for the CPU tests.

`materialize(name, dir)` writes what an engine needs to start on a shape: `config.json`, the
default pair's tokenizer (so text prompts tokenize; its 8192 ids are below every shape's
vocabulary) and `drafter/config.json`, DSpark's default drafter for that target
(`DrafterConfig.dspark_default`, or the shape's entry in `DRAFTERS`). No weight file: the engine is built with `load_format="dummy"`.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

SHAPES = {
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=151645, torch_dtype="bfloat16"),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1000000.0,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          eos_token_id=151645, torch_dtype="bfloat16"),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
    # the CPU tests' shapes; vocab 8192 = the default tokenizer's, so its prompts fit
    "tiny": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=8192, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 mlp_only_layers=[0], max_position_embeddings=4096, eos_token_id=2),
    "tiny-dense": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=8192, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=4096, eos_token_id=2),
}
# shapes whose drafter is not DSpark's default: train_heads.py's defaults (--layers 2, --gamma 5,
# --intermediate 640, --markov-rank 64; target layers about n/4, n/2, n-2), as the SmolLM2 pair's was trained
DRAFTERS = {"smollm2-135m": dict(num_layers=2, gamma=5, intermediate_size=640, markov_rank=64)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def shape_config(name: str, layers: int = 0) -> dict:
    """The config.json of shape `name` (a copy); `layers` > 0 keeps the first `layers` layers."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    d = json.loads(json.dumps(SHAPES[name]))
    if layers:
        d["num_hidden_layers"] = min(layers, d["num_hidden_layers"])
        d["mlp_only_layers"] = [i for i in d.get("mlp_only_layers", []) if i < d["num_hidden_layers"]]
    return d


def materialize(name: str, out_dir: str | Path, drafter: bool = True, tokenizer_dir: str | Path | None = None) -> Path:
    """Write shape `name`'s model directory (module doc) to `out_dir` and return it: config.json,
    the tokenizer files of `tokenizer_dir` (default: the shipped pair's), and, with `drafter`,
    drafter/config.json. For `load_format="dummy"`: there are no weights."""
    from ..config import ModelConfig
    from ..loader import DEFAULT_MODEL_DIR, Tokenizer
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = shape_config(name)
    cfg = ModelConfig.from_dict(d)
    src = Path(tokenizer_dir) if tokenizer_dir else DEFAULT_MODEL_DIR
    tok = Tokenizer(src)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer of {src} has {tok.vocab_size} ids, shape {name!r} a vocabulary of "
                         f"{cfg.vocab_size}: its token ids would be out of range")
    (out / "config.json").write_text(json.dumps(d, indent=2))
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    if drafter:
        (out / "drafter").mkdir(exist_ok=True)
        (out / "drafter" / "config.json").write_text(json.dumps(asdict(drafter_config(name, cfg)), indent=2))
    return out


def drafter_config(name: str, cfg):
    """The drafter of shape `name` (target config `cfg`): its `DRAFTERS` entry, else DSpark's default."""
    from ..drafter import DrafterConfig
    if name in DRAFTERS:
        return DrafterConfig.for_target(cfg, **DRAFTERS[name])
    return DrafterConfig.dspark_default(cfg)


def describe(name: str) -> str:
    """One line: the shape and its parameter count (target; its drafter beside it)."""
    from ..config import ModelConfig
    cfg = ModelConfig.from_dict(shape_config(name))
    dc = drafter_config(name, cfg)
    moe = f", {cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.num_experts else ""
    return (f"{name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} q / "
            f"{cfg.num_key_value_heads} kv heads of {cfg.head_dim}{moe}, vocab {cfg.vocab_size}; drafter "
            f"{dc.num_layers} layers, gamma {dc.gamma}, target layers {dc.target_layer_ids}")
