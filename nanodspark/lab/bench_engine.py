"""Engine benchmarks (run on the GPU; `python -m nanodspark.bench engine|profile|dspark ...`).

`engine`: tokens/s of `LLM.generate` on a Qwen3-0.6B-shaped model with **random weights** at
batch 1 and 64, for each attention backend, as the baseline later work improves on. Medians of
repeats, all backends measured side by side in one run, hardware and versions recorded.

`profile` (the step-cost table of the cost scheduler) lives in `bench_profile.py`.

`dspark`: the economics sweep — no speculation vs static vs compact, per concurrency and
workload, each point warmed up with its own traffic and then run `--repeats` rounds, each running
every engine once in an order that rotates every round (the median run is reported, and compact
/ static as the median of paired per-repeat ratios with their range; `--no-trim` adds a compact
that never trims, `--aa` a second static engine as an A/A control); per-user tok/s is the decode
rate after a request's first token. `dspark-table` prints a saved sweep as the walkthrough's
table (no GPU). `pareto` draws a sweep as a PNG.
"""
from __future__ import annotations

import argparse
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
    from ..config import ModelConfig
    from ..loader import save_model
    from ..model import CausalLM
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = CausalLM(cfg).to(dtype)
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    save_model(model, out, max_shard_bytes=2**31, dtype=dtype)
    return out


def environment(cuda: bool | None = None) -> dict:
    """Versions, the command and the device that ran it: the GPU's name, or the CPU's when there
    is no GPU or the run was asked to stay off it (`cuda=False`)."""
    import platform
    env = {"torch": torch.__version__, "python": platform.python_version(), "argv": " ".join(sys.argv)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available() and cuda is not False:
        env["device"] = torch.cuda.get_device_name()
    else:                                  # a CPU run must say so too: its numbers mean something else
        import os
        env["device"] = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible"
    return env


def time_generate(llm, prompts, params, repeats: int) -> dict:
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


# ----------------------------------------------------------------------------- dspark economics
def run_traffic(llm, prompts, workloads, params) -> dict:
    spec = llm.engine.metrics
    if spec is not None:
        spec.step_times.clear()          # this run's (predicted, measured) step seconds only
    llm.engine.clock.reset()
    t = time.perf_counter()
    reqs = [llm.engine.add_request(p, params, queue_limit=False, stream_text=False) for p in prompts]   # as LLM.generate
    while llm.engine.has_unfinished():
        llm.engine.step()
    wall = time.perf_counter() - t
    engine_steps = llm.engine.clock.steps     # steps launched (the overlapped loop's last call only commits)
    toks = sum(len(r.output_ids) for r in reqs)
    # per-user speed = decode rate after the first token (1 / time per output token): queueing
    # before admission and the prefill are excluded, so c=1 with queued requests is not penalised
    per_user = [(len(r.output_ids) - 1) / max(1e-9, r.finish_time - r.first_token_time) for r in reqs
                if len(r.output_ids) > 1]
    by_wl = {}
    for r, w in zip(reqs, workloads):
        s = by_wl.setdefault(w, {"steps": 0, "verified": 0, "committed": 0, "ceiling": 0, "requests": 0})
        for key in ("steps", "verified", "committed", "ceiling"):
            s[key] += getattr(r.spec, key)
        s["requests"] += 1
    for r in reqs:
        llm.engine.release(r.request_id)
    out = {"wall_s": round(wall, 3), "tokens": toks, "total_tok_s": round(toks / wall, 1),
           "per_user_tok_s": round(statistics.median(per_user), 2), "by_workload": by_wl,
           "engine_steps": engine_steps, "phase_ms": llm.engine.clock.per_step_ms()}
    if spec is not None and spec.step_times:
        # the cost table's prediction next to the measured speculative step (the last 256
        # steps of the run; nan predictions = no table in use); what compact trusts vs reality
        pred = [p for p, _ in spec.step_times if p == p]
        out["step_ms_measured"] = round(1e3 * statistics.median(m for _, m in spec.step_times), 2)
        out["step_ms_predicted"] = round(1e3 * statistics.median(pred), 2) if pred else None
    return out


def bench_prompts(workload: str, n: int, data_dir=None) -> list:
    """n prompts of a workload; a workload with fewer (chat has 80) repeats to fill n."""
    from .workloads import load_workload, workload_size
    size = n if workload == "mix" else min(n, workload_size(workload, data_dir))
    ps = load_workload(workload, n=size, data_dir=data_dir)
    return (ps * (n // max(1, len(ps)) + 1))[:n]


def dspark_bench(args) -> dict:
    from .. import LLM, SamplingParams
    rows, paired = [], []
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
    # All engines stay loaded and their runs are interleaved, so a slow drift of the machine
    # (clocks, host load) hits every mode alike; the order rotates every repeat (A B C, B C A,
    # C A B, ...), so no mode always runs in the same place of a round, after the same other
    # mode. Compact vs static is also reported as paired per-repeat ratios.
    engines = [("no-spec", "none", "static", {}), ("static", None, "static", {}), ("compact", None, "compact", {})]
    if getattr(args, "no_trim", False):
        # compact that never trims (no gain can pass the guard): its plan and nothing else, to
        # tell compact's overhead from the effect of its trimming
        engines.append(("compact-no-trim", None, "compact", {"verify_min_gain": 1e9}))
    if getattr(args, "aa", False):
        # an A/A control: a second, identical static engine. Its paired ratio to static is
        # what the harness reports when there is no difference at all (noise and bias)
        engines.append(("static-b", None, "static", {}))
    llms = {name: LLM(args.model, drafter_path=drafter, verify_mode=mode, cost_table=args.cost_table,
                      max_num_seqs=max(args.concurrency), use_tqdm=False, kv_cache_memory_gb=args.kv_gb,
                      max_num_batched_tokens=8192, enable_prefix_cache=False, **extra)
            for name, drafter, mode, extra in engines} if args.concurrency else {}
    # A bare --concurrency builds no sweep engines: only the mixed traffic below runs.
    tok = llms["static"].tokenizer if llms else None
    for wl in args.workloads if llms else ():
        for c in args.concurrency:
            n = max(c, args.min_requests)
            ps = bench_prompts(wl, n, args.data_dir)
            prompts = [tok.encode(p.render())[-args.prompt_tokens:] for p in ps]
            wls = [p.workload for p in ps]
            for llm in llms.values():
                llm.engine.config.max_num_seqs = c
                # warm-up with the same traffic: Triton compiles a kernel variant per new shape
                # class (tile sizes), which would otherwise land in the first timed run
                run_traffic(llm, prompts, wls, params)
            runs = {name: [] for name in llms}
            names = list(llms)
            for i in range(args.repeats):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    runs[name].append(run_traffic(llms[name], prompts, wls, params))
            for name, rs in runs.items():
                r = sorted(rs, key=lambda x: x["total_tok_s"])[len(rs) // 2]   # the median run
                rows.append({"mode": name, "workload": wl, "concurrency": c, **r,
                             "repeats_total_tok_s": [x["total_tok_s"] for x in rs]})
            ratio = [x["total_tok_s"] / y["total_tok_s"] for x, y in zip(runs["compact"], runs["static"])]
            paired.append({"workload": wl, "concurrency": c, "compact_over_static": round(statistics.median(ratio), 3),
                           "min": round(min(ratio), 3), "max": round(max(ratio), 3)})
            for other, key in (("compact-no-trim", "no_trim"), ("static-b", "aa")):
                if other in runs:
                    q = [x["total_tok_s"] / y["total_tok_s"] for x, y in zip(runs[other], runs["static"])]
                    paired[-1].update({f"{key}_over_static": round(statistics.median(q), 3),
                                       f"{key}_min": round(min(q), 3), f"{key}_max": round(max(q), 3)})
            print(wl, c, {k: rows[-len(runs) + i]["total_tok_s"] for i, k in enumerate(runs)}, paired[-1], flush=True)
            if args.out:  # keep what is measured if the run is cut short
                Path(args.out).write_text(json.dumps({"partial": True, **environment(), "sweep": rows,
                                                      "paired_compact_over_static": paired}))
    del llms
    mixed = mixed_traffic(args, params) if args.mixed_requests else None
    result = {"benchmark": f"dspark economics on {'the pair in ' + args.model if args.model else 'the default pair'}"
                           " (trained weights)", **environment(),
              "model": args.model or "default (nanodspark/assets/default)",
              "temperature": args.temperature, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "sweep": rows, "paired_compact_over_static": paired,
              "mixed_traffic_cap_accept": mixed, "cost_table": args.cost_table}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        if rows:
            try:
                pareto_png(result, str(Path(args.out).with_suffix(".png")))
            except ModuleNotFoundError as e:     # the JSON is the measurement; `bench pareto` draws it later
                print(f"{Path(args.out).with_suffix('.png')} not drawn: {e}")
    print(f"\n{'mode':8} {'workload':8} {'conc':>5} {'total tok/s':>12} {'user tok/s':>11}")
    for r in rows:
        print(f"{r['mode']:8} {r['workload']:8} {r['concurrency']:>5} {r['total_tok_s']:>12} {r['per_user_tok_s']:>11}")
    print(f"\n{'workload':8} {'conc':>5} {'compact/static (median, min-max of paired repeats)':>52}")
    for q in paired:
        extra = "".join(f"  {k}/static {q[k + '_over_static']} ({q[k + '_min']}-{q[k + '_max']})"
                        for k in ("no_trim", "aa") if k + "_over_static" in q)
        print(f"{q['workload']:8} {q['concurrency']:>5} {q['compact_over_static']:>8} ({q['min']}-{q['max']}){extra}")
    if mixed:
        print(f"\n{'workload':8} {'window':>7} {'tau':>6} {'ceiling':>8} {'util':>6}")
        for w, m in mixed["by_workload"].items():
            print(f"{w:8} {m['mean_window']:>7} {m['tau']:>6} {m['ceiling_tau']:>8} {m['utilisation']:>6}")
    return result


def mixed_traffic(args, params) -> dict:
    """Mixed workloads in one batch under cap-accept: the mean window and tau of each workload,
    and utilisation = committed / what full-block verify would have committed (the ceiling)."""
    from .. import LLM
    from .workloads import load_workload
    llm = LLM(args.model, verify_mode="cap-accept", cost_table=args.cost_table, enable_prefix_cache=False,
              max_num_seqs=args.mixed_concurrency, use_tqdm=False, kv_cache_memory_gb=args.kv_gb)
    tok = llm.tokenizer
    ps = load_workload("mix", n=args.mixed_requests, data_dir=args.data_dir)
    r = run_traffic(llm, [tok.encode(p.render())[-args.prompt_tokens:] for p in ps], [p.workload for p in ps], params)
    by = {w: {"mean_window": round(s["verified"] / max(1, s["steps"]), 3),
              "tau": round(s["committed"] / max(1, s["steps"]), 3),
              "ceiling_tau": round(s["ceiling"] / max(1, s["steps"]), 3),
              "utilisation": round(s["committed"] / max(1, s["ceiling"]), 3), "requests": s["requests"]}
          for w, s in r["by_workload"].items()}
    return {"concurrency": args.mixed_concurrency, "by_workload": by,
            "block_accept_estimator": llm.engine.metrics.summary()["ceiling"]}


def _non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def add_dspark_args(p) -> None:
    p.add_argument("--model", default=None,
                   help="target checkpoint directory with its drafter/; none: the shipped default pair")
    p.add_argument("--cost-table", default=None,
                   help="a `bench profile` table for the compact mode; none: compact keeps full blocks")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64, 128, 256],
                   help="the sweep's concurrencies; none (a bare --concurrency) runs only the mixed traffic")
    p.add_argument("--workloads", nargs="+", default=["mix", "math", "chat", "poetry", "code"],
                   help="workloads of the sweep (mix: the four, round-robin)")
    p.add_argument("--min-requests", type=int, default=16,
                   help="at least this many requests per point (more when the concurrency is larger)")
    p.add_argument("--repeats", type=int, default=3, help="runs per point; the median run is reported")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompts are cut to their last N tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--aa", action="store_true",
                   help="add an A/A control: a second static engine, reported as its paired ratio to static")
    p.add_argument("--no-trim", action="store_true",
                   help="also run compact with a guard no gain can pass (its overhead alone), paired with static")
    p.add_argument("--mixed-concurrency", type=int, default=64, help="concurrency of the mixed-traffic table")
    p.add_argument("--mixed-requests", type=_non_negative, default=128,
                   help="requests of the mixed-traffic table (0: no mixed traffic, only the sweep)")
    p.add_argument("--data-dir", default=None,
                   help="workload data; none: $NANODSPARK_DATA, else ../shared/data, else .carry/data")
    p.add_argument("--kv-gb", type=float, default=4.0, help="KV cache memory per engine (GB)")
    p.add_argument("--out", default="", help="JSON file for every row; X.json also writes X.png (none: print only)")


# ----------------------------------------------------------------------------- Pareto plot
def pareto_png(result: dict, path: str, workload: str = "mix", drawn_by: str | None = None):
    """The Pareto plot and the concurrency curve of a `dspark` result (`plots.pareto`), captioned
    with the command that measured it (and the one that drew it, when not the same)."""
    from . import plots
    caption = plots.command_caption(result) + (f"\ndrawn by: {drawn_by}" if drawn_by else "")
    return plots.pareto(result, path, caption=caption, workload=workload)


def point_summary(row: dict) -> dict:
    """Drafts verified per request-step, τ and ms per engine step of one sweep row. Rows written
    before `engine_steps` was recorded estimate the engine steps as request-steps / concurrency
    (exact while every slot is busy; prefill steps are included either way)."""
    s = {k: sum(v[k] for v in row["by_workload"].values()) for k in ("steps", "verified", "committed")}
    steps = row.get("engine_steps") or s["steps"] / max(1, row["concurrency"])
    return {"window": s["verified"] / s["steps"] if s["steps"] else 0.0,
            "tau": s["committed"] / s["steps"] if s["steps"] else 0.0,
            "ms_per_step": 1e3 * row["wall_s"] / steps if steps else None,
            "ms_per_step_estimated": "engine_steps" not in row}


def dspark_markdown(result: dict) -> str:
    """The walkthrough's table of a `bench dspark` JSON: one column per (workload, concurrency)."""
    by = {(r["workload"], r["concurrency"], r["mode"]): r for r in result["sweep"]}
    paired = {(q["workload"], q["concurrency"]): q for q in result.get("paired_compact_over_static", [])}
    points = sorted({(w, c) for w, c, _ in by}, key=lambda wc: (wc[0] != "mix", wc[0], wc[1]))
    modes = [m for m in ("no-spec", "static", "compact", "compact-no-trim", "static-b") if any(k[2] == m for k in by)]
    cell = lambda w, c, m: by.get((w, c, m))  # noqa: E731
    lines = ["| workload, concurrency | " + " | ".join(f"{w}, {c}" for w, c in points) + " |",
             "|---|" + "---|" * len(points)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(w, c) for w, c in points) + " |")
    for m in modes:
        row(f"{m}, total tok/s", lambda w, c, m=m: f"{cell(w, c, m)['total_tok_s']:,.0f}" if cell(w, c, m) else "-")
    for a, b in (("static", "no-spec"), ("compact", "static")):
        if a in modes and b in modes:
            row(f"{a} / {b}", lambda w, c, a=a, b=b: f"{cell(w, c, a)['total_tok_s'] / cell(w, c, b)['total_tok_s']:.2f}")
    if paired:
        row("compact / static, paired (range)", lambda w, c: (
            f"{paired[(w, c)]['compact_over_static']:.2f} ({paired[(w, c)]['min']:.2f}-{paired[(w, c)]['max']:.2f})"
            if (w, c) in paired else "-"))
    for key, label in (("no_trim", "compact-no-trim / static"), ("aa", "static-b / static (A/A control)")):
        if any(f"{key}_over_static" in q for q in paired.values()):
            row(f"{label}, paired (range)", lambda w, c, key=key: (
                f"{paired[(w, c)][key + '_over_static']:.2f} ({paired[(w, c)][key + '_min']:.2f}-"
                f"{paired[(w, c)][key + '_max']:.2f})" if f"{key}_over_static" in paired.get((w, c), {}) else "-"))
    spec = [m for m in modes if m != "no-spec"]
    sums = {(w, c, m): point_summary(cell(w, c, m)) for w, c in points for m in spec if cell(w, c, m)}
    for key, label, fmt in (("window", "drafts verified per request", ".2f"), ("tau", "τ", ".2f"),
                            ("ms_per_step", "ms per engine step", ".1f")):
        row(f"{label}: {' / '.join(spec)}", lambda w, c, key=key, fmt=fmt: " / ".join(
            format(sums[(w, c, m)][key], fmt) for m in spec if (w, c, m) in sums))
    row(f"per-user tok/s: {' / '.join(modes)}", lambda w, c: " / ".join(
        f"{cell(w, c, m)['per_user_tok_s']:.0f}" for m in modes if cell(w, c, m)))
    if any(v["ms_per_step_estimated"] for v in sums.values()):
        lines.append("\n(ms per engine step estimated as wall time / (request-steps / concurrency): "
                     "this JSON predates the `engine_steps` field)")
    return "\n".join(lines)


PHASES = ("schedule", "launch", "result", "commit")   # the phases of `LLMEngine.step`


def phase_markdown(result: dict) -> str:
    """Host ms per engine step by phase (`LLMEngine.clock`), one row per (point, mode): where a
    mode's step time goes. Empty for JSON written before `phase_ms` was recorded."""
    rows = [r for r in result["sweep"] if r.get("phase_ms")]
    if not rows:
        return ""
    lines = ["| workload, conc, mode | " + " | ".join(PHASES) + " | sum | wall / step |",
             "|---|" + "---:|" * (len(PHASES) + 2)]
    for r in sorted(rows, key=lambda r: (r["workload"] != "mix", r["workload"], r["concurrency"])):
        ph = r["phase_ms"]
        lines.append(f"| {r['workload']}, {r['concurrency']}, {r['mode']} | " +
                     " | ".join(f"{ph.get(p, 0.0):.2f}" for p in PHASES) +
                     f" | {sum(ph.values()):.1f} | {1e3 * r['wall_s'] / max(1, r['engine_steps']):.1f} |")
    return "\n".join(lines)


def dspark_table(args) -> dict:
    result = json.loads(Path(args.input).read_text())
    print(dspark_markdown(result))
    phases = phase_markdown(result)
    if phases:
        print("\nHost ms per engine step by phase ('result' is the host waiting for the device; with the "
              "overlapped loop the next step is already queued then):\n\n" + phases)
    return result


def add_dspark_table_args(p) -> None:
    p.add_argument("input", help="JSON written by `bench dspark`")


def pareto(args) -> dict:
    result = json.loads(Path(args.input).read_text())
    try:
        pareto_png(result, args.out, workload=args.workload,
                   drawn_by=f"python -m nanodspark.bench pareto {args.input} --out {args.out}")
    except ModuleNotFoundError as e:
        raise SystemExit(str(e)) from None
    print(f"wrote {args.out}")
    return result


def add_pareto_args(p) -> None:
    p.add_argument("input", help="JSON written by `bench dspark`")
    p.add_argument("--out", default="dspark_pareto.png", help="the PNG to write")
    p.add_argument("--workload", default="mix", help="the sweep's workload to draw (its first if absent)")
