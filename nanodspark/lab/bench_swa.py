"""SWA replay and snapshots, measured: `python -m nanodspark.bench swa [--quick | --smoke]`.

Two tables in one run (walkthrough chapter 13; the mechanism is nanodspark/swa_replay.py).

`prefill`: multi-turn follow-ups on long shared prefixes. A conversation is a prefix of P random
token ids, answered with `--answer-tokens` greedy tokens (turn 1), then a follow-up = prefix +
answer + `--new-tokens` new ids. For each mode a fresh engine runs, per prefix length, one
untimed warm-up conversation and `--repeats` timed ones (each on a prefix of its own), and
records for the follow-up: its prompt length, the rows its prefill computed (every layer runs
them: the sliding layers' prefill work), the rows of those that were SWA replay, whether it
found a snapshot, and the time to first token (request added to first token committed, the only
request in the engine; medians over repeats). Modes:

    no-cache   enable_prefix_cache=False: the whole prompt again
    exact      prefix cache on the full layers + exact replay, N * (W - 1) tokens
    bounded    + bounded replay of `--keep` tokens (140: 128 + DeepInfer's look-back)
    snapshot   + snapshots (the bounded replay when none is found)

Models: the default target (trained weights; max_position_embeddings 4096, so prefixes up to
2k) and a hybrid Qwen3 shape with **random weights** (`--shape 0.6b`: Qwen3-0.6B's dimensions,
28 layers, the upper 14 sliding with a 128-token window, 40960 positions; `small`: the default
target's dimensions, 3 + 3 layers, for a CPU) for 2k, 8k and 32k; the JSON says which weights
are random (`random_weights`). Both without a drafter: a follow-up's first token is one eager
prefill (CUDA graphs, tier batch 1 only, replay turn 1's answer; `--no-graphs` turns them off).

`drift`: the price of the bounded approximation on real multi-turn text, with the default pair
(target + drafter). MT-bench first turns are answered (greedy, `--drift-answer` tokens at most,
stopping at the end of turn); the follow-up = turn 1 + answer + the second user turn, then
`--drift-cont` greedy tokens. Against exact replay, for each bounded length (`auto` is the rule
of swa_replay.py: 140 with the overlapped loop, 134 with the synchronous one): the next-token KL
at the follow-up's first position, KL(exact || bounded); top-1 agreement there; greedy
agreement of the continuation (identical continuations, and the matching prefix as a share of
exact's); tau (tokens per verify step) of the follow-ups. A `snapshot` row checks that a
snapshot hit costs nothing in accuracy. A follow-up whose prefix hit is no longer than the
bounded length replays everything from 0 and is exact, and so is one whose new part is long
enough that the sampled position lies `N * (W - 1)` or more past the replay start (the error of a
truncated window dies out after `N - 1` windows): `affected` counts the others.

The JSON (`--out`) holds every row, the hardware, the versions and the exact command (`argv`).
The full run is sized for about 3-4 minutes on one H200 (`--budget-s 240` skips the rows that
would start later, and lists them under `skipped`). `--quick` (< 90 s on an H200): one repeat,
shorter answers, 16 conversations. `--smoke`: tiny random models on the CPU, < 30 s (a check of
this script, not a measurement; tests/test_bench.py runs it).
"""
from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .bench_engine import QWEN3_0_6B, environment, random_checkpoint

MODES = ("no-cache", "exact", "bounded", "snapshot")
HYBRID_0_6B = {**QWEN3_0_6B, "layer_types": ["full_attention"] * 14 + ["sliding_attention"] * 14,
               "sliding_window": 128, "use_sliding_window": True, "max_window_layers": 14}
SMALL_HYBRID = {**HYBRID_0_6B, "vocab_size": 8192, "hidden_size": 384, "intermediate_size": 768, "num_hidden_layers": 6,
                "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
                "layer_types": ["full_attention"] * 3 + ["sliding_attention"] * 3, "max_window_layers": 3}
TINY_HYBRID = {**QWEN3_0_6B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "max_position_embeddings": 2048, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2,
               "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_memory() -> None:
    """After `del llm`: free its KV cache before the next engine allocates its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Budget:
    def __init__(self, seconds: float):
        self.end, self.skipped = time.perf_counter() + seconds, []

    def over(self, what: str) -> bool:
        if time.perf_counter() > self.end:
            self.skipped.append(what)
            return True
        return False


def graph_kwargs(args) -> dict:
    """CUDA graphs for the decode steps of requests running alone (tier: 1 slot), which is what
    every timed or compared request here is; batches run eagerly. A prefill is eager anyway.
    `--smoke` runs on the CPU wherever it is (a check of the script, the same numbers anywhere)."""
    if args.smoke:
        return dict(device="cpu")
    return dict(cuda_graphs=False) if args.no_graphs else dict(cuda_graphs=True, graph_batch_sizes=(1,))


# ---- prefill: tokens and time to first token of a follow-up ----------------------------------
def mode_kwargs(mode: str, keep: int | str) -> dict:
    return {"no-cache": dict(enable_prefix_cache=False), "exact": dict(swa_replay_tokens=0),
            "bounded": dict(swa_replay_tokens=keep),
            "snapshot": dict(swa_replay_tokens=keep, swa_snapshots=16)}[mode]


def follow_up(llm, prefix: list[int], args, gen: torch.Generator, vocab: int, turn1: bool) -> dict:
    """Turn 1 (unless the engine has no prefix cache: then nothing could be reused anyway and
    random ids of the same length stand for the answer), then the timed follow-up."""
    from .. import SamplingParams
    eng = llm.engine
    if turn1:
        answer = llm.generate([prefix], SamplingParams(temperature=0, max_tokens=args.answer_tokens,
                                                       ignore_eos=True), use_tqdm=False)[0].token_ids
    else:
        answer = torch.randint(4, vocab, (args.answer_tokens,), generator=gen).tolist()
    ids = prefix + answer + torch.randint(4, vocab, (args.new_tokens,), generator=gen).tolist()
    hits = eng.scheduler.snapshots.stats["hits"]
    _sync()
    req = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1), queue_limit=False)
    while eng.has_unfinished():
        eng.step()
    _sync()
    eng.release(req.request_id)
    return {"prompt_tokens": len(ids), "prefilled": len(ids) - req.admitted_at,
            "replayed": req.replay_until - req.admitted_at, "snapshot": eng.scheduler.snapshots.stats["hits"] > hits,
            "ttft_ms": 1e3 * (req.first_token_time - req.arrival)}


def prefill_table(args, budget: Budget) -> dict:
    from .. import LLM
    tmp = tempfile.TemporaryDirectory()
    models = []
    if args.default_target_prefixes:
        models.append(("default target", None, args.default_target_prefixes, False))
    shape = {"0.6b": HYBRID_0_6B, "small": SMALL_HYBRID, "tiny": TINY_HYBRID}[args.shape]
    if args.prefixes:
        path = str(random_checkpoint(shape, Path(tmp.name) / "hybrid"))
        models.append((f"hybrid Qwen3 {args.shape} shape, RANDOM weights", path, args.prefixes, True))
    rows, info = [], []
    for name, path, prefixes, random_weights in models:
        for mode in MODES:
            if budget.over(f"prefill {name} {mode}"):
                continue
            kw = dict(use_tqdm=False, drafter_path="none", max_num_seqs=4, max_num_batched_tokens=args.chunk,
                      **graph_kwargs(args), **mode_kwargs(mode, args.keep))
            if args.kv_gb:
                kw["kv_cache_memory_gb"] = args.kv_gb
            llm = LLM(path, **kw)
            mc, sched = llm.engine.model_config, llm.engine.scheduler
            if mode == "exact":
                info.append({"model": name, "random_weights": random_weights,
                             "layers": mc.num_hidden_layers, "sliding_layers": sched.n_sliding,
                             "window": mc.sliding_window, "hidden": mc.hidden_size,
                             "exact_replay_tokens": sched.replay_keep})
            gen = torch.Generator().manual_seed(0)
            vocab = mc.vocab_size
            follow_up(llm, torch.randint(4, vocab, (prefixes[0],), generator=gen).tolist(), args, gen, vocab,
                      mode != "no-cache")                                     # warm-up, untimed
            for p in prefixes:
                if budget.over(f"prefill {name} {mode} {p}"):
                    continue
                reps = []
                for r in range(args.repeats):
                    g = torch.Generator().manual_seed(1000 * p + r + 1)
                    prefix = torch.randint(4, vocab, (p,), generator=g).tolist()
                    reps.append(follow_up(llm, prefix, args, g, vocab, mode != "no-cache"))
                row = {"model": name, "random_weights": random_weights, "mode": mode, "prefix": p,
                       "replay_keep": sched.replay_keep,
                       **{k: reps[0][k] for k in ("prompt_tokens", "prefilled", "replayed")},
                       "snapshot_hits": sum(x["snapshot"] for x in reps), "repeats": len(reps),
                       "ttft_ms": round(statistics.median(x["ttft_ms"] for x in reps), 2),
                       "ttft_ms_all": [round(x["ttft_ms"], 2) for x in reps]}
                rows.append(row)
                print(row, flush=True)
            del llm
            _free_memory()
    tmp.cleanup()
    base = {(r["model"], r["prefix"]): r["prefilled"] for r in rows if r["mode"] == "no-cache"}
    for r in rows:
        if (r["model"], r["prefix"]) in base:
            r["prefill_cut"] = round(1 - r["prefilled"] / base[(r["model"], r["prefix"])], 4)
    return {"models": info, "rows": rows}


# ---- drift: the bounded replay against exact on MT-bench second turns -----------------------
def _turn2_tail(answer: list[int], end_id: int | None, turn2: str) -> str:
    from .workloads import ASSISTANT_HEADER
    close = "" if answer and answer[-1] == end_id else "<|im_end|>"
    return f"{close}\n<|im_start|>user\n{turn2}<|im_end|>\n{ASSISTANT_HEADER}"


def run_with_first_logits(llm, ids: list[int], params):
    """Run one request alone; return it and the logits of its first sampled position."""
    eng, seen = llm.engine, []
    orig = eng.model.compute_logits

    def spy(hidden, ops=None):
        out = orig(hidden, ops)
        if not seen:
            seen.append(out[-1].float().cpu())
        return out
    eng.model.compute_logits = spy
    try:
        req = eng.add_request(ids, params, queue_limit=False)
        while eng.has_unfinished():
            eng.step()
    finally:
        del eng.model.compute_logits
    eng.release(req.request_id)
    return req, seen[0]


def drift_runs(target: str | None, convs, settings: list[tuple[str, dict]], answer_tokens: int, cont_tokens: int,
               budget: Budget | None = None, engine_kw: dict | None = None) -> list[dict]:
    """For each (name, engine options): turn 1 of every conversation (one batch), then each
    follow-up alone. Returns per setting: the resolved replay length and per conversation the
    first-position logits, the continuation, the prefix hit and the speculative counters."""
    from .. import LLM, SamplingParams
    from ..swa_replay import exact_replay_tokens
    out = []
    for name, kw in settings:
        if budget is not None and budget.over(f"drift {name}"):
            continue
        llm = LLM(target, **{"use_tqdm": False, "max_num_seqs": max(1, len(convs)), **(engine_kw or {}), **kw})
        tok = llm.tokenizer
        end_id = tok.tok.token_to_id("<|im_end|>")
        t1 = [tok.encode(c.render()) for c in convs]
        answers = [o.token_ids for o in llm.generate(t1, SamplingParams(temperature=0, max_tokens=answer_tokens),
                                                     use_tqdm=False)]
        per = []
        for c, ids, a in zip(convs, t1, answers):
            ids2 = ids + a + tok.encode(_turn2_tail(a, end_id, c.meta["second_turn"]))
            req, logits = run_with_first_logits(llm, ids2, SamplingParams(temperature=0, max_tokens=cont_tokens))
            per.append({"id": c.id, "answer": a, "prompt_tokens": len(ids2), "hit": req.replay_until,
                        "admitted_at": req.admitted_at, "replayed": req.replay_until - req.admitted_at, "logits": logits,
                        "continuation": req.output_ids, "steps": req.spec.steps, "committed": req.spec.committed})
        sched = llm.engine.scheduler
        out.append({"name": name, "replay_keep": sched.replay_keep,
                    "exact_tokens": exact_replay_tokens(sched.window, sched.n_sliding),
                    "snapshot_hits": llm.engine.scheduler.snapshots.stats["hits"], "gamma": llm.engine.gamma,
                    "conversations": per})
        del llm
        _free_memory()
    return out


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return max(0.0, float((lp.exp() * (lp - lq)).sum()))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def drift_summary(runs: list[dict]) -> list[dict]:
    """Each setting against the first (exact replay)."""
    ref = runs[0]
    rows = []
    for run in runs:
        pairs = [(e, b) for e, b in zip(ref["conversations"], run["conversations"]) if e["answer"] == b["answer"]]
        kls = [_kl(e["logits"], b["logits"]) for e, b in pairs]
        share = [_common_prefix(e["continuation"], b["continuation"]) / max(1, len(e["continuation"]))
                 for e, b in pairs]
        steps, committed = sum(b["steps"] for _, b in pairs), sum(b["committed"] for _, b in pairs)
        # a replay that started inside the prefix and less than N*(W-1) before the sampled
        # position: the first token (and the next ones) read approximate sliding KV
        affected = [b["admitted_at"] > 0 and b["replayed"] > 0
                    and b["prompt_tokens"] - b["admitted_at"] < run["exact_tokens"] for _, b in pairs]
        rows.append({
            "setting": run["name"], "replay_keep": run["replay_keep"], "conversations": len(pairs),
            "turn1_differs": len(run["conversations"]) - len(pairs),
            "affected": sum(affected), "mean_prompt_tokens": round(statistics.mean(b["prompt_tokens"] for _, b in pairs), 1),
            "mean_replayed": round(statistics.mean(b["replayed"] for _, b in pairs), 1),
            "snapshot_hits": run["snapshot_hits"],
            "kl_mean": statistics.mean(kls), "kl_median": statistics.median(kls), "kl_max": max(kls),
            "top1_agree": round(statistics.mean(int(e["logits"].argmax() == b["logits"].argmax()) for e, b in pairs), 4),
            "continuation_identical": round(statistics.mean(int(e["continuation"] == b["continuation"]) for e, b in pairs), 4),
            "continuation_prefix_share": round(statistics.mean(share), 4),
            "tau": round(committed / steps, 4) if steps else None,
        })
    return rows


def drift_table(args, budget: Budget) -> dict:
    from .workloads import load_workload
    convs = load_workload("chat", n=args.drift_n, data_dir=args.data_dir)
    settings = [("exact", dict(swa_replay_tokens=0))]
    settings += [(f"bounded {k}", dict(swa_replay_tokens=k if k == "auto" else int(k))) for k in args.drift_keeps]
    # (a TTL longer than the run: every follow-up comes after all of turn 1, which is not what is measured)
    settings.append(("snapshot", dict(swa_replay_tokens=0, swa_snapshots=len(convs), swa_snapshot_ttl_s=1e6)))
    kw = graph_kwargs(args)
    if args.kv_gb:
        kw["kv_cache_memory_gb"] = args.kv_gb
    runs = drift_runs(args.drift_model, convs, settings, args.drift_answer, args.drift_cont, budget, kw)
    rows = drift_summary(runs) if runs else []
    for r in rows:
        print(r, flush=True)
    return {"target": args.drift_model or "default pair (nanodspark/assets/default + its drafter)",
            "random_weights": False if args.drift_model is None else "unknown (a given checkpoint)",
            "gamma": runs[0]["gamma"] if runs else None, "rows": rows}


# ---- the command ----------------------------------------------------------------------------
def markdown(result: dict) -> str:
    lines = []
    pre = result.get("prefill", {})
    if pre.get("rows"):
        lines += ["| model | prefix | mode | follow-up tokens | prefilled | replayed | cut vs no cache | snapshot | TTFT ms |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in pre["rows"]:
            mode = r["mode"] + (f" ({r['replay_keep']})" if r["mode"] in ("exact", "bounded") else "")
            lines.append(f"| {r['model']} | {r['prefix']} | {mode} | {r['prompt_tokens']} | {r['prefilled']} | "
                         f"{r['replayed']} | {100 * r.get('prefill_cut', 0):.1f}% | {r['snapshot_hits']}/{r['repeats']} | "
                         f"{r['ttft_ms']:.1f} |")
    dr = result.get("drift", {})
    if dr.get("rows"):
        lines += ["", "| setting | keep | affected | next-token KL mean / median / max | top-1 agree | continuation identical | matching prefix | tau |",
                  "|---|---:|---:|---|---:|---:|---:|---:|"]
        for r in dr["rows"]:
            lines.append(f"| {r['setting']} | {r['replay_keep']} | {r['affected']}/{r['conversations']} | "
                         f"{r['kl_mean']:.2e} / {r['kl_median']:.2e} / {r['kl_max']:.2e} | {100 * r['top1_agree']:.1f}% | "
                         f"{100 * r['continuation_identical']:.1f}% | {100 * r['continuation_prefix_share']:.1f}% | "
                         f"{r['tau']} |")
    return "\n".join(lines)


def swa_bench(args) -> dict:
    from ..swa_replay import bounded_suffix, look_back
    if args.quick:
        args.repeats, args.answer_tokens = 1, 16
        args.drift_n, args.drift_answer, args.drift_cont = 16, 160, 32
        args.budget_s = min(args.budget_s, 80.0)
    if args.smoke:
        args.shape, args.keep = "tiny", "auto"
        args.prefixes, args.default_target_prefixes = args.prefixes or [64, 160], args.default_target_prefixes or []
        args.repeats, args.answer_tokens, args.new_tokens = 1, 4, 8
        args.drift_n, args.drift_answer, args.drift_cont = min(args.drift_n, 2), 24, 8
        args.kv_gb = args.kv_gb or 0.05
    if not args.kv_gb and torch.cuda.is_available() and not args.smoke:
        args.kv_gb = 16.0      # every engine the same cache (the default takes 40% of free memory)
    if args.prefixes is None:
        args.prefixes = [2048, 8192, 32768]
    if args.default_target_prefixes is None:
        args.default_target_prefixes = [2048]
    budget = Budget(args.budget_s)
    t0 = time.perf_counter()
    result = {"benchmark": "SWA replay and snapshots (swa_replay.py)", **environment(),
              "dtype": "bfloat16" if torch.cuda.is_available() and not args.smoke else "float32",
              "suffix_rule": {"deepinfer": bounded_suffix(128, look_back(5, 2)),
                              "default_pair_overlapped": bounded_suffix(128, look_back(5, 2)),
                              "default_pair_synchronous": bounded_suffix(128, look_back(5, 1))},
              "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    if "prefill" in args.parts:
        result["prefill"] = prefill_table(args, budget)
    if "drift" in args.parts:
        result["drift"] = drift_table(args, budget)
    result["random_weights"] = sorted({r["model"] for r in result.get("prefill", {}).get("rows", [])
                                       if r["random_weights"]})      # the rest: trained weights
    result["skipped"] = budget.skipped
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return result


def add_swa_args(p) -> None:
    p.add_argument("--parts", nargs="+", choices=("prefill", "drift"), default=["prefill", "drift"],
                   help="prefill: follow-up prefill and TTFT; drift: the bounded replay against exact")
    p.add_argument("--prefixes", type=int, nargs="*", default=None,
                   help="shared prefix lengths on the random hybrid shape (default 2048 8192 32768)")
    p.add_argument("--shape", choices=("0.6b", "small", "tiny"), default="0.6b",
                   help="the random hybrid shape: Qwen3-0.6B dimensions (28 layers, 14 sliding), the default "
                        "target's dimensions (6 layers, 3 sliding; for a CPU), or tiny (--smoke); window 128 "
                        "but tiny's 16, 40960 positions but tiny's 2048")
    p.add_argument("--default-target-prefixes", type=int, nargs="*", default=None,
                   help="prefix lengths on the default target (default 2048; its context is 4096)")
    p.add_argument("--answer-tokens", type=int, default=32, help="turn-1 answer length (prefill table)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens of the follow-up (prefill table)")
    p.add_argument("--keep", default=140, type=lambda s: s if s == "auto" else int(s),
                   help="the bounded replay's length in the prefill table")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per row; medians reported")
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the prefill chunk)")
    p.add_argument("--drift-model", default=None,
                   help="target (+ drafter/) of the drift table; default: the default pair")
    p.add_argument("--drift-n", type=int, default=80, help="MT-bench conversations (80 = all)")
    p.add_argument("--drift-answer", type=int, default=256, help="most tokens of a turn-1 answer")
    p.add_argument("--drift-cont", type=int, default=96, help="greedy tokens after the second turn")
    p.add_argument("--drift-keeps", nargs="+", default=["128", "auto", "256"],
                   help="bounded replay lengths compared with exact ('auto' = the suffix rule)")
    p.add_argument("--data-dir", default=None,
                   help="workload data; none: $NANODSPARK_DATA, else ../shared/data, else .carry/data")
    p.add_argument("--kv-gb", type=float, default=0.0,
                   help="KV cache memory (0 = 16 GB on CUDA, the engine's default on a CPU)")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip rows that would start after this")
    p.add_argument("--no-graphs", action="store_true", help="no CUDA graphs (every decode step eager)")
    p.add_argument("--quick", action="store_true",
                   help="one repeat, short answers, 16 conversations (< 90 s on an H200)")
    p.add_argument("--smoke", action="store_true", help="tiny random shapes on the CPU (checks the script)")
    p.add_argument("--out", default="", help="JSON file for every row (none: print only)")
