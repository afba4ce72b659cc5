"""Configuration: what the model *is* (`ModelConfig`) and how the engine runs it (`EngineConfig`).

`ModelConfig` is read from a Hugging Face `config.json` (Qwen3, Qwen3-MoE, Llama). It
normalises the few ways those files spell the same thing (`rope_theta` vs `rope_parameters`,
`layer_types` vs `use_sliding_window` + `max_window_layers`) so that the rest of the engine sees
one shape.

`EngineConfig` holds every knob of the engine, each with a default and a one-line meaning.
Nothing else in the package hard-codes a tunable number.

Invariants: `layer_types[i]` is `"full_attention"` or `"sliding_attention"`; a sliding layer has a
window `sliding_window > 0`; `head_dim * num_attention_heads` need not equal `hidden_size` (Qwen3).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}
FULL, SLIDING = "full_attention", "sliding_attention"


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

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def window_of(self, i: int) -> int:
        return self.sliding_window if self.layer_types[i] == SLIDING else 0

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or d.get('model_type')!r}; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope type {rope_type!r} (only plain RoPE is implemented)")
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        n_layers = d["num_hidden_layers"]
        window = d.get("sliding_window") or 0
        layer_types = d.get("layer_types")
        if not layer_types:
            if d.get("use_sliding_window") and window:
                first = d.get("max_window_layers", n_layers)
                layer_types = [SLIDING if i >= first else FULL for i in range(n_layers)]
            else:
                layer_types = [FULL] * n_layers
        if SLIDING not in layer_types:
            window = 0
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        n_heads = d["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            qk_norm=arch != "llama",
            layer_types=list(layer_types),
            sliding_window=int(window),
            num_experts=(d.get("num_experts") or d.get("num_local_experts") or 0) if arch == "qwen3_moe" else 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            raw=dict(d),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()))


@dataclass
class EngineConfig:
    """Every knob of the engine. `LLM(path, **kwargs)` and `serve.py` flags set these fields."""
    # --- placement ---
    device: str = "auto"                  # "auto" = cuda if available else cpu
    dtype: str = "auto"                   # "auto" = bfloat16 on cuda, float32 on cpu
    seed: int = 0                         # seed of the engine's default sampling generator
    # --- KV cache ---
    block_size: int = 16                  # tokens per KV block
    num_kv_blocks: int = 0                # blocks per KV group; 0 = size from memory below
    kv_cache_memory_gb: float = 0.0       # memory for all KV groups; 0 = a fraction of free memory
    kv_memory_fraction: float = 0.4       # share of free device memory the KV cache may take when sizing automatically
    cpu_kv_blocks: int = 2048             # default block count on CPU (RAM is not probed)
    enable_prefix_cache: bool = True      # reuse KV of full blocks shared with earlier prompts
    # SWA replay after a prefix hit (swa_replay.py, walkthrough 13): 0 = exact, N*(W-1) tokens, the
    # logits of a miss; n > 0 = bounded to n tokens (DeepSeek-V4.1 keeps 140), an approximation;
    # "auto" = bounded to the window + the look-back, (1 + gamma) rows per verify window ahead of
    # the frontier (1 window synchronous, 2 overlapped): 134 or 140 for the default pair. Never
    # more than exact. 0 stays the default: the approximation is a deployment's choice.
    swa_replay_tokens: int | str = 0      # 0 = exact, n = bounded to n tokens, "auto" = window + look-back
    # --- batching ---
    max_num_seqs: int = 64                # most requests running at once
    max_num_batched_tokens: int = 2048    # token budget of one forward (prefill chunks + decode + verify)
    max_model_len: int = 0                # longest prompt + output; 0 = the model's max_position_embeddings
    max_waiting: int = 1024               # queued requests beyond which new ones are refused
    # --- attention ---
    attention_backend: str = "auto"       # "torch" (reference, runs anywhere) | "triton" | "auto"
    # --- speculative decoding (DSpark) ---
    drafter_path: str | None = None       # a drafter checkpoint; None = the default's drafter if shipped, "none" = off
    gamma: int = 0                        # draft block size; 0 = the drafter's trained block size
    verify_mode: str = "static"           # "static" | "compact" | "cap-accept"
    cost_table: str | None = None         # JSON step-cost profile (cost_scheduler.py); None = static windows
    verify_min_gain: float = 0.04         # trim only if the predicted tokens/s beat full blocks by more than this
    verify_lag: int = 2                   # steps between the confidences that size the budget and now (>= 1)
    # --- execution (walkthrough 10 and 11) ---
    cuda_graphs: bool = True              # replay decode steps from CUDA graphs (CUDA and the triton backend only)
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
    # request slots of the captured tiers (those above max_num_seqs are dropped)
    graph_token_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    # verify-token tiers per slot count when the verify mode trims: slots + fraction * slots * gamma
    overlap: bool = True                  # launch step n+1 before reading step n (CUDA only; overlap_loop.py)
    # --- progress ---
    use_tqdm: bool = True                 # progress bar in LLM.generate (more than one prompt)
    # --- SWA snapshots ---
    swa_snapshots: int = 0                # finished requests whose sliding-window KV is kept for a follow-up (no replay on a hit); 0 = off
    swa_snapshot_ttl_s: float = 180.0     # seconds a snapshot waits for its follow-up before its blocks are freed

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; see nanodspark.config.EngineConfig")
        return cls(**kwargs)

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, not {self.attention_backend!r}")
        from .verify import VerifyMode
        VerifyMode.parse(self.verify_mode)
        if not self.graph_batch_sizes or min(self.graph_batch_sizes) < 1:
            raise ValueError("graph_batch_sizes must be positive slot counts")
        if not self.graph_token_fractions or not all(0 <= f <= 1 for f in self.graph_token_fractions):
            raise ValueError("graph_token_fractions must lie in [0, 1]")
        if self.verify_min_gain < 0 or self.verify_lag < 1:
            raise ValueError("verify_min_gain must be >= 0 and verify_lag >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if isinstance(self.swa_replay_tokens, str) and self.swa_replay_tokens.strip().isdigit():
            self.swa_replay_tokens = int(self.swa_replay_tokens)       # a command-line flag
        if self.swa_replay_tokens != "auto" and (not isinstance(self.swa_replay_tokens, int)
                                                 or self.swa_replay_tokens < 0):
            raise ValueError(f"swa_replay_tokens must be 0 (exact), a positive count or 'auto', "
                             f"not {self.swa_replay_tokens!r}")
        if self.swa_snapshots < 0 or self.swa_snapshot_ttl_s <= 0:
            raise ValueError("swa_snapshots must be >= 0 and swa_snapshot_ttl_s > 0")
