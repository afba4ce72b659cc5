"""What reproducible sampling costs (`python -m nanodspark.bench sampling`; issue 26, chapter 15).

Three engines of the default pair (target + drafter), loaded side by side in one process, all
with speculation, CUDA graphs and the overlapped loop (the defaults), sampling at T = 1 with a
seed per request and end-of-sequence ignored:

* `rejection`: rejection-sampling verification (the default; output follows the target's
  distribution, but which token comes out depends on the draft);
* `coupled`: coupled sampling (`coupled_sampling=True`; the same tokens with speculation on or
  off), library kernels;
* `coupled-bi`: coupled sampling with `batch_invariant=True` (the same tokens in any batch).

Part 1, per workload (math, chat, poetry, code; `--workload-batch` prompts at once): tau
(tokens committed per verify step; `accepted_per_step` = tau - 1) and tok/s of `rejection`
and `coupled`. Part 2, per batch (1, 64, 256 prompts of the mix): tok/s of all three engines,
the cost of batch invariance (coupled-bi against coupled) and of reproducibility (coupled-bi
against the faster of the two non-reproducible engines), and whether request 0 came out the
same at every batch size. Every point is `--repeats` runs, the engines' order rotating each
repeat; the medians are reported with every run. The JSON holds argv, versions and the
device; a short table is printed last. About 4 minutes on one H200 with the defaults.

On a CPU (`--smoke` with a tiny checkpoint in the tests) the same code runs a few tokens: a
check of this script, not a measurement.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from .bench_engine import bench_prompts, environment

ENGINES = {"rejection": dict(coupled_sampling=False, batch_invariant=False),
           "coupled": dict(coupled_sampling=True, batch_invariant=False),
           "coupled-bi": dict(coupled_sampling=True, batch_invariant=True)}
WORKLOAD_ENGINES = ("rejection", "coupled")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_once(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """One timed generate of `prompts` (seeded T = 1, request i seed i): tok/s, tau, tokens."""
    from .. import SamplingParams
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    _sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    wall = time.perf_counter() - t
    steps = sum(o.spec.get("steps", 0) for o in outs)
    committed = sum(o.spec.get("committed", 0) for o in outs)
    n = sum(len(o.token_ids) for o in outs)
    return {"seconds": wall, "tok_s": n / wall, "tau": committed / steps if steps else 0.0,
            "first_tokens": outs[0].token_ids}


def _median_point(runs: list[dict]) -> dict:
    return {"tok_s": round(statistics.median(r["tok_s"] for r in runs), 1),
            "tok_s_all": [round(r["tok_s"], 1) for r in runs],
            "tau": round(statistics.median(r["tau"] for r in runs), 3),
            "accepted_per_step": round(statistics.median(r["tau"] for r in runs) - 1, 3)}


def measure(engines: dict, names, prompts, max_tokens: int, repeats: int) -> dict:
    """{name: median point}, the engines run in an order that rotates every repeat."""
    runs = {n: [] for n in names}
    for rep in range(repeats):
        order = list(names)[rep % len(names):] + list(names)[:rep % len(names)]
        for n in order:
            runs[n].append(run_once(engines[n], prompts, max_tokens))
    out = {}
    for n in names:
        out[n] = _median_point(runs[n])
        firsts = {tuple(r["first_tokens"]) for r in runs[n]}
        out[n]["request0_tokens"] = list(next(iter(firsts)))
        out[n]["request0_same_every_repeat"] = len(firsts) == 1
    return out


def _tokens(llm, items, limit: int) -> list[list[int]]:
    return [llm.tokenizer.encode(p.render())[-limit:] for p in items]


def sampling_bench(args) -> dict:
    from .. import LLM
    t_start = time.perf_counter()
    engines, startup = {}, {}
    for name, kw in ENGINES.items():
        t0 = time.perf_counter()
        engines[name] = LLM(args.model, max_num_seqs=max(max(args.batches), args.workload_batch),
                            kv_cache_memory_gb=args.kv_gb, use_tqdm=False, **kw)
        startup[name] = round(time.perf_counter() - t0, 2)
    tok = engines["rejection"]
    warm = _tokens(tok, bench_prompts("mix", 4, args.data_dir), args.prompt_tokens)
    for llm in engines.values():                  # compiles and settles every engine before timing
        run_once(llm, warm, min(16, args.max_tokens))

    workloads = []
    for w in args.workloads:
        ps = _tokens(tok, bench_prompts(w, args.workload_batch, args.data_dir), args.prompt_tokens)
        pts = measure(engines, WORKLOAD_ENGINES, ps, args.max_tokens, args.repeats)
        row = {"workload": w, "batch": len(ps), **{n: {k: v for k, v in p.items() if k != "request0_tokens"}
                                                   for n, p in pts.items()}}
        row["coupled_over_rejection_tok_s"] = round(pts["coupled"]["tok_s"] / pts["rejection"]["tok_s"], 3)
        workloads.append(row)
        print(row, flush=True)

    batches, first = [], {}
    for b in args.batches:
        ps = _tokens(tok, bench_prompts("mix", b, args.data_dir), args.prompt_tokens)
        pts = measure(engines, list(ENGINES), ps, args.max_tokens, args.repeats)
        for n, p in pts.items():                   # request 0 has the same prompt and seed at every batch
            first.setdefault(n, p["request0_tokens"])
            p["request0_same_as_first_batch"] = p.pop("request0_tokens") == first[n]
        fastest = max(pts["rejection"]["tok_s"], pts["coupled"]["tok_s"])
        row = {"batch": b, **pts,
               "bi_over_coupled_tok_s": round(pts["coupled-bi"]["tok_s"] / pts["coupled"]["tok_s"], 3),
               "reproducible_over_fastest_tok_s": round(pts["coupled-bi"]["tok_s"] / fastest, 3)}
        batches.append(row)
        print(row, flush=True)

    result = {"benchmark": "reproducible sampling: coupled vs rejection verification, batch invariance",
              "model": args.model or "default (nanodspark/assets/default) + its drafter",
              "temperature": 1.0, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
              "repeats": args.repeats, **environment(), "startup_s": startup,
              "dtype": str(engines["rejection"].engine.dtype),
              "cuda_graphs": engines["rejection"].engine.executor.graphs.use_graphs,
              "workloads": workloads, "batches": batches, "wall_s": round(time.perf_counter() - t_start, 1)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = ["| workload | batch | tau rejection | tau coupled | tok/s rejection | tok/s coupled | coupled / rejection |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["workloads"]:
        a, c = r["rejection"], r["coupled"]
        lines.append(f"| {r['workload']} | {r['batch']} | {a['tau']} | {c['tau']} | {a['tok_s']:,.0f} | "
                     f"{c['tok_s']:,.0f} | {r['coupled_over_rejection_tok_s']} |")
    lines += ["", "| batch | tok/s rejection | tok/s coupled | tok/s coupled-bi | bi / coupled | "
                  "reproducible / fastest | request 0 same at every batch (rej, coupled, bi) |",
              "|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["batches"]:
        same = ", ".join("yes" if r[n]["request0_same_as_first_batch"] else "no" for n in ENGINES)
        lines.append(f"| {r['batch']} | {r['rejection']['tok_s']:,.0f} | {r['coupled']['tok_s']:,.0f} | "
                     f"{r['coupled-bi']['tok_s']:,.0f} | {r['bi_over_coupled_tok_s']} | "
                     f"{r['reproducible_over_fastest_tok_s']} | {same} |")
    return "\n".join(lines)


def add_sampling_args(p) -> None:
    p.add_argument("--model", default=None, help="a checkpoint with a drafter/ folder; default: the default pair")
    p.add_argument("--workloads", nargs="+", default=["math", "chat", "poetry", "code"], help="workloads of part 1")
    p.add_argument("--workload-batch", type=int, default=32, help="prompts per workload run (part 1)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256], help="batch sizes of part 2")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompts are cut to their last N tokens")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs per point, the engines' order rotating; medians reported")
    p.add_argument("--kv-gb", type=float, default=6.0, help="KV cache per engine")
    p.add_argument("--data-dir", default=None,
                   help="workload data; none: $NANODSPARK_DATA, else ../shared/data, else .carry/data")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the script)")
    p.add_argument("--out", default="", help="JSON of every run (default: benchmarks/sampling_h200.json; "
                                            "none with --smoke)")


def run(args) -> dict:
    if args.smoke:
        args.workloads, args.workload_batch, args.batches = args.workloads[:1], 2, [1, 2]
        args.max_tokens, args.repeats, args.prompt_tokens, args.kv_gb = 4, 1, 48, 0.05
    args.out = args.out or (None if args.smoke else "benchmarks/sampling_h200.json")
    return sampling_bench(args)
