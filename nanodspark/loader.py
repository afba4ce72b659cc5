"""Weights and tokenizer in, weights out — Hugging Face layout, safetensors only.

Load: `config.json` -> `ModelConfig`; tensors from `model.safetensors` or the shards listed in
`model.safetensors.index.json`; Hugging Face key names. The per-expert MoE keys
(`mlp.experts.{e}.gate_proj.weight`) are stacked into our `[E, out, in]` parameters.
Save: the inverse, in shards of at most `max_shard_bytes` with an index.
Tensor / expert parallel (`load_sharded`): each rank builds its local shapes and reads only its
slices of each tensor through safetensors' `get_slice`, so no rank ever holds the whole model.

Dummy weights (`load_format="dummy"`, vLLM's name): no weight file is read. The model is
built on the meta device, allocated on its own device at its own dtype (`to_empty`: a
Qwen3-30B-A3B in bf16 never exists in host memory, nor in fp32) and filled by `fill_random_`,
the one rule for every model built without a checkpoint (the engine's dummy target and drafter,
`bench tp`): normal(0, 0.02) from a seeded generator, norm weights 1. A step's cost does not
depend on the values, so this is what profiles a shape at full size without its checkpoint.

Invariants: every parameter of the model is filled exactly once, with the right shape, or
loading fails with a message naming the tensor; pickle (`.bin`, `.pt`) is never read.
Tokenizer: `tokenizer.json` through the `tokenizers` library, ChatML chat formatting, and the
set of ids that end a generation.

Check: `check_checkpoint(dir)` (command line: `python -m nanodspark.check DIR`) reads only
`config.json` and says which fields are honoured, ignored or refused (`config.check_config`).
"""
from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigCheck, ModelConfig, check_config
from .model import CausalLM

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "default"
EOT = "<|endoftext|>"   # end of text: ends a generation here, and a document in the corpus recipe
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("safetensors", "dummy")   # EngineConfig.load_format
DUMMY_STD = 0.02                          # the dummy weights' standard deviation (norm weights are 1)


class CheckpointError(ValueError):
    pass


def resolve_model_dir(path: str | Path | None) -> Path:
    path = Path(path) if path else DEFAULT_MODEL_DIR
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    return path


def safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.glob("*") if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found {pickles}: pickle checkpoints are not loaded; convert them to safetensors)" if pickles else ""
        raise CheckpointError(f"no safetensors weights in {model_dir}{hint} (load_format='dummy' runs on random "
                              "weights from config.json alone)")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"shards listed in the index are missing: {missing}")
    return files


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in safetensor_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face per-expert keys -> our stacked `experts.{gate,up,down}_proj` parameters."""
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for k, t in tensors.items():
        m = _EXPERT_KEY.match(k)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
        else:
            out[k] = t
    for (prefix, proj), per in groups.items():
        n = max(per) + 1
        if sorted(per) != list(range(n)):
            raise CheckpointError(f"{prefix}: experts {sorted(set(range(n)) - set(per))} of {proj} are missing")
        out[f"{prefix}.{proj}"] = torch.stack([per[e] for e in range(n)])
    return out


def unstack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in state.items():
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$", k)
        if m:
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e]
        else:
            out[k] = t
    return out


def fill_random_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Dummy weights, in place: every parameter normal(0, DUMMY_STD), every norm weight (a name
    ending in `norm.weight`: layer norms, q/k norms, the final norm) 1, drawn in `named_parameters`
    order from one generator seeded with `seed` on the parameters' device, so the same seed on
    the same device gives the same weights. A tied parameter is filled once. Buffers are the
    caller's (they are not weights)."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(0.0, DUMMY_STD, generator=g)
    return module


def dummy_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                layout=None, tp=None, seed: int = 0) -> CausalLM:
    """A `CausalLM` of `cfg` with dummy weights (`fill_random_`), allocated directly on `device`
    at `dtype`; with a `sharding.ShardLayout`, this rank's shard (each rank its own draws)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
        if layout is not None:
            from .sharding import shard_model
            shard_model(model, layout, tp)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:            # to_empty gives each module its own tensor: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    fill_random_(model, seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for moe in model.moe_layers():         # buffers are not weights
        moe.expert_load = torch.zeros(moe.n_experts, dtype=torch.long, device=device)
    return model.eval()


def load_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", layout=None, tp=None, load_format: str = "safetensors",
               seed: int = 0) -> CausalLM:
    """The whole model; with a `sharding.ShardLayout`, this rank's shard (`load_sharded`).
    `load_format="dummy"`: only `config.json` is read, the weights are `dummy_model`'s (drawn
    with `seed`, plus the rank under tensor parallelism)."""
    model_dir = resolve_model_dir(path)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, not {load_format!r}")
    if load_format == "dummy":
        cfg = ModelConfig.from_json(model_dir)
        return dummy_model(cfg, dtype, device, layout, tp, seed + (layout.rank if layout is not None else 0))
    if layout is not None:
        return load_sharded(model_dir, layout, tp, dtype, device)
    cfg = ModelConfig.from_json(model_dir)
    tensors = stack_experts(read_tensors(model_dir))
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = {k: p for k, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{model_dir}: checkpoint does not match the {cfg.architecture} config: "
                              f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                              f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for k, p in expected.items():
        if tuple(tensors[k].shape) != tuple(p.shape):
            raise CheckpointError(f"{model_dir}: tensor {k} has shape {tuple(tensors[k].shape)}, "
                                  f"the config implies {tuple(p.shape)}")
    model = model.to_empty(device=device)
    model.load_state_dict({k: t.to(dtype) for k, t in tensors.items()}, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for moe in model.moe_layers():  # buffers are not in the checkpoint
        moe.expert_load = torch.zeros(moe.n_experts, dtype=torch.long, device=device)
    return model.to(dtype).eval()


def load_sharded(model_dir: Path, layout, tp=None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", stats: dict | None = None) -> CausalLM:
    """Rank `layout.rank`'s part of the model (distributed.py says what each rank holds).

    The model is built on the meta device, given its local shapes (`shard_model`), allocated,
    and filled slice by slice: `plan_reads` says which rows or columns of each checkpoint
    tensor this rank needs, and `get_slice` reads just those bytes. Tensors of other ranks
    (other experts, another rank's bias) are not opened. `stats` (if given) receives
    `elements_read`, `checkpoint_elements` and `local_elements`."""
    from .sharding import plan_reads, shard_model
    cfg = ModelConfig.from_json(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
        shard_model(model, layout, tp)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    for p in params.values():
        p.requires_grad_(False).zero_()             # vocab padding rows stay zero
    pieces = {k: (p.shape[0] if k.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")) else 1)
              for k, p in params.items()}
    read = total = 0
    unexpected = []
    for f in safetensor_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            keys = list(sf.keys())
            plan = plan_reads(cfg, layout, keys, set(params))
            for k in keys:
                sl = sf.get_slice(k)
                shape = tuple(sl.get_shape())
                total += math.prod(shape)
                if k not in plan:
                    unexpected.append(k)
                    continue
                r = plan[k]
                if r is None:
                    continue                        # another rank's
                dest = params[r.param] if r.index is None else params[r.param][r.index]
                if r.dim is None:
                    t = sl[:]
                elif r.stop <= r.start:
                    t = None                        # a vocab shard wholly past the vocabulary
                else:
                    t = sl[r.start:r.stop] if r.dim == 0 else sl[:, r.start:r.stop]
                if t is not None:
                    want = list(dest.shape)
                    if r.param in ("model.embed_tokens.weight", "lm_head.weight"):
                        want[0] = t.shape[0]        # the last vocab shard is padded
                    if list(t.shape) != want:
                        raise CheckpointError(f"{model_dir}: tensor {k} gives rank {layout.rank} a slice of shape "
                                              f"{tuple(t.shape)}, the config implies {tuple(want)}")
                    dest[:t.shape[0]].copy_(t)
                    read += t.numel()
                pieces[r.param] -= 1
    missing = sorted(k for k, n in pieces.items() if n > 0)
    if missing or unexpected:
        raise CheckpointError(f"{model_dir}: checkpoint does not match the {cfg.architecture} config: "
                              f"missing {missing[:8]}, unexpected {sorted(unexpected)[:8]}")
    for moe in model.moe_layers():
        moe.expert_load = torch.zeros(moe.n_experts, dtype=torch.long, device=device)
    if stats is not None:
        stats.update(elements_read=read, checkpoint_elements=total,
                     local_elements=sum(p.numel() for p in params.values()))
    return model.eval()


def save_model(model: CausalLM, out_dir: str | Path, max_shard_bytes: int = 16 * 2**20,
               dtype: torch.dtype | None = None) -> list[Path]:
    """Write config.json + safetensors shards (+ index when more than one)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("expert_load")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: (v.to(dtype) if dtype else v).detach().cpu().contiguous()
             for k, v in unstack_experts(state).items()}
    shards, cur, size = [], {}, 0
    for k in sorted(state):
        nbytes = state[k].numel() * state[k].element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = state[k]
        size += nbytes
    shards.append(cur)
    paths = []
    if len(shards) == 1:
        paths.append(out_dir / "model.safetensors")
        save_file(shards[0], str(paths[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, sh in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, str(out_dir / name), metadata={"format": "pt"})
            paths.append(out_dir / name)
            weight_map.update({k: name for k in sh})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    raw = dict(model.config.raw)
    if dtype is not None:
        raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return paths


# ----------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """`tokenizer.json` through `tokenizers`, with ChatML chat formatting."""

    def __init__(self, model_dir: str | Path | None = None, eos_token_ids: list[int] | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        model_dir = resolve_model_dir(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self.tok = HFTokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size()
        eos = set(eos_token_ids or [])
        for special in ("<|im_end|>", EOT):
            i = self.tok.token_to_id(special)
            if i is not None:
                eos.add(i)
        self.eos_token_ids = sorted(eos)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_releasing_gil(self, text: str) -> list[int]:
        """The ids of `encode`, computed with the interpreter lock released: `tokenizers` holds
        the lock through `encode` but drops it in its batch path, so a worker thread that
        tokenizes a long text this way does not stop the other threads (the server's event loop)."""
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest vocabulary
        entry (a byte-level entry has one character per byte, and a text character is at least
        a byte), times 4 if a normaliser could fold several characters into one. A text longer
        than `n * longest_token_chars` characters has more than `n` tokens."""
        longest = max(map(len, self.tok.get_vocab(with_added_tokens=True)), default=1)
        return longest * (4 if self.tok.normalizer is not None else 1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then the assistant header."""
        parts = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in (
                    "system", "user", "assistant"):
                raise ValueError("each message needs a role (system, user or assistant) and a string content")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


# ----------------------------------------------------------------------------- the loader check
def check_checkpoint(path: str | Path) -> ConfigCheck:
    """Read only `config.json` (and list the weight files): what would load, what is refused."""
    model_dir = resolve_model_dir(path)
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    report = check_config(json.loads(cfg_path.read_text()))
    try:
        files = safetensor_files(model_dir)
        report.rows.append(("(weights)", "honoured", f"{len(files)} safetensors file(s), not read by the check"))
    except CheckpointError as e:
        report.rows.append(("(weights)", "refused", str(e)))
    return report

