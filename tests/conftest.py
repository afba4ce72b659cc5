"""Shared fixtures: tiny random Hugging Face checkpoints written by `transformers` itself."""
import os
import shutil
from pathlib import Path

# The Triton kernels run under the interpreter on CPU; the variable must be set before anything
# imports Triton (kernels/__init__.py explains why).
os.environ.setdefault("TRITON_INTERPRET", "0" if os.path.exists("/dev/nvidia0") else "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _share_the_gpu() -> None:
    """pytest-xdist's workers share one GPU, and an engine sizes its KV cache from the device's
    free memory (a fraction of it): the first worker's engines would take most of the card and
    the others' would fail to allocate. Under xdist each worker sees 1/N of the card as its own."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if n <= 1 or not torch.cuda.is_available():
        return
    whole = torch.cuda.mem_get_info

    def share(device=None):
        free, total = whole(device)
        return max(0, min(free, total // n - torch.cuda.memory_reserved(device))), total // n
    torch.cuda.mem_get_info = share


_share_the_gpu()


def _share_the_cores() -> None:
    """Under xdist each worker's torch would use every core for its CPU work (engines built with
    device="cpu", references, the tokenizer's tests): 12 workers on 16 cores then run 12 x 16
    threads, and CPU-bound tests of the GPU machine ran past their timeout. Each gets its share."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if n > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))


_share_the_cores()

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = ROOT / "nanodspark" / "assets" / "default" / "tokenizer.json"

# Token-for-token comparisons between two engines whose steps differ in shape (one-token decode
# against verify windows, a dense oracle against paged attention) need numbers that do not round
# two ways. On the CPU the tests run in float32 already; on the GPU the default is bfloat16, where
# a random tiny model's near-ties (its top two logits, or two experts' router scores, one bf16 step
# apart) can flip with the kernel's shape without either engine being wrong. Such tests pass EXACT:
# float32 there too (the kernels' dots are IEEE float32, not tf32), on the same kernels and graphs.
EXACT = {"dtype": "float32"}
ENGINE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # where LLM(...) runs by default (keys cost tables)

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            rms_norm_eps=1e-6)


def make_hf_model(kind: str, out: Path, *, window: int = 0, tie: bool = False, seed: int = 0, **over):
    """Build, randomise and `save_pretrained` a tiny model; returns its directory.

    kind: "qwen3" | "qwen3_moe" | "llama". With `window`, the upper half of the layers are
    sliding-window layers (the hybrid layout of the default model)."""
    import transformers as tf
    torch.manual_seed(seed)
    kw = dict(TINY, tie_word_embeddings=tie, **over)
    n = kw["num_hidden_layers"]
    if kind == "qwen3":
        if window:
            kw.update(layer_types=["full_attention"] * (n // 2) + ["sliding_attention"] * (n - n // 2),
                      sliding_window=window, use_sliding_window=True, max_window_layers=n // 2)
        cfg = tf.Qwen3Config(**kw)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "qwen3_moe":
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        cfg = tf.Qwen3MoeConfig(**kw)
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind == "llama":
        kw.pop("head_dim")
        cfg = tf.LlamaConfig(**kw)
        model = tf.LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(out)
    if kind == "qwen3_moe" and window:
        # transformers' Qwen3-MoE has no per-layer `layer_types` (with use_sliding_window it slides
        # in every layer); our config.json carries them, as the default model's does.
        import json
        c = json.loads((out / "config.json").read_text())
        c.update(layer_types=["full_attention"] * (n // 2) + ["sliding_attention"] * (n - n // 2),
                 sliding_window=window, use_sliding_window=True)
        (out / "config.json").write_text(json.dumps(c))
    if DEFAULT_TOKENIZER.exists():
        shutil.copy(DEFAULT_TOKENIZER, out / "tokenizer.json")
    return out, model.eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny hybrid Qwen3-MoE checkpoint (the shape of the default model) for engine tests."""
    out = tmp_path_factory.mktemp("tiny_moe")
    make_hf_model("qwen3_moe", out, window=16, vocab_size=8192)   # the vocabulary of our tokenizer
    return out


def random_drafter(target, *, gamma: int, num_layers: int, std: float, seed: int = 0, **kw):
    """An untrained drafter for `target` with N(0, std) weights (the tests only need it to be
    deterministic and non-trivial); extra keywords go to DrafterConfig.for_target."""
    from nanodspark.drafter import Drafter, DrafterConfig
    torch.manual_seed(seed)
    kw = {"markov_rank": 8, "intermediate_size": 64, **kw}
    cfg = DrafterConfig.for_target(target.config, gamma=gamma, num_layers=num_layers, **kw)
    d = Drafter(cfg, target.model.embed_tokens, target.lm_head)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return d.eval()
