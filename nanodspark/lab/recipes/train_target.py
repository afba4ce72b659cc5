"""Train the embedded default target: a small hybrid Qwen3-MoE, from scratch, in minutes.

The model (`default_target_config`) is a Qwen3-MoE with `layer_types`: the lower half of the
layers use full attention, the upper half a 128-token sliding window (the YOCO / causal
encoder-decoder split that SWA bounded replay acts on); every FFN but the first is a mixture
of 8 experts with top-2 routing, so EPLB sees real, skewed expert loads. Embeddings are tied.

Training uses the model code the engine serves (`nanodspark.model.CausalLM`) with a dense
causal attention context, bf16 autocast, AdamW, a warm-up and a cosine schedule over a *time*
budget (so one device call of a few minutes always ends with a checkpoint) or, with `--tokens`,
over a token budget (so targets trained on machines of different speed compare), a small
load-balancing loss on the routers, and sequences longer than the window. It keeps the
checkpoint with the best mean validation loss and writes it in Hugging Face layout (bf16
safetensors shards <= 15 MiB) with a JSON log of the loss curve and per-domain validation.

    python -m nanodspark.lab.recipes.default_model train --corpus .carry/corpus --out $OUT/default
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import platform
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ...config import ModelConfig
from ...loader import EOT, save_model
from ...model import CausalLM, DenseAttentionContext, MoE

# Share of training sequences drawn from each domain (code from this machine's Python sources).
# "default" is the embedded target's recipe. The "distill" mixtures add answers of a pretrained
# teacher (recipes/distill.py, a `distill.txt.xz` in the corpus), taking their share from the
# other domains; they are the experiments of 09_results.md §4e and §4f (distill_code.txt.xz and
# distill_np.txt.xz: the teacher's code answers alone, and its answers without poems).
MIXTURES = {
    "default": {"code": 0.30, "docs": 0.14, "chat": 0.22, "math": 0.16, "literature": 0.12, "dict": 0.06},
    "distill10": {"code": 0.25, "docs": 0.14, "chat": 0.17, "math": 0.16, "literature": 0.12, "dict": 0.06,
                  "distill": 0.10},
    "distill25": {"code": 0.20, "docs": 0.10, "chat": 0.13, "math": 0.14, "literature": 0.12, "dict": 0.06,
                  "distill": 0.25},
    # distill25 with 8 % more teacher code (distill_code.txt.xz: code prompts only, 448 tokens),
    # taken from natural code; "_np" uses the teacher's answers without its poems (distill_np).
    "distill25c": {"code": 0.12, "docs": 0.10, "chat": 0.13, "math": 0.14, "literature": 0.12, "dict": 0.06,
                   "distill": 0.25, "distill_code": 0.08},
    "distill25c_np": {"code": 0.12, "docs": 0.10, "chat": 0.13, "math": 0.14, "literature": 0.12, "dict": 0.06,
                      "distill_np": 0.25, "distill_code": 0.08},
}
VAL_DOMAINS = ("math", "chat", "poetry", "code", "shakespeare")


def default_target_config(vocab_size: int = 8192, im_end_id: int = 2) -> dict:
    n_layers, window = 6, 128
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab_size, "hidden_size": 384, "intermediate_size": 768,
        "num_hidden_layers": n_layers, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
        "layer_types": ["full_attention"] * (n_layers // 2) + ["sliding_attention"] * (n_layers - n_layers // 2),
        "sliding_window": window, "use_sliding_window": True, "max_window_layers": n_layers // 2,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [0],
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
        "eos_token_id": im_end_id, "torch_dtype": "bfloat16",
    }


# ----------------------------------------------------------------------------- data
def read_xz(path: Path) -> str:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def tokenize_documents(tok, docs: list[str], eot_id: int, piece_chars: int = 100_000) -> torch.Tensor:
    """Documents -> one uint16-range id stream with `<|endoftext|>` after each document."""
    pieces, owner = [], []
    for i, d in enumerate(docs):
        for s in range(0, len(d), piece_chars):
            pieces.append(d[s:s + piece_chars])
            owner.append(i)
    ids: list[int] = []
    encs = tok.encode_batch(pieces, add_special_tokens=False)
    for j, e in enumerate(encs):
        ids += e.ids
        if j + 1 == len(encs) or owner[j + 1] != owner[j]:
            ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.int32)


def load_streams(corpus: Path, tok, eot_id: int, code_mb: float) -> tuple[dict, dict]:
    from tqdm import tqdm
    train, val = {}, {}
    for path in tqdm(sorted(corpus.glob("*.txt.xz")), desc="tokenize"):
        name = path.name.removesuffix(".txt.xz")
        docs = [d for d in read_xz(path).split(EOT) if d]
        stream = tokenize_documents(tok, docs, eot_id)
        if name.startswith("val_"):
            val[name[4:]] = stream
        else:
            train[name] = stream
    if code_mb > 0:  # more code from this machine's own site-packages (plentiful on the GPU host)
        from .corpus import load_eval_needles, python_source_files
        try:
            exclude = load_eval_needles(corpus)["code"]
        except (FileNotFoundError, KeyError):
            exclude = []
        files = python_source_files(sysconfig.get_paths()["purelib"], code_mb * 2**20, exclude=exclude)
        extra = tokenize_documents(tok, [t for _, t in files], eot_id)
        train["code"] = torch.cat([train["code"], extra]) if "code" in train else extra
    return train, val


def sample_batch(streams: dict, weights: dict, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    names = [n for n in weights if n in streams]
    w = torch.tensor([weights[n] for n in names])
    which = torch.multinomial(w, batch, replacement=True, generator=gen)
    rows = []
    for i in which.tolist():
        s = streams[names[i]]
        off = int(torch.randint(0, len(s) - seq - 1, (1,), generator=gen))
        rows.append(s[off:off + seq + 1])
    return torch.stack(rows).long()


# ----------------------------------------------------------------------------- training
def lm_loss(model: CausalLM, x: torch.Tensor) -> torch.Tensor:
    B, S = x.shape[0], x.shape[1] - 1
    inp = x[:, :-1].reshape(-1)
    pos = torch.arange(S, device=x.device).repeat(B)
    out = model(inp, pos, DenseAttentionContext(B, S))
    logits = model.lm_head(out.hidden).float()
    return F.cross_entropy(logits, x[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, val: dict, batch: int, seq: int, device, n_batches: int = 4) -> dict:
    model.eval()
    res = {}
    for name, s in val.items():
        n = min(n_batches * batch, (len(s) - 1) // seq)
        if n == 0:
            continue
        xs = s[: n * seq + 1]
        rows = torch.stack([xs[i * seq: i * seq + seq + 1] for i in range(n)]).long().to(device)
        losses = []
        for i in range(0, n, batch):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                losses.append(lm_loss(model, rows[i:i + batch]).item())
        res[name] = round(sum(losses) / len(losses), 4)
    model.train()
    return res


def balance_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-style load balancing: E * sum_e (fraction routed to e) * (mean router prob of e)."""
    total = 0.0
    for z in router_logits:
        p = torch.softmax(z.float(), -1)
        E = p.shape[-1]
        chosen = F.one_hot(torch.topk(p, top_k, -1).indices, E).sum(1).float()
        total = total + E * (chosen.mean(0) / top_k * p.mean(0)).sum()
    return total / max(1, len(router_logits))


def train(args) -> dict:
    from tokenizers import Tokenizer
    from tqdm import tqdm
    mixture = MIXTURES[args.mixture]
    missing = [n for n in mixture if n.startswith("distill") and not (Path(args.corpus) / f"{n}.txt.xz").exists()]
    if missing:
        raise SystemExit(f"mixture {args.mixture!r} needs {', '.join(n + '.txt.xz' for n in missing)} in "
                         f"{args.corpus} (recipes/distill.py)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(args.tokenizer))
    eot_id, im_end = tok.token_to_id(EOT), tok.token_to_id("<|im_end|>")
    t0 = time.time()
    train_s, val_s = load_streams(Path(args.corpus), tok, eot_id, args.code_mb)
    data_s = time.time() - t0
    print({k: len(v) for k, v in train_s.items()}, {k: len(v) for k, v in val_s.items()}, f"{data_s:.0f}s", flush=True)
    cfg = ModelConfig.from_dict(default_target_config(tok.get_vocab_size(), im_end))
    model = CausalLM(cfg).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02 if "down_proj" not in name and "o_proj" not in name
                                      else 0.02 / math.sqrt(2 * cfg.num_hidden_layers))
    n_params = sum(p.numel() for p in model.parameters())
    router_logits: list[torch.Tensor] = []
    for moe in model.moe_layers():
        moe.gate.register_forward_hook(lambda m, i, o: router_logits.append(o))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    log = {"config": cfg.raw, "params": n_params, "curve": [], "val": [], "data_seconds": round(data_s, 1),
           "train_tokens": {k: len(v) for k, v in train_s.items()},
           "mixture": {k: v for k, v in mixture.items() if k in train_s}}
    best, best_state, step, tokens = float("inf"), None, 0, 0
    start = last_eval = time.time()
    # The schedule runs on time, or on tokens when --tokens is given (so that targets trained
    # on machines of different speed see the same data).
    bar = tqdm(total=int(args.tokens or args.seconds), desc="train (tokens)" if args.tokens else "train (s)",
               unit="tok" if args.tokens else "s", unit_scale=bool(args.tokens))
    while True:
        frac = tokens / args.tokens if args.tokens else (time.time() - start) / args.seconds
        if frac >= 1 or (args.max_steps and step >= args.max_steps):
            break
        lr = args.lr * (min(1.0, frac / args.warmup) if frac < args.warmup else
                        0.1 + 0.45 * (1 + math.cos(math.pi * (frac - args.warmup) / (1 - args.warmup))))
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_batch(train_s, mixture, args.batch, args.seq, gen).to(device, non_blocking=True)
        router_logits.clear()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = lm_loss(model, x)
            aux = balance_loss(router_logits, cfg.num_experts_per_tok)
        (loss + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        if step % 25 == 0:
            el = time.time() - start
            log["curve"].append({"step": step, "seconds": round(el, 1), "tokens": tokens,
                                 "loss": round(loss.detach().item(), 4), "aux": round(float(aux), 4), "lr": lr})
            bar.n = tokens if args.tokens else int(el)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / el:.0f}")
        if time.time() - last_eval > args.eval_every or (args.max_steps and step == args.max_steps):
            last_eval = time.time()
            v = evaluate(model, val_s, args.batch, args.seq, device)
            mean = sum(v.values()) / max(1, len(v))
            log["val"].append({"step": step, "seconds": round(time.time() - start, 1), "tokens": tokens, **v})
            print(f"\nstep {step} val {v}", flush=True)
            if mean < best:
                best, best_state = mean, {k: t.detach().clone() for k, t in model.state_dict().items()}
    bar.close()
    v = evaluate(model, val_s, args.batch, args.seq, device)
    log["val"].append({"step": step, "seconds": round(time.time() - start, 1), "tokens": tokens, **v})
    if best_state is not None and best < sum(v.values()) / max(1, len(v)):
        model.load_state_dict(best_state)
        v = evaluate(model, val_s, args.batch, args.seq, device)
    log.update(final_val=v, steps=step, tokens=tokens, train_seconds=round(time.time() - start, 1),
               tokens_per_second=round(tokens / (time.time() - start)),
               expert_load=expert_load(model, val_s, device, args.seq),
               device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
               torch=torch.__version__, command=args.command)
    out = Path(args.out)
    save_model(model, out, max_shard_bytes=15 * 2**20, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = Path(args.tokenizer).parent / name
        if src.exists():
            (out / name).write_bytes(src.read_bytes())
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print("final val", v, "params", n_params, "tokens/s", log["tokens_per_second"], flush=True)
    return log


@torch.no_grad()
def expert_load(model: CausalLM, val: dict, device, seq: int) -> list[list[int]]:
    """Tokens routed to each expert of each MoE layer over a slice of every validation set."""
    moes: list[MoE] = model.moe_layers()
    for m in moes:
        m.expert_load.zero_()
        m.record_load = True
    model.eval()
    for s in val.values():
        x = s[: min(len(s), 8 * seq)].long().to(device)
        model(x, torch.arange(len(x), device=device) % seq, DenseAttentionContext(1, len(x)))
    for m in moes:
        m.record_load = False
    return [m.expert_load.tolist() for m in moes]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", default=".carry/corpus", help="folder of *.txt.xz built by the corpus step")
    p.add_argument("--tokenizer", default=str(Path(__file__).parents[2] / "assets/default/tokenizer.json"))
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=150.0, help="training time budget")
    p.add_argument("--tokens", type=float, default=0, help="training token budget (replaces --seconds)")
    p.add_argument("--mixture", choices=sorted(MIXTURES), default="default", help="domain shares (MIXTURES)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = time only)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.03, help="fraction of the time (or token) budget")
    p.add_argument("--aux-coef", type=float, default=0.01, help="weight of the router balance loss")
    p.add_argument("--eval-every", type=float, default=20.0, help="seconds between validations")
    p.add_argument("--code-mb", type=float, default=0.0, help="MB of extra code from site-packages")
    p.add_argument("--seed", type=int, default=0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap)
    a = ap.parse_args()
    a.command = "python -m nanodspark.lab.recipes.train_target " + " ".join(os.sys.argv[1:])
    train(a)
