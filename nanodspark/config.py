"""Configuration: what the model *is* (`ModelConfig`) and how the engine runs it (`EngineConfig`).

`ModelConfig` is read from a Hugging Face `config.json` (Qwen3, Qwen3-MoE, Llama) with the
semantics `transformers` 5 gives it: its per-architecture defaults for omitted fields, its RoPE
parameters (`rope_scaling` wins over `rope_parameters`, a `rope_theta` inside them over the top
level one; types default, linear, dynamic, yarn, llama3) and its sliding-window flags, which
differ per architecture:

* Qwen3: `sliding_window` counts only with `use_sliding_window`; `layer_types`, when given, says
  which layers slide, else layers `>= max_window_layers` do (default 28).
* Qwen3-MoE: with `use_sliding_window` every layer slides (`max_window_layers` is not read).
  An explicit `layer_types` is a nanodspark extension (transformers 5 ignores it for this
  architecture): our default model is a full/sliding hybrid Qwen3-MoE.
* Llama: no sliding attention; the flags are ignored, as transformers ignores them.

What cannot be served exactly is refused with a `ValueError` naming the field. `check_config`
reports, before any weight is read, which fields of a config.json are honoured, ignored or
refused (`python -m nanodspark.check DIR`); walkthrough chapter 01 has the table.

`EngineConfig` holds every knob of the engine, each with a default, a line of help and a group
(placement, cache, batching, speculation, execution, parallel, eplb) in its field's metadata;
`serve.py` builds its flags from them. Nothing else in the package hard-codes a tunable number.

Invariants: `layer_types[i]` is `"full_attention"` or `"sliding_attention"`; a sliding layer has a
window `sliding_window > 0`; `head_dim * num_attention_heads` need not equal `hidden_size` (Qwen3);
`rope_type` is one of `ROPE_TYPES` and `rope_scaling` holds every parameter it needs.
"""
from __future__ import annotations

import difflib
import json
import numbers
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}
FULL, SLIDING = "full_attention", "sliding_attention"
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# transformers 5's defaults (its config classes) for the fields read below that a config.json may omit
HF_DEFAULTS = {
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768, sliding_window=4096,
                  max_window_layers=28),
    "qwen3_moe": dict(num_key_value_heads=4, head_dim=None, max_position_embeddings=32768, sliding_window=4096,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "llama": dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=2048, bos_token_id=1,
                  eos_token_id=2),
}


@dataclass
class ModelConfig:
    architecture: str                 # "qwen3" | "qwen3_moe" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"        # one of ROPE_TYPES
    rope_scaling: dict = field(default_factory=dict)  # the parameters of rope_type, defaults filled in
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = True              # Qwen3 normalises q and k per head before RoPE; Llama does not
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0           # window of the sliding layers (0 = none)
    # Mixture of experts (0 experts = every layer dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"
    raw: dict = field(default_factory=dict, repr=False)  # the config.json as read, written back on save

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = set(self.layer_types) - {FULL, SLIDING}
        if bad:
            raise ValueError(f"unsupported layer types {sorted(bad)}; expected {FULL!r} or {SLIDING!r}")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            raise ValueError("sliding_attention layers need sliding_window > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES}")

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a context the RoPE cannot serve exactly. Dynamic NTK RoPE is plain RoPE up to
        `max_position_embeddings` in transformers too; past it transformers rescales every
        position by the longest sequence of the current forward call (and keeps keys cached
        under the old scale), a function of batch history no paged, batched engine reproduces."""
        if self.rope_type == "dynamic" and max_model_len > self.max_position_embeddings:
            raise ValueError(f"rope_scaling.rope_type='dynamic' is served only up to max_position_embeddings="
                             f"{self.max_position_embeddings} (where it equals plain RoPE); max_model_len="
                             f"{max_model_len} is longer")

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def window_of(self, i: int) -> int:
        return self.sliding_window if self.layer_types[i] == SLIDING else 0

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Read a Hugging Face config.json as transformers 5 reads it; refuse what cannot be
        served exactly (a `ValueError` naming every such field)."""
        cfg, refused = read_config(d)
        if refused:
            raise ValueError("; ".join(f"{k}: {why}" for k, why in refused))
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()))


def architecture_of(d: dict) -> str | None:
    archs = d.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    return arch or {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}.get(d.get("model_type", ""))


def read_config(d: dict) -> tuple[ModelConfig | None, list[tuple[str, str]]]:
    """(config, refusals): every field that cannot be served, with why. The config is None when
    the architecture is not supported; otherwise it is built with the refused fields left out."""
    arch = architecture_of(d)
    if arch is None:
        archs = d.get("architectures") or d.get("model_type")
        return None, [("architectures", f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")]
    refused: list[tuple[str, str]] = []
    hf = HF_DEFAULTS[arch]

    def get(key, default=None):
        v = d.get(key)
        return hf.get(key, default) if v is None and key not in d else v

    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if not d.get(k)]
    if missing:
        return None, [(k, "required") for k in missing]
    n_layers, n_heads = d["num_hidden_layers"], d["num_attention_heads"]
    max_pos = get("max_position_embeddings")
    if d.get("hidden_act", "silu") != "silu":
        refused.append(("hidden_act", f"{d['hidden_act']!r}: only silu (SwiGLU) is implemented"))
    if arch == "llama" and d.get("mlp_bias"):
        refused.append(("mlp_bias", "true: MLP biases are not implemented"))
    if d.get("quantization_config"):
        refused.append(("quantization_config", "quantized checkpoints are not loaded (bf16/fp16/fp32 safetensors only)"))
    rope_theta, rope_type, rope_scaling = _read_rope(d, max_pos, refused)
    layer_types, window = _read_sliding(arch, d, get, n_layers, refused)
    eos = get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    moe = arch == "qwen3_moe"
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d.get("intermediate_size", 0),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=get("num_key_value_heads") or n_heads,
        head_dim=get("head_dim") or d["hidden_size"] // n_heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        qk_norm=arch != "llama",
        layer_types=layer_types,
        sliding_window=window,
        num_experts=(d.get("num_experts") or d.get("num_local_experts") or get("num_experts")) if moe else 0,
        num_experts_per_tok=get("num_experts_per_tok", 0) if moe else 0,
        moe_intermediate_size=get("moe_intermediate_size", 0) if moe else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=list(d.get("mlp_only_layers") or []),
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos,
        torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
        raw=dict(d),
    )
    return cfg, refused


def _read_rope(d: dict, max_pos: int, refused: list) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, parameters) as transformers 5's RoPE utilities read them."""
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    rope = dict(d.get(key) or {})
    theta = float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    for where, v in ((f"{key}.partial_rotary_factor", rope.get("partial_rotary_factor")),
                     ("partial_rotary_factor", d.get("partial_rotary_factor"))):
        if v not in (None, 1, 1.0):
            refused.append((where, f"{v}: partial rotary embeddings are not implemented"))
    if rope_type not in ROPE_TYPES:
        refused.append((f"{key}.rope_type", f"{rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"))
        return theta, "default", {}
    required = {"default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor")}[rope_type]
    missing = [k for k in required if k not in rope or (rope[k] is None and rope_type != "yarn")]  # yarn: None = derived
    if missing:
        refused.append((f"{key}.{missing[0]}", f"rope_type {rope_type!r} needs {', '.join(missing)}"))
        return theta, "default", {}
    omp = int(rope.get("original_max_position_embeddings") or max_pos)   # transformers' default
    if rope_type == "default":
        params = {}
    elif rope_type in ("linear", "dynamic"):
        params = {"factor": float(rope["factor"])}
    elif rope_type == "llama3":
        params = {k: float(rope[k]) for k in required} | {"original_max_position_embeddings": omp}
    else:   # yarn
        factor = rope["factor"]
        params = {"factor": float(max_pos / omp if factor is None else factor), "original_max_position_embeddings": omp,
                  "attention_factor": rope.get("attention_factor"), "beta_fast": float(rope.get("beta_fast") or 32),
                  "beta_slow": float(rope.get("beta_slow") or 1), "mscale": rope.get("mscale"),
                  "mscale_all_dim": rope.get("mscale_all_dim"), "truncate": bool(rope.get("truncate", True))}
    if rope_type != "default" and not params["factor"] > 0:
        refused.append((f"{key}.factor", f"{rope['factor']!r} must be positive"))
        return theta, "default", {}
    return theta, rope_type, params


def _read_sliding(arch: str, d: dict, get, n_layers: int, refused: list) -> tuple[list[str], int]:
    """(layer_types, sliding_window) from the sliding-window flags, per architecture (module doc)."""
    if arch == "llama":
        return [FULL] * n_layers, 0
    window = get("sliding_window") if d.get("use_sliding_window") else None
    explicit = d.get("layer_types")
    if explicit is not None:
        types = list(explicit)
        if len(types) != n_layers or set(types) - {FULL, SLIDING}:
            refused.append(("layer_types", f"needs {n_layers} entries, each {FULL!r} or {SLIDING!r}"))
            types = [FULL] * n_layers
        elif SLIDING in types and window is None:
            why = "use_sliding_window is false" if not d.get("use_sliding_window") else "sliding_window is null"
            refused.append(("layer_types", f"names sliding_attention layers but {why} "
                                           "(transformers 5 has no window for them either)"))
            types = [FULL] * n_layers
    elif window is None:
        types = [FULL] * n_layers
    elif arch == "qwen3":
        first = get("max_window_layers")
        if not isinstance(first, int):
            refused.append(("max_window_layers", f"{first!r}: an integer layer index is needed"))
            first = n_layers
        types = [SLIDING if i >= first else FULL for i in range(n_layers)]
    else:   # qwen3_moe: one window for every layer
        types = [SLIDING] * n_layers
    if SLIDING not in types:
        return types, 0
    if not isinstance(window, int) or window <= 0:
        refused.append(("sliding_window", f"{window!r}: a sliding layer needs a positive window"))
        return [FULL] * n_layers, 0
    return types, window


# ----------------------------------------------------------------------------- the loader check
_HONOURED = {
    "*": ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
          "rope_parameters", "partial_rotary_factor", "max_position_embeddings", "tie_word_embeddings",
          "attention_bias", "hidden_act", "eos_token_id", "quantization_config"),
    "qwen3": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
    "qwen3_moe": ("use_sliding_window", "sliding_window", "layer_types", "num_experts", "num_local_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                  "mlp_only_layers"),
    "llama": ("mlp_bias",),
}
_IGNORED = {   # field -> why it changes nothing the engine computes
    "use_cache": "the engine always caches K/V (paged)",
    "torch_dtype": "the engine's dtype option sets the compute dtype (recorded, written back on save)",
    "dtype": "the engine's dtype option sets the compute dtype",
    "bos_token_id": "prompts are tokenized as given; no BOS is added",
    "pad_token_id": "batches are packed, never padded",
    "initializer_range": "training only", "attention_dropout": "training only",
    "output_router_logits": "training only", "router_aux_loss_coef": "training only",
    "pretraining_tp": "transformers 5 does not read it either",
    "transformers_version": "metadata", "_name_or_path": "metadata", "id2label": "metadata", "label2id": "metadata",
    "problem_type": "metadata", "return_dict": "metadata", "output_hidden_states": "metadata",
    "output_attentions": "metadata", "chunk_size_feed_forward": "metadata", "is_encoder_decoder": "metadata",
}
_IGNORED_PER_ARCH = {
    "llama": {k: "transformers 5's Llama has no sliding attention" for k in
              ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")},
    "qwen3_moe": {"max_window_layers": "transformers 5's Qwen3-MoE does not read it (use_sliding_window slides every layer)"},
}


@dataclass
class ConfigCheck:
    """What `ModelConfig.from_dict` makes of a config.json, field by field (`check_config`)."""
    architecture: str | None
    rows: list[tuple[str, str, str]]       # (field, "honoured" | "ignored" | "refused" | "unknown", note)
    config: ModelConfig | None

    @property
    def ok(self) -> bool:
        return self.config is not None and not any(status == "refused" for _, status, _ in self.rows)

    def format(self) -> str:
        lines = [f"architecture: {self.architecture or 'unsupported'}"]
        c = self.config
        if c is not None:
            slide = [i for i, t in enumerate(c.layer_types) if t == SLIDING]
            lines.append(f"attention: {len(slide)} of {c.num_hidden_layers} layers sliding"
                         + (f" (window {c.sliding_window}: layers {slide})" if slide else ""))
            lines.append(f"rope: {c.rope_type}, theta {c.rope_theta:g}"
                         + (f", {c.rope_scaling}" if c.rope_scaling else ""))
        width = max([len(f) for f, _, _ in self.rows] + [5])
        for status in ("refused", "honoured", "ignored", "unknown"):
            for f, st, note in self.rows:
                if st == status:
                    lines.append(f"  {status:9s} {f:{width}s}  {note}")
        lines.append("OK: loadable" if self.ok else "REFUSED: this checkpoint cannot be served exactly")
        return "\n".join(lines)


def check_config(d: dict) -> ConfigCheck:
    """Which fields of a config.json are honoured, ignored or refused, before any weight is read.

    Refusals are those `ModelConfig.from_dict` raises for; "unknown" fields are read by neither
    this engine nor (for these architectures) transformers' modeling code as far as this table
    knows; read their meaning before trusting the output."""
    try:
        cfg, refused = read_config(d)
    except (TypeError, ValueError) as e:
        cfg, refused = None, [("config.json", str(e))]
    arch = cfg.architecture if cfg is not None else architecture_of(d)
    rows = []
    why_refused = {}
    for k, why in refused:
        why_refused.setdefault(k.split(".")[0], []).append(why)
    honoured = set(_HONOURED["*"]) | set(_HONOURED.get(arch, ()))
    ignored = {**_IGNORED, **_IGNORED_PER_ARCH.get(arch, {})}
    for k in d:
        v = json.dumps(d[k])
        v = v if len(v) <= 60 else v[:57] + "..."
        if k in why_refused:
            rows.append((k, "refused", "; ".join(why_refused.pop(k))))
        elif k in ignored:
            rows.append((k, "ignored", ignored[k]))
        elif k in honoured:
            note = v
            if arch == "qwen3_moe" and k == "layer_types":
                note += "  (nanodspark extension: transformers 5 ignores it for Qwen3-MoE)"
            rows.append((k, "honoured", note))
        else:
            rows.append((k, "unknown", f"{v}: not read"))
    rows += [(k, "refused", "; ".join(w)) for k, w in why_refused.items()]   # e.g. a required field absent
    return ConfigCheck(arch, rows, cfg)


# ----------------------------------------------------------------------------- the engine's knobs
GROUPS = {   # EngineConfig's groups, in the order `serve.py --help` shows them
    "placement": "where the engine runs",
    "cache": "the paged KV cache, the prefix cache and SWA replay",
    "batching": "what one step may hold",
    "speculation": "DSpark: the drafter, verification and the cost scheduler",
    "execution": "kernels, CUDA graphs, the overlapped loop",
    "parallel": "tensor and expert parallelism (distributed.py)",
    "eplb": "expert load balancing (eplb.py): recorder, redundant experts, rebalancing",
}


def knob(default, help: str, group: str, cli: bool = True):
    """An `EngineConfig` field: its default, one line of help and its group (`serve.py` builds its
    flags from these; `cli=False` keeps a field off the command line)."""
    assert group in GROUPS, group
    return field(default=default, metadata={"help": help, "group": group, "cli": cli})


@dataclass
class EngineConfig:
    """Every knob of the engine. `LLM(path, **kwargs)` and `serve.py` flags set these fields.

    Flat names (`cfg.block_size`), grouped by each field's metadata (`GROUPS`); an enumeration
    is a `Literal`, checked with every other type when the config is built (`__post_init__`)."""
    # placement
    device: str = knob("auto", 'device to run on: "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"',
                       "placement")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", "compute dtype; auto = bfloat16 on cuda, float32 on cpu", "placement")
    seed: int = knob(0, "seed of the engine's default sampling generator (requests without a seed) and of dummy "
                        "weights", "placement")
    load_format: Literal["safetensors", "dummy"] = knob(
        "safetensors", "safetensors = the checkpoint's weights; dummy = random weights (config.json only; "
                       "drafter: its config.json or DSpark's default): step costs at full size", "placement")
    # cache: four ways to size it, first match wins: num_kv_blocks, kv_cache_memory_gb,
    # kv_memory_fraction (CUDA), cpu_kv_blocks (CPU)
    block_size: int = knob(16, "tokens per KV block (a power of two)", "cache")
    num_kv_blocks: int = knob(0, "blocks per KV group; 0 = size from memory (the next three)", "cache")
    kv_cache_memory_gb: float = knob(0.0, "memory for all KV groups, GiB; 0 = kv_memory_fraction of free memory",
                                     "cache")
    kv_memory_fraction: float = knob(0.4, "share of free device memory (after loading) the KV cache may take "
                                          "when sized automatically", "cache")
    cpu_kv_blocks: int = knob(2048, "blocks per KV group on CPU when sized automatically (RAM is not probed)", "cache")
    enable_prefix_cache: bool = knob(True, "reuse the KV of full blocks shared with earlier prompts", "cache")
    swa_replay_tokens: int | Literal["auto"] = knob(
        0, "sliding-layer tokens recomputed after a prefix hit: 0 = exact (the default), n = at most n "
           "(approximate), auto = window + look-back (walkthrough/13_swa_replay.md)", "cache")
    swa_snapshots: int = knob(0, "finished requests' sliding-window KV kept for a follow-up (entries; "
                                 "oldest evicted first); 0 = off", "cache")
    swa_snapshot_ttl_s: float = knob(180.0, "seconds a snapshot waits for its follow-up before its blocks are freed",
                                     "cache")
    # batching
    max_num_seqs: int = knob(64, "most requests running at once", "batching")
    max_num_batched_tokens: int = knob(0, "token budget of one forward (prefill chunks + decode + verify); "
                                          "0 = 8192 on cuda, 2048 on cpu", "batching")
    max_model_len: int = knob(0, "longest prompt + output; 0 = the model's max_position_embeddings", "batching")
    max_waiting: int = knob(1024, "queued requests beyond which new ones are refused", "batching")
    max_waiting_steps: int | Literal["auto"] = knob(
        "auto", "decode steps an arrival may wait so that one prefill serves several (scheduler.py); "
                "0 = admit at once; auto = 8 when decode steps replay CUDA graphs, else 0", "batching")
    waiting_served_ratio: float = knob(0.25, "admit at once when the queue holds this share of the decoding "
                                             "requests", "batching")
    # speculation
    drafter_path: str | None = knob(None, 'a drafter checkpoint; unset = the model\'s drafter/ if shipped, '
                                          '"none" = speculation off', "speculation")
    gamma: int = knob(0, "draft block size; 0 = the drafter's trained block size", "speculation")
    verify_mode: Literal["static", "compact", "cap-accept"] = knob(
        "static", "static = full blocks; compact = the cost scheduler trims windows; cap-accept = "
                  "full blocks, accepted tokens capped (profiling)", "speculation")
    cost_table: str | None = knob(None, "JSON step-cost profile for the cost scheduler (bench profile); "
                                        "unset = static windows", "speculation")
    verify_min_gain: float = knob(0.04, "trim only if the predicted tokens/s beat full blocks by more than this",
                                  "speculation")
    verify_lag: int = knob(2, "steps between the confidences that size the budget and now (>= 1)", "speculation")
    verify_plain_steps: bool = knob(True, "compact: a plain step (no drafter pass) where the target's own profile, "
                                          "in the cost table's file, says drafting does not pay", "speculation")
    verify_plain_hold: int = knob(8, "compact: steps a plain-step choice holds while no drafted confidences arrive "
                                     "(1 = choose at every step)", "speculation")
    verify_lapse_after: int = knob(16, "compact: plain steps in a row after which a plain step stops feeding the "
                                       "drafter's context (0 = never); a request that drafts again reads only the "
                                       "context fed since", "speculation")
    verify_step_clock: bool = knob(False, "compact: correct the step-cost profile by the engine's own step clock "
                                          "(measured over predicted periods of plain and drafting steps) when "
                                          "choosing plain steps", "speculation")
    verify_draft_fractions: tuple[float, ...] = knob(
        (0.25, 0.5, 0.75), "compact: shares of a batch whose most confident requests may draft alone, each "
                           "once the cost file holds its profile (bench profile --draft-fraction F)", "speculation")
    coupled_sampling: bool = knob(False, "drafts and verification share the target's noise: the same tokens "
                                         "with speculation on or off", "speculation")
    synthetic_acceptance: str | None = knob(
        None, "benchmarks of random weights only (load_format=dummy): 'LO:HI' = each request accepts a draft with "
              "its own rate, uniform in [LO, HI], instead of by the target (output is not the target's)",
        "speculation")
    # execution
    attention_backend: Literal["auto", "torch", "triton"] = knob(
        "auto", "torch = the reference (runs anywhere); triton = the paged kernels; auto = triton on cuda",
        "execution")
    batch_invariant: bool = knob(False, "fixed-order kernels: a request's logits do not depend on the batch, "
                                        "padding or chunking", "execution")
    cuda_graphs: bool = knob(True, "replay decode steps from CUDA graphs (cuda and the triton backend only)",
                             "execution")
    cuda_graph_prefill: bool = knob(True, "replay prefill forwards from CUDA graphs too, one per (chunks, tokens) "
                                          "tier, captured on its first run (runner.py)", "execution")
    graph_batch_sizes: tuple[int, ...] = knob((1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256),
                                              "request slots of the captured tiers (those above max_num_seqs "
                                              "are dropped)", "execution")
    graph_token_fractions: tuple[float, ...] = knob((0.25, 0.5, 0.75, 1.0),
                                                    "verify-token tiers per slot count when the verify mode trims: "
                                                    "slots + fraction * slots * gamma", "execution")
    overlap: bool = knob(True, "launch step n+1 before reading step n (cuda only; engine.py `step`)", "execution")
    tune_gemm: bool = knob(False, "time the skinny-GEMM kernel against the library at start-up", "execution")
    use_tqdm: bool = knob(True, "progress bars (LLM.generate of several prompts, graph capture)", "execution",
                          cli=False)
    # parallel
    tensor_parallel_size: int = knob(1, "processes splitting the target: heads, MLP, vocab", "parallel")
    expert_parallel_size: int = knob(1, "expert groups among those processes for MoE layers (divides the TP size)",
                                     "parallel")
    dist_backend: Literal["auto", "gloo", "nccl"] = knob("auto", "auto = nccl on cuda, gloo on cpu", "parallel")
    dist_timeout_s: float = knob(120.0, "a collective, or a worker, silent this long is an error", "parallel")
    # eplb
    eplb: bool = knob(False, "record expert load per slot and rebalance replicas (MoE targets only)", "eplb")
    eplb_interval: int = knob(1000, "engine steps between rebalances; 0 = record only, never move", "eplb")
    eplb_window: int = knob(1000, "steps of load a placement is computed from (a ring buffer)", "eplb")
    eplb_num_redundant_experts: int = knob(0, "extra expert slots per MoE layer, for replicas of hot experts",
                                           "eplb")
    eplb_policy: Literal["auto", "hierarchical", "global"] = knob(
        "auto", "auto = hierarchical when the groups divide over the nodes, else global", "eplb")
    eplb_ep_size: int = knob(1, "simulated EP ranks: the slots cut into this many equal groups", "eplb")
    eplb_num_groups: int = knob(1, "expert groups of group-limited routing (hierarchical policy)", "eplb")
    eplb_num_nodes: int = knob(1, "nodes the ranks are spread over (hierarchical policy)", "eplb")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            close = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            hint = "; ".join(f"{u!r}: did you mean {c[0]!r}?" for u, c in close.items() if c)
            raise TypeError(f"unknown engine option(s) {unknown}" + (f" ({hint})" if hint else "")
                            + "; see nanodspark.config.EngineConfig")
        return cls(**kwargs)

    def __post_init__(self):
        if isinstance(self.swa_replay_tokens, str) and self.swa_replay_tokens.strip().isdigit():
            self.swa_replay_tokens = int(self.swa_replay_tokens)       # a command-line flag
        if isinstance(self.max_waiting_steps, str) and self.max_waiting_steps.strip().isdigit():
            self.max_waiting_steps = int(self.max_waiting_steps)       # a command-line flag
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            setattr(self, f.name, _conform(f.name, getattr(self, f.name), hints[f.name]))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        from .verify import VerifyMode
        VerifyMode.parse(self.verify_mode)
        if not self.graph_batch_sizes or min(self.graph_batch_sizes) < 1:
            raise ValueError("graph_batch_sizes must be positive slot counts")
        if not self.graph_token_fractions or not all(0 <= f <= 1 for f in self.graph_token_fractions):
            raise ValueError("graph_token_fractions must lie in [0, 1]")
        if not all(0 < f < 1 for f in self.verify_draft_fractions):
            raise ValueError("verify_draft_fractions must lie strictly between 0 and 1")
        if self.verify_min_gain < 0 or self.verify_lag < 1 or self.verify_plain_hold < 1 or self.verify_lapse_after < 0:
            raise ValueError("verify_min_gain must be >= 0, verify_lag >= 1, verify_plain_hold >= 1 and "
                             "verify_lapse_after >= 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 0:
            raise ValueError("max_num_seqs must be positive and max_num_batched_tokens positive or 0 (auto)")
        if min(self.num_kv_blocks, self.kv_cache_memory_gb, self.max_model_len, self.max_waiting, self.gamma) < 0:
            raise ValueError("num_kv_blocks, kv_cache_memory_gb, max_model_len, max_waiting and gamma must be >= 0")
        if not 0 < self.kv_memory_fraction <= 1 or self.cpu_kv_blocks < 1:
            raise ValueError("kv_memory_fraction must be in (0, 1] and cpu_kv_blocks positive")
        if self.tensor_parallel_size < 1 or self.expert_parallel_size < 1 or \
                self.tensor_parallel_size % self.expert_parallel_size:
            raise ValueError("tensor_parallel_size and expert_parallel_size must be positive, and the expert "
                             "parallel size must divide the tensor parallel size")
        if self.dist_timeout_s <= 0:
            raise ValueError("dist_timeout_s must be positive")
        if self.eplb_interval < 0 or self.eplb_window < 1 or self.eplb_num_redundant_experts < 0:
            raise ValueError("eplb_interval must be >= 0, eplb_window >= 1 and eplb_num_redundant_experts >= 0")
        if min(self.eplb_ep_size, self.eplb_num_groups, self.eplb_num_nodes) < 1:
            raise ValueError("eplb_ep_size, eplb_num_groups and eplb_num_nodes must be positive")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant runs in one process: an all-reduce's order of summation is the "
                             "collective library's, not fixed here (tensor_parallel_size must be 1)")
        if self.eplb and self.tensor_parallel_size > 1:
            raise ValueError("eplb simulates its EP ranks in one process; it does not run with "
                             "tensor_parallel_size > 1 yet")
        if (self.max_waiting_steps != "auto" and self.max_waiting_steps < 0) or self.waiting_served_ratio < 0:
            raise ValueError(f"max_waiting_steps must be >= 0 or 'auto' (not {self.max_waiting_steps!r}) and "
                             f"waiting_served_ratio >= 0")
        if self.swa_replay_tokens != "auto" and self.swa_replay_tokens < 0:
            raise ValueError(f"swa_replay_tokens must be 0 (exact), a positive count or 'auto', "
                             f"not {self.swa_replay_tokens!r}")
        if self.swa_snapshots < 0 or self.swa_snapshot_ttl_s <= 0:
            raise ValueError("swa_snapshots must be >= 0 and swa_snapshot_ttl_s > 0")
        if self.synthetic_acceptance is not None:
            from .verify import SyntheticAcceptance
            SyntheticAcceptance.parse(self.synthetic_acceptance)
            if self.load_format != "dummy":
                raise ValueError("synthetic_acceptance replaces the target's verdict, so a checkpoint's output "
                                 "would no longer be its own: it is for load_format='dummy' (random weights) only")


def pick_device(name: str):
    """"auto" = cuda if available, else cpu; otherwise the device named."""
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device):
    """"auto" = bfloat16 on cuda, float32 elsewhere."""
    import torch
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _conform(name: str, value, tp):
    """`value` as field `name` of type `tp` holds it, or a clear error naming the field: a
    `TypeError` for the wrong kind of value, a `ValueError` for a value outside a `Literal`.
    Lenient only where nothing is lost: an int for a float, a list for a tuple, a path for a str."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        for a in kinds:               # the first kind that takes the value as it is
            try:
                return _conform(name, value, a)
            except (TypeError, ValueError):
                pass
        literal = next((a for a in kinds if typing.get_origin(a) is Literal), None)
        if literal is not None and isinstance(value, str):
            return _conform(name, value, literal)   # the Literal's own message
        raise TypeError(f"{name} must be {' or '.join(_describe(a) for a in args)}, got {value!r}")
    if typing.get_origin(tp) is Literal:
        if value in args and type(value) is type(args[0]):
            return value
        choices = ", ".join(repr(a) for a in args)
        raise (ValueError if isinstance(value, str) else TypeError)(
            f"{name} must be one of {choices}, not {value!r}")
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{name} must be {_describe(tp)}, got {value!r}")
        return tuple(_conform(name, v, args[0]) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    elif tp is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    else:
        return value
    raise TypeError(f"{name} must be {_describe(tp)}, got {value!r}")


def _describe(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"a list of {_PLURAL.get(typing.get_args(tp)[0], 'values')}"
    return {bool: "a bool", int: "an integer", float: "a number", str: "a string",
            type(None): "None"}.get(tp, str(tp))


_PLURAL = {int: "integers", float: "numbers", str: "strings"}
