"""Engine speed beside Hugging Face transformers (`python -m nanodspark.bench engine`, on the GPU).

Same work for everyone: `batch` random prompts of `prompt_len` tokens (or, with `--prompts mix`,
the same real prompts for every system, cut to their last `prompt_len` tokens; transformers gets
them left-padded), `max_tokens` new tokens each, greedy, end-of-sequence ignored, prefill
included, medians of `repeats` timed runs after a warm-up. Systems, all in one run on one model:

* `hf-dynamic`: `transformers` `generate` with its default dynamic cache (eager PyTorch);
* `hf-static`: `generate(cache_implementation="static")`, which compiles the forward and replays
  CUDA graphs (two warm-up calls, then timed);
* `eager`: nanodspark with the Triton kernels, launched one by one (`cuda_graphs=False`, synchronous loop);
* `graphs`: decode steps replayed from CUDA graphs, synchronous loop;
* `overlap`: graphs and the overlapped loop (the default on CUDA);
* `torch`: the plain-PyTorch reference path (`attention_backend="torch"`), for the kernel count before fusion.

For the nanodspark systems it also measures, over `profile_steps` decode steps of the same
batch: device kernels per step and host launches per step (torch.profiler), GPU busy fraction
= the union of kernel time over the steps' wall time measured without the profiler, and the
GPU idle time between steps. With `--drafter`, each nanodspark system runs with and without it
(speculation speed-up at the same batch). Weights are random unless `--model` names a checkpoint.
Walkthrough chapters 10 and 11; results page 09.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .bench_engine import QWEN3_0_6B, environment, random_checkpoint

NS_SYSTEMS = {"eager": dict(cuda_graphs=False, overlap=False), "graphs": dict(cuda_graphs=True, overlap=False),
              "overlap": dict(cuda_graphs=True, overlap=True),
              "torch": dict(attention_backend="torch", cuda_graphs=False, overlap=False)}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(batch, length, vocab, seed=0, tokenizer=None, kind="random"):
    """`batch` prompts of `length` tokens: random ids, or (kind "mix") the mixed workload's real
    prompts (math, code, chat, poetry) cut to their last `length` tokens — text a drafter can
    predict, where random ids are not."""
    if kind == "mix" and tokenizer is not None:
        from .bench_engine import bench_prompts
        return [tokenizer.encode(p.render())[-length:] for p in bench_prompts("mix", batch)]
    g = torch.Generator().manual_seed(seed + batch)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def hf_batch(prompts, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as transformers' batched `generate` takes them: one rectangle of the same
    ids, left-padded to the longest, and the attention mask that hides the padding."""
    n = max(map(len, prompts))
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):], mask[i, n - len(p):] = torch.tensor(p, dtype=torch.long), 1
    return ids, mask


def time_hf(model, prompts, max_tokens, repeats, static: bool) -> dict:
    ids, mask = (t.cuda() for t in hf_batch(prompts))
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
              attention_mask=mask)
    if static:
        kw["cache_implementation"] = "static"
    for _ in range(2):                       # warm-up: compilation and graph capture for static
        model.generate(ids, **kw)
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync()
        times.append(time.perf_counter() - t)
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    med = statistics.median(times)
    return {"tokens": n, "seconds_median": round(med, 4), "seconds_all": [round(x, 4) for x in times],
            "tokens_per_second": round(n / med, 1)}


def time_ns(llm, prompts, max_tokens, repeats) -> dict:
    from .. import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # warm-up on the whole batch: its prefill shapes compile Triton kernels the first time they
    # are seen, which two prompts do not reach
    llm.generate(prompts, params, use_tqdm=False)
    times, steps = [], []
    for _ in range(repeats):
        s0 = llm.engine.clock.steps
        _sync()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync()
        times.append(time.perf_counter() - t)
        steps.append(llm.engine.clock.steps - s0)
    n = sum(len(o.token_ids) for o in outs)
    med = statistics.median(times)
    taus = [o.spec.get("tau", 0) for o in outs]
    return {"tokens": n, "seconds_median": round(med, 4), "seconds_all": [round(x, 4) for x in times],
            "tokens_per_second": round(n / med, 1), "engine_steps": statistics.median(steps),
            "tau": round(statistics.mean(taus), 3) if any(taus) else None}


def _decoding_batch(llm, prompts, steps_needed, stop=(), stream_text=False):
    """Admit the prompts with room for `steps_needed` decode steps and step until all decode. No
    text in the step unless `stream_text` (as serve.py's engine core and LLM.generate add them)."""
    from .. import SamplingParams
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4 * steps_needed * (1 + eng.gamma) + 8, ignore_eos=True,
                            stop=list(stop))
    reqs = [eng.add_request(p, params, queue_limit=False, stream_text=stream_text) for p in prompts]
    while any(not r.is_decoding for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):                        # past the first decode steps (lazy work, allocator)
        eng.step()
    return reqs


def _finish(llm, reqs):
    eng = llm.engine
    for r in reqs:
        eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    for r in reqs:
        eng.release(r.request_id)


def union_length(intervals) -> float:
    """The length of the union of (start, end) intervals: the time a device was busy with any of them."""
    busy, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            busy, end = busy + e - s, e
        elif e > end:
            busy, end = busy + e - end, e
    return busy


def step_profile(llm, prompts, n_steps: int) -> dict:
    """Kernels and launches per decode step (profiler), and the GPU busy / idle share of a step's
    wall time (the wall measured on a separate, unprofiled run of the same steps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    eng = llm.engine
    reqs = _decoding_batch(llm, prompts, 2 * n_steps)
    _sync()
    t = time.perf_counter()
    for _ in range(n_steps):
        eng.step()
    _sync()
    wall = (time.perf_counter() - t) / n_steps
    _finish(llm, reqs)
    reqs = _decoding_batch(llm, prompts, 2 * n_steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n_steps):
            eng.step()
        _sync()
    _finish(llm, reqs)
    kernels, launches, by_name = [], 0, {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower() and "memset" not in e.name.lower():
            kernels.append((e.time_range.start, e.time_range.end))
            c = by_name.setdefault(e.name[:80], [0, 0.0])
            c[0] += 1
            c[1] += e.time_range.end - e.time_range.start
        elif e.device_type == DeviceType.CPU and e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                                                           "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += 1
    busy_s = union_length(kernels) * 1e-6 / n_steps
    return {"step_ms": round(1e3 * wall, 3), "kernels_per_step": round(len(kernels) / n_steps, 1),
            "launches_per_step": round(launches / n_steps, 1), "gpu_ms_per_step": round(1e3 * busy_s, 3),
            "gpu_busy": round(min(1.0, busy_s / wall), 3), "gpu_idle_ms_per_step": round(1e3 * max(0.0, wall - busy_s), 3),
            "top_kernels": [{"name": k, "per_step": round(c / n_steps, 2), "us_per_step": round(t / n_steps, 2)}
                            for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]]}


def engine_speed(args) -> dict:
    from .. import LLM
    rows = []
    tmp = tempfile.TemporaryDirectory()
    path = args.model
    model_desc = args.model or "Qwen3-0.6B shape, RANDOM weights"
    shape = getattr(args, "shape", None)
    dummy = {}
    if shape is not None:                # the shape and its drafter, random weights allocated on the device
        from .shapes import materialize
        if any(s.startswith("hf-") for s in args.systems):
            raise SystemExit("--shape has no checkpoint for transformers: leave the hf-* systems out")
        path = str(materialize(shape, Path(tmp.name) / shape))
        args.drafter = args.drafter or str(Path(path) / "drafter")
        model_desc = f"{shape} shape, RANDOM weights"
        dummy = dict(load_format="dummy")
    elif getattr(args, "synthetic_acceptance", None):
        raise SystemExit("--synthetic-acceptance needs --shape (random weights)")
    if path is None:
        path = str(random_checkpoint(QWEN3_0_6B, Path(tmp.name) / "qwen3-0.6b-random"))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"] if Path(path, "config.json").exists() \
        else 8192
    hf = [s for s in args.systems if s.startswith("hf-")]
    if hf:
        import transformers
        from ..loader import Tokenizer
        # the ids nanodspark gets below: with "mix", the same real prompts (of varying lengths)
        tok = Tokenizer(path) if args.prompts == "mix" and Path(path, "tokenizer.json").exists() else None
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        for s in hf:
            for batch in args.batches:
                try:
                    ps = _prompts(batch, args.prompt_len, vocab, tokenizer=tok, kind=args.prompts)
                    r = time_hf(model, ps, args.max_tokens, args.repeats, s == "hf-static")
                except Exception as e:           # reported, not hidden
                    r = {"error": repr(e)[:300]}
                rows.append({"system": s, "batch": batch, "drafter": None, **r})
                print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    drafters = [None] + ([args.drafter] if args.drafter else [])
    for s in [s for s in args.systems if not s.startswith("hf-")]:
        for drafter in drafters:
            # The repeats reuse the prompts: with the prefix cache on, every repeat after the first
            # would prefill 16 of 128 tokens while transformers prefills all of them. Off, both
            # systems do the same work.
            kw = dict(NS_SYSTEMS[s], drafter_path=drafter or "none", max_num_seqs=max(args.batches),
                      kv_cache_memory_gb=args.kv_gb, use_tqdm=False, enable_prefix_cache=False,
                      max_num_batched_tokens=args.max_num_batched_tokens, **dummy)
            if drafter and getattr(args, "synthetic_acceptance", None):   # random drafts accepted by a law
                kw["synthetic_acceptance"] = args.synthetic_acceptance
            t0 = time.perf_counter()
            try:
                llm = LLM(path, **kw)
            except Exception as e:
                rows.append({"system": s, "drafter": drafter, "error": repr(e)[:300]})
                continue
            start_s = time.perf_counter() - t0
            graphs = llm.engine.executor.graphs
            for batch in args.batches:
                ps = _prompts(batch, args.prompt_len, vocab, tokenizer=llm.tokenizer, kind=args.prompts)
                try:
                    r = time_ns(llm, ps, args.max_tokens, args.repeats)
                    if args.profile_steps:
                        r["profile"] = step_profile(llm, ps, args.profile_steps)
                except Exception as e:
                    r = {"error": repr(e)[:300]}
                rows.append({"system": s, "batch": batch, "drafter": drafter, "startup_s": round(start_s, 2),
                             "graphs_captured": len(graphs.graphs), "capture_s": round(graphs.capture_seconds, 2),
                             "capture_mib": round(graphs.capture_bytes / 2**20, 1),
                             "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens, **r})
                print(rows[-1], flush=True)
            del llm
            torch.cuda.empty_cache()
    tmp.cleanup()
    result = {"benchmark": "engine speed beside transformers", "model": model_desc, "prompts": args.prompts,
              "random_weights": args.model is None,
              "synthetic_acceptance": getattr(args, "synthetic_acceptance", None),
              "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "repeats": args.repeats, "dtype": "bfloat16", **environment(),
              "rows": rows, "ratios": ratios(rows)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return result


def ratios(rows) -> list[dict]:
    """Each nanodspark row's tok/s over hf-static's (and over its no-drafter twin)."""
    out = []
    base = {r["batch"]: r["tokens_per_second"] for r in rows if r.get("system") == "hf-static" and "tokens_per_second" in r}
    plain = {(r["system"], r["batch"]): r["tokens_per_second"] for r in rows
             if r.get("drafter") is None and "tokens_per_second" in r and not r["system"].startswith("hf-")}
    for r in rows:
        if r["system"].startswith("hf-") or "tokens_per_second" not in r:
            continue
        d = {"system": r["system"], "batch": r["batch"], "drafter": r["drafter"]}
        if r["batch"] in base:
            d["over_hf_static"] = round(r["tokens_per_second"] / base[r["batch"]], 3)
        if r["drafter"] is not None and (r["system"], r["batch"]) in plain:
            d["spec_over_plain"] = round(r["tokens_per_second"] / plain[(r["system"], r["batch"])], 3)
        out.append(d)
    return out


def markdown(result) -> str:
    lines = ["| system | drafter | batch | tok/s | vs hf-static | spec / plain | step ms | GPU busy | kernels/step | launches/step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rat = {(q["system"], q["batch"], q["drafter"]): q for q in result["ratios"]}
    for r in result["rows"]:
        if "tokens_per_second" not in r:
            lines.append(f"| {r['system']} | {r.get('drafter') or '-'} | {r.get('batch', '-')} | error: {r.get('error', '')[:60]} |")
            continue
        q = rat.get((r["system"], r["batch"], r.get("drafter")), {})
        p = r.get("profile", {})
        lines.append(f"| {r['system']} | {'yes' if r.get('drafter') else '-'} | {r['batch']} | {r['tokens_per_second']:,.0f} | "
                     f"{q.get('over_hf_static', '-')} | {q.get('spec_over_plain', '-')} | {p.get('step_ms', '-')} | "
                     f"{p.get('gpu_busy', '-')} | {p.get('kernels_per_step', '-')} | {p.get('launches_per_step', '-')} |")
    return "\n".join(lines)


def add_speed_args(p) -> None:
    from .shapes import SHAPES
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, help="a checkpoint directory; default: a random Qwen3-0.6B shape")
    g.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a model shape (lab/shapes.py) with random weights and its drafter, no checkpoint; "
                        "nanodspark systems only")
    p.add_argument("--synthetic-acceptance", default=None, metavar="LO:HI",
                   help="with --shape: each request accepts a draft with its own rate, uniform in [LO, HI] "
                        "(verify.SyntheticAcceptance), so a random-weight drafter yields tokens like a trained one")
    p.add_argument("--drafter", default=None, help="also run every nanodspark system with this drafter")
    p.add_argument("--systems", nargs="+", default=["hf-dynamic", "hf-static", "eager", "graphs", "overlap"],
                   choices=["hf-dynamic", "hf-static", *NS_SYSTEMS],
                   help="engines timed: transformers (dynamic, static cache) and nanodspark (eager, graphs, "
                        "graphs + overlapped loop)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--prompts", choices=("random", "mix"), default="random",
                   help="random token ids (transformers gets the same), or the mixed workload's real prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point; the median is reported")
    p.add_argument("--profile-steps", type=int, default=8, help="decode steps profiled per point (0: none)")
    p.add_argument("--kv-gb", type=float, default=8.0, help="KV cache memory (GB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="the engines' prefill chunk (token budget of a forward); 0: the engine's default")
    p.add_argument("--out", default="", help="JSON file for every row (none: print only)")
