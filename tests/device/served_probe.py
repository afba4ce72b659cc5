"""Where a served decode step spends what its profiled price does not (GPU only).

The cost table prices a drafting step by `bench profile`'s runner: a fixed batch at a fixed
context, every step committing one token per request. In a closed loop (`bench serve`) the same
step commits what the acceptance law accepts, next to finishing and joining requests. This probe
builds a shape with random weights (lab/shapes.py), runs each system in the engine's closed loop
and records a few steady-state steps under torch.profiler (kernels by name, runtime launches,
device busy time), and does the same for the profile's own step at the same batch; the rows that
differ are what the profile misses.

    python tests/device/served_probe.py --shape smollm2-135m --concurrency 16 --out $OUT/served_probe.json
"""
import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from nanodspark import LLM
from nanodspark.lab.bench_profile import whole_step_runner
from nanodspark.lab.bench_serve import engine_closed_loop, engine_config, make_workload
from nanodspark.lab.bench_speed import environment, union_length
from nanodspark.lab.shapes import materialize
from nanodspark.lab.timeline import PHASES     # the engine loop's record_function marks, not kernels
from nanodspark.loader import Tokenizer

RUNTIME = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize",
           "cudaEventSynchronize")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarize(prof, n: int) -> dict:
    """Per step: kernel microseconds by name, device busy (union of kernel intervals), kernel
    and runtime-call counts."""
    dev = DeviceType.CUDA if torch.cuda.is_available() else DeviceType.CPU
    by, spans, calls = {}, [], {}
    for e in prof.events():
        if e.device_type == dev == DeviceType.CUDA and e.name not in PHASES:
            by[e.name[:90]] = by.get(e.name[:90], 0.0) + (e.time_range.end - e.time_range.start) / n
            spans.append((e.time_range.start, e.time_range.end))
        elif e.device_type == DeviceType.CPU and e.name in RUNTIME:
            calls[e.name] = calls.get(e.name, 0) + 1 / n
    return {"kernel_us": by, "device_us": round(sum(by.values()), 1), "busy_us": round(union_length(spans) / n, 1),
            "kernels": round(len(spans) / n, 1), "runtime_calls": {k: round(v, 1) for k, v in calls.items()}}


def served(llm, work, c: int, warmup_s: float, steps: int) -> dict:
    """The closed loop at concurrency c; `steps` engine steps profiled after `warmup_s` (torch
    profiler), then as many under cProfile (the host's Python by function)."""
    eng = llm.engine
    step, state = eng.step, {"n": 0, "t0": None, "wall": []}
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    cp = cProfile.Profile()
    t_start = time.perf_counter()

    def probed():
        now = time.perf_counter()
        if state["t0"] is None and now - t_start >= warmup_s:
            prof.start()
            state["t0"] = now
        out = step()
        if state["t0"] is not None and state["n"] < 2 * steps:
            state["n"] += 1
            state["wall"].append(time.perf_counter() - now)
            if state["n"] == steps:
                sync()
                prof.stop()
                state["t1"] = time.perf_counter()
                cp.enable()
            elif state["n"] == 2 * steps:
                cp.disable()
        return out
    eng.step = probed
    try:
        run = engine_closed_loop(eng, work, c, warmup_s=warmup_s, duration_s=2.0)
    finally:
        eng.step = step
    acc = run.extra["accounting"]
    out = summarize(prof, steps)
    st = pstats.Stats(cp).stats
    out["python_by_own_time"] = [[f"{Path(f).name}:{line}({fn})", round(1e6 * v[2] / steps, 1)]
                                 for (f, line, fn), v in sorted(st.items(), key=lambda kv: -kv[1][2])[:25]]
    out.update(step_ms_profiled=round(1e3 * (state["t1"] - state["t0"]) / steps, 3),
               step_ms_median_profiled=round(1e3 * statistics.median(state["wall"][:steps]), 3),
               decode_only_ms=round(1e3 * acc["decode_only_s"] / max(1, acc["decode_only_steps"]), 3),
               tokens_per_step=round((acc["decode_request_steps"] + acc["drafts_accepted"]) / max(1, acc["steps"]), 2),
               phase_ms=run.extra["phase_ms"], mixed_steps=acc["mixed_steps"], steps=acc["steps"],
               drafts=[acc["drafts_accepted"], acc["drafts_verified"]])
    return out


def profiled_step(llm, c: int, context: int, steps: int, prompts) -> dict:
    """The cost table's step at batch c and the full budget (`bench profile`'s runner)."""
    g = llm.engine.gamma
    run = whole_step_runner(llm, context, prompts, loop="overlap")
    run.prepare(c, c * g)
    for _ in range(5):
        run(c, c * g)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        run(c, c * g)
    sync()
    ms = 1e3 * (time.perf_counter() - t) / steps
    run.prepare(c, c * g)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run(c, c * g)
        sync()
    run.close()
    return {**summarize(prof, steps), "step_ms_unprofiled": round(ms, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--law", default="0.3:0.6", help="the served runs' synthetic acceptance")
    ap.add_argument("--steps", type=int, default=40, help="profiled steps per system")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--systems", nargs="+", default=["no-spec", "static", "static-law-0"],
                    help="no-spec, static, static-law-0 (the law accepting nothing), compact (needs --cost-table)")
    ap.add_argument("--cost-table", default=None)
    ap.add_argument("--no-profile-step", action="store_true", help="skip the profile runner's step")
    ap.add_argument("--out", default="served_probe.json")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="nanodspark-shape-")
    model = str(materialize(a.shape, Path(tmp.name) / a.shape))
    ns = SimpleNamespace(concurrency=[a.concurrency], max_num_seqs=0, kv_gb=4.0, prefix_cache=False,
                         max_num_batched_tokens=0, prompt_tokens=256, output_len=128, output_spread=0.25,
                         shape=a.shape, cost_table=a.cost_table, drafter=None, synthetic_acceptance=a.law)
    work = make_workload(Tokenizer(model), "mix", 400, 256, 128, 0.25)
    res = {"shape": a.shape, "random_weights": True, "concurrency": a.concurrency, "law": a.law, **environment(),
           "command": "python tests/device/served_probe.py " + " ".join(sys.argv[1:]), "systems": {}}
    labels = {"no-spec": ("no-spec", "no-spec", None), "static": ("static, served", "static", a.law),
              "static-law-0": ("static, served, law 0:0", "static", "0:0"), "compact": ("compact, served", "compact", a.law)}
    for name in a.systems:
        label, system, law = labels[name]
        llm = LLM(model, **{**engine_config(SimpleNamespace(**{**vars(ns), "synthetic_acceptance": law}), system)})
        llm.engine.tokenizer = None            # text-free, as serve.py's engine core
        engine_closed_loop(llm.engine, work, a.concurrency, warmup_s=0.0, duration_s=1.0)   # compile, settle
        res["systems"][label] = served(llm, work, a.concurrency, a.warmup_s, a.steps)
        del llm
        torch.cuda.empty_cache()
    if not a.no_profile_step:
        llm = LLM(model, **{**engine_config(ns, "static"), "verify_mode": "compact", "synthetic_acceptance": None})
        llm.engine.tokenizer = None
        res["systems"]["profile's step"] = profiled_step(llm, a.concurrency, 256, a.steps, work.prompts)
    keys = list(res["systems"])
    first = keys[1] if len(keys) > 2 else keys[0]         # (no-spec, static, ..., the profile's step): static
    s, p = res["systems"][first]["kernel_us"], res["systems"][keys[-1]]["kernel_us"]
    res["kernel_difference"] = f"{first} less {keys[-1]}"
    res["kernel_difference_us"] = [{"kernel": k, "us_per_step": round(d, 1)} for k, d in sorted(
        ((k, s.get(k, 0.0) - p.get(k, 0.0)) for k in set(s) | set(p)), key=lambda kv: -abs(kv[1]))[:30]]
    for v in res["systems"].values():
        v["top_kernels"] = [[k, round(x, 1)] for k, x in sorted(v.pop("kernel_us").items(), key=lambda kv: -kv[1])[:25]]
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("| system | step ms | decode-only ms | device us | busy us | kernels | runtime calls |\n|---|---:|---:|---:|---:|---:|---|")
    for k, v in res["systems"].items():
        print(f"| {k} | {v.get('step_ms_profiled', v.get('step_ms_unprofiled'))} | {v.get('decode_only_ms', '')} | "
              f"{v['device_us']} | {v['busy_us']} | {v['kernels']} | {v['runtime_calls']} |")
    for k, v in res["systems"].items():
        print(k, {x: v[x] for x in ("phase_ms", "tokens_per_step", "mixed_steps", "steps", "drafts") if x in v})
    for k, v in res["systems"].items():
        if "python_by_own_time" in v:
            print(k, "python, own us per step:", v["python_by_own_time"][:14])
    print(f"\n| kernel ({res['kernel_difference']}) | us per step |\n|---|---:|")
    for r in res["kernel_difference_us"][:20]:
        print(f"| {r['kernel']} | {r['us_per_step']} |")


if __name__ == "__main__":
    main()
