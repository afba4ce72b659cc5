"""Where a compact engine's plain step spends what the target alone does not (GPU only).

The cost scheduler's plain step (draft share 0, speculative.py) verifies no draft, yet it still
captures the target's features and injects them into the drafter's context, unless it lets that
context lapse (deep in a run of plain steps). This probe builds the engines (compact keeping the
context, compact letting it lapse, the target alone) on a shape with random weights
(lab/shapes.py), fills each with the same batch of decoding requests, times their steps in the
overlapped loop in alternating rounds, and lists the kernels of a few profiled steps by name:
the rows only the compact engine runs are the plain step's extra cost.

    python tests/device/plain_probe.py --shape qwen3-8b --batch 256 --out $OUT/plain_probe.json
"""
import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from nanodspark.lab.bench_profile import build_profiled_llm, drain, whole_step_runner
from nanodspark.lab.bench_speed import environment
from nanodspark.sampling import SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(bs: int, context: int, vocab: int) -> list[list[int]]:
    """bs prompts of random tokens, their lengths spread over the last 64 below `context`, so that
    requests cross KV blocks on different steps, as in traffic."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, context - int(rng.integers(0, 64))).tolist() for _ in range(bs)]


def plain_runner(llm, ps: list[list[int]], context: int):
    """(prepare, step) for the target alone: a decoding request per prompt of `ps`."""
    eng, reqs = llm.engine, []
    eng.overlap = True
    params = SamplingParams(temperature=0, max_tokens=eng.max_model_len - context - 1, ignore_eos=True)

    def prepare():
        for r in reqs:
            eng.abort(r.request_id)
        drain(eng)
        for r in reqs:
            eng.release(r.request_id)
        reqs[:] = [eng.add_request(p, params, queue_limit=False, stream_text=False) for p in ps]
        while any(not r.is_decoding for r in reqs):
            eng.step()
    return prepare, eng.step


def kernels(step, n: int) -> tuple[dict[str, float], dict]:
    """Device microseconds per step by kernel name over n profiled steps, and the device's idle
    gaps: their total per step and the largest, each with the kernels on either side."""
    dev = DeviceType.CUDA if torch.cuda.is_available() else DeviceType.CPU    # CPU: a smoke run
    with profile(activities=[ProfilerActivity.CUDA] if dev == DeviceType.CUDA else [ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
        sync()
    out: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if e.device_type == dev:
            out[e.name[:90]] = out.get(e.name[:90], 0.0) + (e.time_range.end - e.time_range.start) / n
            spans.append((e.time_range.start, e.time_range.end, e.name[:60]))
    spans.sort()
    gaps, end, prev = [], None, None
    for s, e, name in spans:
        if end is not None and s - end > 5:
            gaps.append((s - end, prev, name))
        if end is None or e > end:
            end, prev = e, name
    gaps.sort(key=lambda g: -g[0])
    idle = {"gaps_over_5us_per_step": round(len(gaps) / n, 1), "idle_us_per_step": round(sum(g[0] for g in gaps) / n, 1),
            "largest": [{"us": round(g[0], 1), "after": g[1], "before": g[2]} for g in gaps[:12]]}
    return out, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--out", default="plain_probe.json")
    a = ap.parse_args()
    ns = SimpleNamespace(shape=a.shape, batch_sizes=[a.batch], context=a.context, kv_gb=0.0)
    spec, _ = build_profiled_llm(ns, drafter=True, verify_mode="compact")
    lapsing, _ = build_profiled_llm(ns, drafter=True, verify_mode="compact")
    alone, _ = build_profiled_llm(ns, drafter=False)
    ps = prompts(a.batch, a.context, spec.engine.model_config.vocab_size)
    run = whole_step_runner(spec, a.context, ps, loop="overlap", draft_fraction=0.0)
    lapse = whole_step_runner(lapsing, a.context, ps, loop="overlap", draft_fraction=0.0, upkeep=False)
    engines = {"compact, plain step": (lambda: (run.state.update(bs=None), run.prepare(a.batch, 0)),
                                       lambda: run(a.batch, 0)),
               "compact, lapsed plain step": (lambda: (lapse.state.update(bs=None), lapse.prepare(a.batch, 0)),
                                              lambda: lapse(a.batch, 0)),
               "target alone": plain_runner(alone, ps, a.context)}
    llms = {"compact, plain step": spec, "compact, lapsed plain step": lapsing, "target alone": alone}
    ms = {k: [] for k in engines}
    gaps = {k: [] for k in engines}                # wall ms between consecutive steps' returns
    phases = {k: [] for k in engines}              # host ms per phase (unprofiled), per round
    for _ in range(a.rounds):                      # alternating rounds, a fresh batch each
        for name, (prepare, step) in engines.items():
            prepare()
            for _ in range(3):
                step()
            sync()
            clock = llms[name].engine.clock
            clock.reset()
            t = last = time.perf_counter()
            for _ in range(a.steps):
                step()
                now = time.perf_counter()
                gaps[name].append(1e3 * (now - last))
                last = now
            sync()
            ms[name].append(1e3 * (time.perf_counter() - t) / a.steps)
            phases[name].append(clock.per_step_ms())
    prof, idle, python = {}, {}, {}
    for name, (prepare, step) in engines.items():
        prepare()
        for _ in range(3):
            step()
        prof[name], idle[name] = kernels(step, a.profile_steps)
        prepare()                                  # the host's Python by function (cProfile)
        cp = cProfile.Profile()
        cp.enable()
        for _ in range(a.profile_steps):
            step()
        sync()
        cp.disable()
        st = pstats.Stats(cp).stats
        top = sorted(st.items(), key=lambda kv: -kv[1][2])[:25]
        python[name] = [{"function": f"{Path(f).name}:{line}({fn})", "calls_per_step": round(v[1] / a.profile_steps, 1),
                         "own_us_per_step": round(1e6 * v[2] / a.profile_steps, 1)} for (f, line, fn), v in top]
    run.close()
    lapse.close()
    a_, b_ = prof["compact, plain step"], prof["target alone"]
    extra = sorted(((k, a_.get(k, 0.0) - b_.get(k, 0.0)) for k in set(a_) | set(b_)), key=lambda kv: -abs(kv[1]))
    res = {"shape": a.shape, "random_weights": True, "batch": a.batch, "context": a.context, **environment(),
           "command": "python tests/device/plain_probe.py " + " ".join(sys.argv[1:]),
           "step_ms": {k: {"median": round(statistics.median(v), 3), "all": [round(x, 3) for x in v]}
                       for k, v in ms.items()},
           "device_us_per_step": {k: round(sum(v.values()), 1) for k, v in prof.items()},
           "idle": idle, "python_by_own_time": python,
           "host_ms_per_step": {k: {ph: round(statistics.median(r[ph] for r in v), 3) for ph in v[0]}
                                for k, v in phases.items()},
           "step_interval_ms": {k: {q: round(float(np.percentile(v, p)), 3) for q, p in
                                    (("p10", 10), ("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))}
                                for k, v in gaps.items()},
           "kernel_difference_us": [{"kernel": k, "us_per_step": round(d, 1)} for k, d in extra[:30]]}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("| engine | step ms (median of rounds) | device us per step | idle us per step (gaps) | host ms per phase (unprofiled) |\n"
          "|---|---:|---:|---:|---|")
    for k in ms:
        print(f"| {k} | {res['step_ms'][k]['median']} | {res['device_us_per_step'][k]} | "
              f"{idle[k]['idle_us_per_step']} ({idle[k]['gaps_over_5us_per_step']}) | {res['host_ms_per_step'][k]} |")
    for k in ms:
        print(k, "step intervals ms:", res["step_interval_ms"][k])
    for k in ms:
        print(k, "python, own us per step:", [(r["function"], r["own_us_per_step"]) for r in python[k][:10]])
    for k in ms:
        print(k, "largest gaps:", [(g["us"], g["after"][:30], g["before"][:30]) for g in idle[k]["largest"][:6]])
    print("\n| kernel (compact's plain step less the target alone) | us per step |\n|---|---:|")
    for r in res["kernel_difference_us"][:18]:
        print(f"| {r['kernel']} | {r['us_per_step']} |")


if __name__ == "__main__":
    main()
