"""Engine benchmarks (run on the GPU; `python -m nanodspark.bench engine|dspark ...`).

`engine`: tokens/s of `LLM.generate` on a Qwen3-0.6B-shaped model with **random weights** at
batch 1 and 64, for each attention backend, as the baseline later work improves on. Medians of
repeats, all backends measured side by side in one run, hardware and versions recorded.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def random_checkpoint(cfg_dict: dict, out: Path, dtype=torch.bfloat16) -> Path:
    from .config import ModelConfig
    from .loader import save_model
    from .model import CausalLM
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = CausalLM(cfg).to(dtype)
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    save_model(model, out, max_shard_bytes=2**31, dtype=dtype)
    return out


def environment() -> dict:
    import platform
    env = {"torch": torch.__version__, "python": platform.python_version(), "argv": " ".join(sys.argv)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    return env


def time_generate(llm, prompts, params, repeats: int) -> dict:
    from .sampling import SamplingParams  # noqa: F401
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up (compilation, allocator)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    n = sum(len(o.token_ids) for o in outs)
    med = statistics.median(times)
    return {"generated_tokens": n, "seconds_median": round(med, 4), "seconds_all": [round(x, 4) for x in times],
            "tokens_per_second": round(n / med, 1)}


def engine_baseline(args) -> dict:
    from . import LLM, SamplingParams
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = random_checkpoint(QWEN3_0_6B, Path(tmp) / "qwen3-0.6b-random")
        backends = ["torch"] + (["triton"] if torch.cuda.is_available() else [])
        for backend in backends:
            try:
                llm = LLM(str(path), attention_backend=backend, max_num_seqs=256, use_tqdm=False,
                          kv_cache_memory_gb=args.kv_gb)
            except Exception as e:  # a backend that cannot start is reported, not hidden
                rows.append({"backend": backend, "error": repr(e)})
                continue
            g = torch.Generator().manual_seed(0)
            for batch in args.batches:
                prompts = [torch.randint(0, QWEN3_0_6B["vocab_size"], (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
                try:
                    r = time_generate(llm, prompts, params, args.repeats)
                except Exception as e:
                    r = {"error": repr(e)}
                rows.append({"backend": backend, "batch": batch, "prompt_len": args.prompt_len,
                             "max_tokens": args.max_tokens, **r})
                print(rows[-1], flush=True)
            del llm
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    result = {"benchmark": "engine baseline: LLM.generate tokens/s", "model": "Qwen3-0.6B shape, RANDOM weights",
              "dtype": "bfloat16" if torch.cuda.is_available() else "float32", **environment(), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{'backend':8} {'batch':>5} {'tok/s':>9} {'median s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:8} {r.get('batch', '-'):>5} error: {r['error'][:60]}")
        else:
            print(f"{r['backend']:8} {r['batch']:>5} {r['tokens_per_second']:>9} {r['seconds_median']:>9}")
    return result


def add_engine_args(p) -> None:
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-gb", type=float, default=8.0)
    p.add_argument("--out", default="")


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_engine_args(sub.add_parser("engine"))
    a = ap.parse_args()
    engine_baseline(a)
