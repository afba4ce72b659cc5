"""Train the DSpark drafter of a target, calibrate its confidence head with STS, and report.

    python train_heads.py --out runs/drafter                     # default target, all phases
    python train_heads.py --phases data,train --seconds 120 ...  # a subset

Phases (paper sections 3.3, 3.2.1, 4):

1. `data` — prompts from *training* text only (never evaluation prompts): the beginnings of
   corpus documents of every domain (chat and math cut at the assistant turn). The target
   answers them with our own engine (batched, sampled), and the token ids are saved.
2. `train` — the drafter learns from the target: for random anchors `a` of each response the
   block `[x_a, mask x (gamma-1)]` must predict `x_{a+1..a+gamma}`. Loss per slot k (weight
   `exp(-k/4)`, only over a valid prefix): `0.1 * CE + 0.9 * L1(p_draft, p_target) +
   1.0 * BCE(confidence, 1 - L1/2 detached)`. The Markov head is teacher-forced. AdamW,
   warm-up + cosine over a time budget, bf16 autocast on GPU, a progress bar, safetensors
   checkpoints; resumable (`--resume` continues from `out/<drafter>/train_state.*`, written every
   `--ckpt-every` seconds, and ends exactly where an uninterrupted run would). The same run
   trains the DFlash ablation (no Markov head, no confidence, CE only), step-matched by default;
   the `dflash` phase trains only the ablation, later, step-matched to the DSpark run on record.
3. `calibrate` — speculative decoding with full-block verification on held-out prompts records
   raw confidence logits and prefix-acceptance labels (saved; `--calib-records` refits from
   them); on one half (stratified by workload) `calibration.fit_sts` fits one temperature per
   position and `fit_sts_shifted` a temperature and a logit shift per position; the report
   scores both on the other half (ECE/AUROC/Brier, offset intervals, halves swapped) and ships
   `--sts` (default: shifted).
4. `eval` — acceptance length tau (committed tokens per verify step, bonus included) per workload
   at T=0 and T=1, for DSpark and the DFlash ablation; per-position conditional acceptance;
   the reliability diagram (PNG).
5. `proxy` (not in the default phases) — teacher-forced acceptance on held-out *natural* text of
   each workload (the corpus's `val_*` files): what the drafter and the target can predict on
   that kind of text, apart from what the target's own generations look like
   (`nanodspark/lab/text_proxy.py`).
Everything goes into `report.json`. `--target DIR` takes any checkpoint the engine serves (e.g.
SmolLM2 from `distill --export-target`); `--write-prompt-corpus DIR` only writes a small copy of
the corpus's prompt sources, to travel with a large target (chapter 09). Where prompts come
from: `nanodspark/lab/prompt_corpus.py`.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from nanodspark import LLM, SamplingParams  # noqa: E402
from nanodspark.calibration import (apply_temperatures, calibration_report, fit_sts, fit_sts_shifted,  # noqa: E402
                                    offset_interval, survival)
from nanodspark.drafter import Drafter, DrafterConfig  # noqa: E402
from nanodspark.drafter_training import block_pass  # noqa: E402
from nanodspark.lab.prompt_corpus import (BUILD_CORPUS, TRAIN_DOMAINS, find_corpus,  # noqa: E402
                                          training_prompts, write_prompt_corpus)
from nanodspark.lab.text_proxy import PROXY_DOMAINS, text_proxy  # noqa: E402
from nanodspark.loader import EOT, Tokenizer, load_model, resolve_model_dir  # noqa: E402

LOSS_ALPHA = {"ce": 0.1, "l1": 0.9, "conf": 1.0}   # paper Eq. 12 / DeepSpec config
DFLASH_ALPHA = {"ce": 1.0, "l1": 0.0, "conf": 0.0}
DECAY = 4.0                                        # position weight exp(-k / DECAY), DeepSpec code
PHASES = {"data", "train", "dflash", "calibrate", "eval", "proxy"}


# ----------------------------------------------------------------------------- 1. data
def build_data(args, tok: Tokenizer) -> list[dict]:
    prompts = training_prompts(Path(args.corpus), args.n_prompts, args.seed, tuple(args.domains.split(",")))
    if not prompts:
        raise SystemExit(f"train_heads.py: no training prompt in {args.corpus} for --domains {args.domains} "
                         "(no document longer than 80 characters)")
    llm = LLM(args.target, drafter_path="none", max_num_seqs=args.gen_batch, use_tqdm=True,
              max_num_batched_tokens=8192)
    params = SamplingParams(temperature=args.gen_temperature, top_p=args.gen_top_p, max_tokens=args.gen_tokens, seed=None)
    ids = [tok.encode(p)[-args.max_prompt_tokens:] for p in prompts]
    outs = llm.generate(ids, params)
    data = [{"prompt": p, "response": o.token_ids} for p, o in zip(ids, outs) if len(o.token_ids) >= 8]
    del llm
    if not data:
        raise SystemExit(f"train_heads.py: the target answered none of {len(prompts)} prompts with 8 tokens or more; "
                         "nothing to train on (raise --gen-tokens, or check the target)")
    return data


# ----------------------------------------------------------------------------- 2. training
def batch_at(data: list, batch: int, seed: int, step: int) -> list:
    """The sequences of optimiser step `step`. Epoch e is a permutation of the data seeded by
    (seed, e), so the batches depend only on the step number and a resumed run sees exactly the
    batches an uninterrupted one would."""
    per_epoch = max(1, len(data) // batch)
    epoch, i = divmod(step, per_epoch)
    order = _epoch_order(len(data), seed, epoch)
    return [data[j] for j in order[i * batch:(i + 1) * batch]]


@functools.lru_cache(maxsize=2)
def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def drafter_loss(drafter: Drafter, target, seqs: list[dict], gamma: int, n_anchors: int, alpha: dict,
                 device, gen: torch.Generator):
    """Loss of one batch of sequences (each = prompt + target response): paper Eq. 12."""
    bp = block_pass(drafter, target, seqs, gamma, n_anchors, device, gen)
    k = torch.arange(gamma, device=device)
    w = torch.exp(-k.float() / DECAY) * bp.valid.float()
    total_w = w.sum().clamp_min(1e-6)
    logits = bp.logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), bp.labels.reshape(-1), reduction="none").view(w.shape)
    l1 = (torch.softmax(logits, -1) - bp.p_target).abs().sum(-1)
    loss = alpha["ce"] * ce + alpha["l1"] * l1
    logs = {}
    if alpha["conf"] and drafter.config.confidence:
        z = drafter.confidence_logit(bp.h, bp.prev)
        bce = F.binary_cross_entropy_with_logits(z, (1 - 0.5 * l1).clamp(0, 1).detach(), reduction="none")
        loss = loss + alpha["conf"] * bce
        logs["conf"] = float((bce * w).sum().detach() / total_w)
    logs.update(ce=float((ce * w).sum().detach() / total_w), l1=float((l1 * w).sum().detach() / total_w),
                acc=float(((logits.argmax(-1) == bp.labels).float() * w).sum() / total_w))
    return (loss * w).sum() / total_w, logs


def train_drafter(args, target, data, dcfg: DrafterConfig, alpha: dict, seconds: float, out: Path, name: str,
                  max_steps: int = 0):
    """Train for `seconds` (or exactly `max_steps` optimiser steps when given); the learning-rate
    schedule runs over whichever budget is set, so a step-matched run has the same schedule.

    Resumable: every `--ckpt-every` seconds and at the end the full training state (weights,
    AdamW moments, step, elapsed time, anchor RNG, curve) goes to `out/train_state.*`; with
    `--resume` a run continues from it and ends bit-for-bit where an uninterrupted run would
    (the batches depend only on the step number, see `batch_at`)."""
    from tqdm import tqdm
    device = next(target.parameters()).device
    torch.manual_seed(args.seed)
    if getattr(args, "init", None) and name == "dspark":     # fine-tune an existing drafter (its own config)
        drafter = Drafter.load(args.init, target, device=device)
        if drafter.config.gamma != dcfg.gamma:
            raise ValueError(f"--init {args.init} has gamma {drafter.config.gamma}, not --gamma {dcfg.gamma}")
    else:
        drafter = Drafter(dcfg, target.model.embed_tokens, target.lm_head).to(device)
        for n_, p in drafter.named_parameters():
            if p.dim() >= 2 and "markov_w2" not in n_:
                torch.nn.init.normal_(p, std=0.02)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    max_steps = max_steps or args.max_steps
    budget = {"max_steps": max_steps} if max_steps else {"seconds": seconds}
    curve, step, elapsed = [], 0, 0.0
    if args.resume and (out / "train_state.json").exists():
        step, elapsed, curve = load_train_state(out, drafter, opt, gen, budget)
        print(f"resumed {name} at step {step} ({elapsed:.0f} s done)", flush=True)
    start = time.time() - elapsed
    last_ckpt = time.time()
    bar = tqdm(total=max_steps or int(seconds), desc=f"train {name}", unit="step" if max_steps else "s")
    for p in target.parameters():
        p.requires_grad_(False)
    loss, logs = torch.tensor(float("nan")), {}
    while True:
        frac = step / max_steps if max_steps else (time.time() - start) / seconds
        if frac >= 1 or (args.stop_at_step and step >= args.stop_at_step):
            break
        lr = args.lr * (frac / 0.04 if frac < 0.04 else 0.5 * (1 + math.cos(math.pi * (frac - 0.04) / 0.96)))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, logs = drafter_loss(drafter, target, batch_at(data, args.batch, args.seed, step), dcfg.gamma,
                                      args.anchors, alpha, device, gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0 or step == 1:
            curve.append({"step": step, "seconds": round(time.time() - start, 1), "loss": round(float(loss.detach()), 4),
                          **{k: round(v, 4) for k, v in logs.items()}})
            bar.n = step if max_steps else int(time.time() - start)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc=f"{logs['acc']:.3f}")
        if args.ckpt_every and time.time() - last_ckpt >= args.ckpt_every:
            save_train_state(out, drafter, opt, gen, step, time.time() - start, curve, budget)
            last_ckpt = time.time()
    bar.close()
    if logs and (not curve or curve[-1]["step"] != step):
        curve.append({"step": step, "seconds": round(time.time() - start, 1), "loss": round(float(loss.detach()), 4),
                      **{k: round(v, 4) for k, v in logs.items()}})
    if args.ckpt_every or args.stop_at_step:
        save_train_state(out, drafter, opt, gen, step, time.time() - start, curve, budget)
    drafter.save(out, dtype=torch.bfloat16)
    return drafter.eval(), curve


def save_train_state(out: Path, drafter, opt, gen, step: int, elapsed: float, curve: list, budget: dict) -> None:
    """Weights (fp32), AdamW moments and the anchor RNG as safetensors; counters as JSON."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"anchor_rng": gen.get_state()}
    for n, p in drafter.named_parameters():
        if not p.requires_grad:
            continue
        tensors[f"param.{n}"] = p.detach().float().cpu().contiguous()
        for k, v in opt.state.get(p, {}).items():
            tensors[f"adam.{k}.{n}"] = torch.as_tensor(v).detach().cpu().contiguous()
    save_file(tensors, str(out / "train_state.safetensors"))
    (out / "train_state.json").write_text(json.dumps({"step": step, "elapsed": elapsed, "budget": budget,
                                                      "curve": curve}))


def load_train_state(out: Path, drafter, opt, gen, budget: dict) -> tuple[int, float, list]:
    from safetensors.torch import load_file
    meta = json.loads((out / "train_state.json").read_text())
    if meta["budget"] != budget:
        raise SystemExit(f"{out}: the saved run had budget {meta['budget']}, this one {budget}; "
                         "resume with the same --seconds / --max-steps")
    t = load_file(str(out / "train_state.safetensors"))
    gen.set_state(t["anchor_rng"])
    for n, p in drafter.named_parameters():
        if not p.requires_grad:
            continue
        with torch.no_grad():
            p.copy_(t[f"param.{n}"])
        state = {k.split(".", 2)[1]: v.to(p.device) if v.dim() else v
                 for k, v in t.items() if k.startswith("adam.") and k.split(".", 2)[2] == n}
        if state:
            opt.state[p] = state
    return meta["step"], meta["elapsed"], meta["curve"]


# ----------------------------------------------------------------------------- 3-4. calibrate, evaluate
def record_spec(llm, prompts, params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Run full-block speculative decoding; per proposal: raw conf logits, prefix labels, valid,
    and the id of the request (prompt) it came from."""
    from nanodspark.observers import CalibrationRecorder
    eng = llm.engine
    recorder = CalibrationRecorder()
    eng.extra_observers.append(recorder)
    m = eng.metrics
    m.position_trials[:] = 0                  # this run's counts only
    m.position_accepts[:] = 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng.extra_observers.remove(recorder)
    rec, g = recorder.records, eng.gamma
    z = torch.stack([r[0] for r in rec]) if rec else torch.zeros(0, g)
    k = torch.arange(g)
    acc = torch.tensor([r[1] for r in rec])
    nver = torch.tensor([r[2] for r in rec])
    labels = (k[None, :] < acc[:, None]).float()
    valid = k[None, :] < nver[:, None]
    prompt_of: dict = {}                  # request id (a string) -> prompt index
    groups = torch.tensor([prompt_of.setdefault(r[3], len(prompt_of)) for r in rec], dtype=torch.int64)
    steps = sum(o.spec["steps"] for o in outs)
    tau = sum(o.spec["committed"] for o in outs) / max(1, steps)
    cond = [a / t if t else None for a, t in zip(m.position_accepts.tolist(), m.position_trials.tolist())]
    rep = repeated_ngram_fraction([(p, o.token_ids) for p, o in zip(prompts, outs)])
    return z, labels, valid, groups, {"tau": round(tau, 4), "steps": steps, "conditional_acceptance": cond,
                              "repeated_4gram_fraction": round(rep, 4)}


def repeated_ngram_fraction(pairs, n: int = 4) -> float:
    """Share of generated n-grams already seen earlier in the prompt or output: how repetitive
    (hence how easy to draft) the target's text is on a workload."""
    seen_total = total = 0
    for prompt, out in pairs:
        ids = list(prompt) + list(out)
        seen = {tuple(ids[i:i + n]) for i in range(len(prompt) - n + 1)}
        for i in range(max(len(prompt), n) - n + 1, len(ids) - n + 1):
            g = tuple(ids[i:i + n])
            seen_total += g in seen
            total += 1
            seen.add(g)
    return seen_total / total if total else 0.0


def workload_prompts(tok: Tokenizer, name: str, n: int, data_dir, at_most: bool = False,
                     as_shipped: bool = False) -> list[list[int]]:
    """n prompts of a workload (`at_most`: all of them if it has fewer, e.g. chat has 80).
    `as_shipped` puts back the trailing newline the code workload strips from HumanEval's
    prompts (the prompt exactly as HumanEval ships it; chapter 09)."""
    from nanodspark.lab.workloads import load_workload, workload_size
    if at_most:
        n = min(n, workload_size(name, data_dir))
    return [tok.encode(p.render() + (p.meta.get("cut", "") if as_shipped else ""))
            for p in load_workload(name, n=n, data_dir=data_dir)]


def evaluate(args, drafter_dirs: dict, tok: Tokenizer) -> dict:
    res = {}
    for name, ddir in drafter_dirs.items():
        llm = LLM(args.target, drafter_path=str(ddir), verify_mode="static", max_num_seqs=128, use_tqdm=False)
        for wl in args.eval_workloads.split(","):
            prompts = workload_prompts(tok, wl, args.eval_n, args.data_dir, at_most=True,
                                       as_shipped=args.code_prompts_as_shipped)
            for temp in (0.0, 1.0):
                params = SamplingParams(temperature=temp, max_tokens=args.eval_tokens, seed=args.seed)
                *_, m = record_spec(llm, prompts, params)
                res.setdefault(name, {}).setdefault(wl, {})[f"T={temp:g}"] = m
                print(name, wl, f"T={temp:g}", "tau", m["tau"], flush=True)
    return res


RECORD_KEYS = ("z", "labels", "valid", "groups")


def calibration_records(args, ddir: Path, tok: Tokenizer, out: Path) -> dict:
    """Raw confidence logits, prefix labels, validity and prompt ids of the fit and held-out
    halves: recorded by speculative decoding (and saved to out/calibration_records.safetensors),
    or read back from `--calib-records` so that a fit can be redone in seconds on a CPU."""
    from safetensors.torch import load_file, save_file
    if args.calib_records:
        flat = load_file(args.calib_records)
        return {h: [flat[f"{h}.{k}"] for k in RECORD_KEYS] for h in ("fit", "held")}
    llm = LLM(args.target, drafter_path=str(ddir), verify_mode="static", max_num_seqs=256, use_tqdm=False)
    # Split each workload in half (stratified): an unstratified split of ~550 prompts can put a
    # few % more of an easy workload in one half, which shows up as a constant ECE offset.
    rng, halves = random.Random(args.seed), {"fit": [], "held": []}
    for wl in ("math", "chat", "poetry", "code"):
        p = workload_prompts(tok, wl, args.calib_n, args.data_dir, at_most=True)
        rng.shuffle(p)
        halves["fit"] += p[:len(p) // 2]
        halves["held"] += p[len(p) // 2:]
    params = SamplingParams(temperature=args.calib_temperature, max_tokens=args.calib_tokens, seed=args.seed)
    rec = {h: list(record_spec(llm, ps, params)[:4]) for h, ps in halves.items()}
    save_file({f"{h}.{k}": v.contiguous() for h, r in rec.items() for k, v in zip(RECORD_KEYS, r)},
              str(out / "calibration_records.safetensors"))
    return rec


def calibrate(args, ddir: Path, tok: Tokenizer, out: Path) -> dict:
    rec = calibration_records(args, ddir, tok, out)
    (z_fit, y_fit, v_fit, _), (z_ev, y_ev, v_ev, g_ev) = rec["fit"], rec["held"]
    # Both fits on the fit half, both scored on the held-out half: the paper's STS (one
    # temperature per position) and STS with a logit shift per position (shipped by default).
    fitters = {"plain": lambda z, y, v: (fit_sts(z, y, v), None), "shifted": fit_sts_shifted}
    fits = {name: fit(z_fit, y_fit, v_fit) for name, fit in fitters.items()}
    reports = {name: calibration_report(z_ev, y_ev, v_ev, t, shifts=s) for name, (t, s) in fits.items()}
    result = {"held_out_proposals": int(len(z_ev)), "fit_proposals": int(len(z_fit)),
              "held_out_prompts": int(g_ev.unique().numel()), "calib_n": args.calib_n,
              "split": "stratified by workload", "calibration_temperature": args.calib_temperature,
              "shipped": args.sts}
    for name, (temps, shifts) in fits.items():
        rep = reports[name]
        print(f"-- STS {name} (fit on one half, scored on the held-out half)\n{rep.format()}", flush=True)
        # How much of what is left is the split, and how much a real offset? (1) the other
        # direction: fit on the held-out half, score on the fit half; (2) mean prediction minus
        # observed rate, with an interval that resamples prompts, not proposals.
        t2, s2 = fitters[name](z_ev, y_ev, v_ev)
        swapped = calibration_report(z_fit, y_fit, v_fit, t2, shifts=s2)
        offsets = offset_interval(survival(apply_temperatures(z_ev, temps, shifts)), y_ev, v_ev, g_ev)
        for k, ((gap, lo, hi), m) in enumerate(zip(offsets, swapped.after)):
            print(f"pos {k + 1}: pred - observed {gap:+.4f} [{lo:+.4f}, {hi:+.4f}] (90 %, prompts resampled); "
                  f"ECE with the halves swapped {m.ece:.4f}", flush=True)
        result[name] = {
            "temperatures": [round(float(t), 4) for t in temps],
            "shifts": None if shifts is None else [round(float(x), 4) for x in shifts],
            "after": [vars(m) for m in rep.after], "mean_ece_after": rep.mean_ece("after"),
            "offset_after_90pct_prompt_bootstrap": [[round(x, 5) for x in o] for o in offsets],
            "swapped_halves": {"temperatures": swapped.temperatures, "shifts": swapped.shifts,
                               "after": [vars(m) for m in swapped.after], "mean_ece_after": swapped.mean_ece("after")}}
    result["before"] = [vars(m) for m in reports["plain"].before]
    result["mean_ece_before"] = reports["plain"].mean_ece("before")
    # ship the chosen calibration with the drafter
    temps, shifts = fits[args.sts]
    d = Drafter.load(ddir, load_model(args.target, dtype=torch.float32))
    d.sts_temperature.copy_(temps.float())
    d.sts_shift.copy_(torch.zeros_like(temps) if shifts is None else shifts.float())
    d.save(ddir, dtype=torch.bfloat16)
    try:
        from nanodspark.lab import plots
        plots.reliability(z_ev, y_ev, out / "reliability.png", valid=v_ev, temps=temps, shifts=shifts,
                          caption=f"Held-out half of {out}/calibration_records.safetensors; "
                                  f"written by: python {args.command}")
    except ModuleNotFoundError as e:      # the report has the numbers; the picture is optional
        print(f"{out / 'reliability.png'} not drawn: {e}", flush=True)
    result.update(temperatures=result[args.sts]["temperatures"], shifts=result[args.sts]["shifts"],
                  after=result[args.sts]["after"], mean_ece_after=result[args.sts]["mean_ece_after"])
    return result


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Train, calibrate and evaluate a DSpark drafter. The data phase reads a built corpus, "
                    "which a fresh clone does not have: " + BUILD_CORPUS,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--target", default=None, help="target model dir (default: the embedded one)")
    ap.add_argument("--corpus", default=None,
                    help="the built corpus (*.txt.xz): training prompts (data phase) and val_* text (proxy phase); "
                         "default: .carry/corpus, else build/corpus")
    ap.add_argument("--data-dir", default=None, help="workload data (default: ../shared/data or .carry/data)")
    ap.add_argument("--out", default="runs/drafter", help="output folder: data, drafters, report.json, reliability.png")
    ap.add_argument("--phases", default="data,train,calibrate,eval",
                    help="comma-separated, of data, train, dflash, calibrate, eval, proxy")
    ap.add_argument("--gamma", type=int, default=5, help="block size: draft tokens per proposal")
    ap.add_argument("--layers", type=int, default=2, help="drafter backbone layers")
    ap.add_argument("--markov-rank", type=int, default=64, help="rank of the Markov head")
    ap.add_argument("--target-layers", default="",
                    help="comma-separated target layers the drafter reads (default: about n/4, n/2, n-2)")
    ap.add_argument("--intermediate", type=int, default=640, help="drafter MLP width")
    ap.add_argument("--n-prompts", type=int, default=4000, help="training prompts the target answers (data phase)")
    ap.add_argument("--domains", default=",".join(TRAIN_DOMAINS),
                    help="corpus domains the training prompts come from, evenly (e.g. code for a code-heavy run)")
    ap.add_argument("--init", default=None,
                    help="start the DSpark drafter from this checkpoint instead of random weights (fine-tuning)")
    ap.add_argument("--max-prompt-tokens", type=int, default=128,
                    help="training prompts are cut to their last N tokens")
    ap.add_argument("--gen-tokens", type=int, default=160, help="tokens of each target response")
    ap.add_argument("--gen-batch", type=int, default=256, help="concurrent requests while the target answers")
    ap.add_argument("--gen-temperature", type=float, default=1.0,
                    help="sampling temperature of the target's responses (1: the policy the drafter is served and calibrated at)")
    ap.add_argument("--gen-top-p", type=float, default=1.0, help="top-p of the target's responses")
    ap.add_argument("--seconds", type=float, default=150, help="DSpark training budget")
    ap.add_argument("--dflash", choices=("steps", "seconds", "off"), default="steps",
                    help="DFlash ablation: as many optimiser steps as DSpark took (default), "
                         "--dflash-seconds of training, or none")
    ap.add_argument("--dflash-seconds", type=float, default=90, help="DFlash budget when --dflash seconds")
    ap.add_argument("--max-steps", type=int, default=0, help="stop DSpark after this many steps (0 = time budget)")
    ap.add_argument("--ckpt-every", type=float, default=60.0,
                    help="seconds between training-state checkpoints (0 = none; needed for --resume)")
    ap.add_argument("--resume", action="store_true", help="continue each drafter from its out/*/train_state.*")
    ap.add_argument("--stop-at-step", type=int, default=0,
                    help="stop (and checkpoint) at this step without finishing the schedule: a pre-emption drill")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=48, help="anchors per sequence")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (warm-up, then cosine)")
    ap.add_argument("--calib-n", type=int, default=200,
                    help="prompts per workload for STS, at most all of it (half fit, half held out)")
    ap.add_argument("--calib-tokens", type=int, default=256, help="tokens generated per calibration prompt")
    ap.add_argument("--calib-temperature", type=float, default=1.0, help="sampling temperature while recording")
    ap.add_argument("--calib-records", default=None,
                    help="refit from a saved out/calibration_records.safetensors instead of decoding")
    ap.add_argument("--sts", choices=("shifted", "plain"), default="shifted",
                    help="ship STS with a logit shift per position (default) or the paper's plain STS")
    ap.add_argument("--eval-n", type=int, default=40, help="prompts per workload for tau (at most all of it)")
    ap.add_argument("--eval-tokens", type=int, default=96, help="tokens generated per eval prompt")
    ap.add_argument("--eval-workloads", default="math,chat,poetry,code", help="workloads of the eval phase")
    ap.add_argument("--code-prompts-as-shipped", action="store_true",
                    help="eval code on HumanEval's prompts with their trailing newline (chapter 09)")
    ap.add_argument("--proxy-n", type=int, default=100, help="documents per workload for the text proxy")
    ap.add_argument("--proxy-tokens", type=int, default=384, help="tokens per document for the text proxy")
    ap.add_argument("--seed", type=int, default=0, help="seed of prompts, anchors, splits and sampling")
    ap.add_argument("--write-prompt-corpus", default=None, metavar="DIR",
                    help="only write a small copy of --corpus for training prompts to DIR, then exit")
    ap.add_argument("--prompt-corpus-docs", type=int, default=5000, help="documents per domain it keeps")
    ap.add_argument("--prompt-corpus-chars", type=int, default=6000, help="characters per document it keeps")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    phases = set(args.phases.split(","))
    unknown = phases - PHASES
    if unknown:
        raise SystemExit(f"train_heads.py: unknown phase(s) {sorted(unknown)}; the phases are "
                         f"{', '.join(sorted(PHASES))}")
    if args.write_prompt_corpus or phases & {"data", "proxy"}:
        wanted = tuple(f"{d}.txt.xz" for d in args.domains.split(",")) if args.write_prompt_corpus or "data" in phases \
            else tuple(f"{f}.txt.xz" for f in PROXY_DOMAINS.values())
        args.corpus = str(find_corpus(args.corpus, wanted))
    if args.write_prompt_corpus:
        kept = write_prompt_corpus(Path(args.corpus), Path(args.write_prompt_corpus), args.prompt_corpus_docs,
                                   args.prompt_corpus_chars, tuple(args.domains.split(",")))
        print("wrote", args.write_prompt_corpus, kept)
        return kept
    args.target = str(resolve_model_dir(args.target))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = Tokenizer(args.target)
    # A run in several calls (phases) keeps every call's command line.
    command = " ".join(sys.argv if argv is None else ["train_heads.py", *argv])
    args.command = command
    report = {"argv": command, "commands": load_report(out).get("commands", []) + [command],
              "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    t0 = time.time()
    data_path = out / "data.json"
    if "data" in phases:
        data = build_data(args, tok)
        data_path.write_text(json.dumps(data, separators=(",", ":")))
        report["data"] = {"sequences": len(data), "response_tokens": sum(len(d["response"]) for d in data),
                          "seconds": round(time.time() - t0, 1)}
        print(report["data"], flush=True)
        save_report(out, report)
    dirs = {"dspark": out / "dspark", "dflash": out / "dflash"}
    if "train" in phases or "dflash" in phases:
        if not data_path.exists():
            raise SystemExit(f"train_heads.py: no {data_path}: run the data phase first (--phases data,train)")
        data = json.loads(data_path.read_text())
        if not data:
            raise SystemExit(f"train_heads.py: {data_path} holds no sequence: run the data phase again")
        target = load_model(args.target, dtype=torch.float32, device=device)
        base = dict(gamma=args.gamma, num_layers=args.layers, intermediate_size=args.intermediate,
                    mask_token_id=tok.tok.token_to_id("<|pad|>") or 0)
        if args.target_layers:
            base["target_layer_ids"] = sorted({int(x) for x in args.target_layers.split(",")})
            if not all(0 <= i < target.config.num_hidden_layers - 1 for i in base["target_layer_ids"]):
                raise SystemExit(f"--target-layers must be in 0..{target.config.num_hidden_layers - 2} "
                                 "(the last layer feeds the logits, not the drafter)")
        if "train" in phases:
            dcfg = DrafterConfig.for_target(target.config, markov_rank=args.markov_rank, **base)
            d, curve = train_drafter(args, target, data, dcfg, LOSS_ALPHA, args.seconds, dirs["dspark"], "dspark")
            report["dspark"] = {"params": sum(p.numel() for p in d.parameters()), "curve": curve,
                                "config": vars(dcfg), "steps": curve[-1]["step"]}
            save_report(out, report)
        # The "dflash" phase trains only the ablation, later, against the DSpark run on record.
        if "dflash" in phases or args.dflash != "off":
            fcfg = DrafterConfig.for_target(target.config, markov_rank=0, confidence=False, **base)
            steps = 0
            if args.dflash != "seconds":
                steps = (report.get("dspark") or load_report(out).get("dspark") or {}).get("steps", 0)
                if not steps:
                    raise SystemExit(f"a step-matched DFlash needs a DSpark run on record in {out}/report.json "
                                     "(or --dflash seconds)")
            d, curve = train_drafter(args, target, data, fcfg, DFLASH_ALPHA, args.dflash_seconds, dirs["dflash"],
                                     "dflash", max_steps=steps)
            report["dflash"] = {"params": sum(p.numel() for p in d.parameters()), "curve": curve,
                                "steps": curve[-1]["step"], "budget": args.dflash}
            save_report(out, report)
        del target
    if "calibrate" in phases:
        report["calibration"] = calibrate(args, dirs["dspark"], tok, out)
        save_report(out, report)
    trained = {k: v for k, v in dirs.items() if (v / "config.json").exists()}
    if "eval" in phases:
        report["tau"] = evaluate(args, trained, tok)
        save_report(out, report)
    if "proxy" in phases:
        report["text_proxy"] = text_proxy(args.target, trained, tok, args.corpus, args.proxy_n, args.proxy_tokens,
                                          args.anchors, args.seed)
    report["seconds"] = round(time.time() - t0, 1)
    merged = save_report(out, report)
    print_summary(merged)
    return merged


def load_report(out: Path) -> dict:
    path = out / "report.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_report(out: Path, report: dict) -> dict:
    """Merge into out/report.json after every phase, so an interrupted run keeps what it finished."""
    path = out / "report.json"
    merged = load_report(out)
    merged.update(report)
    path.write_text(json.dumps(merged, indent=1, default=str))
    return merged


def print_summary(r: dict) -> None:
    if "tau" in r:
        print(f"\n{'workload':8} {'T':>3} {'dspark tau':>10} {'dflash tau':>10} {'ratio':>6}")
        for wl in ("math", "chat", "poetry", "code"):
            for t in ("T=0", "T=1"):
                a = r["tau"].get("dspark", {}).get(wl, {}).get(t, {}).get("tau")
                b = r["tau"].get("dflash", {}).get(wl, {}).get(t, {}).get("tau")
                ratio = f"{a / b:.2f}" if a and b else "-"
                print(f"{wl:8} {t:>3} {a or '-':>10} {b or '-':>10} {ratio:>6}")
    if "text_proxy" in r:
        print(f"\n{'text proxy':11} {'drafter':7} {'tau T=0':>7} {'tau T=1':>7} {'target top-1':>12}")
        for name, per in r["text_proxy"].items():
            for wl, m in (per.items() if name in ("dspark", "dflash") else ()):
                print(f"{wl:11} {name:7} {m['tau_T0']:>7} {m['tau_T1']:>7} {m['target_top1_prob']:>12}")
    if "calibration" in r:
        c = r["calibration"]
        print("STS temperatures", c["temperatures"], "shifts", c.get("shifts"), "mean ECE before",
              round(c["mean_ece_before"], 4), "after", round(c["mean_ece_after"], 4))


if __name__ == "__main__":
    main()
