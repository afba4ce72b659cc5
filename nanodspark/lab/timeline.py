"""The timeline of decode steps, drawn from a profiler trace (`python -m nanodspark.bench timeline`).

For each loop (synchronous, overlapped) it runs a batch to steady decoding, records a few steps
under torch.profiler, and draws one PNG: per loop a host lane (the engine loop's phases,
marked with `record_function` in `LLMEngine.step`: schedule, launch, result, commit) above a GPU
lane (every kernel). In the synchronous loop the GPU lane has a gap for every host phase but
`result`; in the overlapped one the next step's kernels are queued before the host waits, so the
gaps close as long as the host work of a step is shorter than its GPU work. Writes the PNG and
a JSON of the intervals (hardware, versions, command). Walkthrough chapter 11.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .bench_engine import environment
from .bench_speed import _decoding_batch, _finish, _prompts
from .plots import write_png

PHASE_COLOURS = {"schedule": (31, 119, 180), "launch": (255, 127, 14), "result": (200, 200, 200),
                 "commit": (44, 160, 44)}
KERNEL_COLOUR = (214, 39, 40)


def trace_steps(llm, prompts, n_steps: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    reqs = _decoding_batch(llm, prompts, 2 * n_steps)
    with profile(activities=acts) as prof:
        for _ in range(n_steps):
            llm.engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    _finish(llm, reqs)
    host, gpu = [], []
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name in PHASE_COLOURS:
            host.append((e.name, e.time_range.start, e.time_range.end))
        elif e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower():
            gpu.append(("kernel", e.time_range.start, e.time_range.end))
    t0 = min([s for _, s, _ in host + gpu], default=0)
    return {"host": [(n, s - t0, e - t0) for n, s, e in host], "gpu": [(n, s - t0, e - t0) for n, s, e in gpu]}


def draw(traces: dict, path, width: int = 1600, lane: int = 22, gap: int = 14) -> None:
    end = max([e for t in traces.values() for _, _, e in t["host"] + t["gpu"]], default=1.0)
    h = len(traces) * (2 * lane + 3 * gap)
    img = np.full((h, width, 3), 255, dtype=np.uint8)
    for i, (name, t) in enumerate(traces.items()):
        y0 = i * (2 * lane + 3 * gap) + gap
        for ys, items, colour in ((y0, t["host"], None), (y0 + lane + 4, t["gpu"], KERNEL_COLOUR)):
            img[ys:ys + lane, :] = (240, 240, 240)
            for n, s, e in items:
                x0, x1 = int(s / end * (width - 1)), max(int(s / end * (width - 1)) + 1, int(e / end * (width - 1)))
                img[ys:ys + lane, x0:x1] = colour or PHASE_COLOURS[n]
    write_png(path, img)


def timeline(args) -> dict:
    from .. import LLM
    traces, rows = {}, []
    for loop in args.loops:
        llm = LLM(args.model, drafter_path=args.drafter, overlap=loop == "overlap", use_tqdm=False,
                  max_num_seqs=args.batch, kv_cache_memory_gb=args.kv_gb)
        ps = _prompts(args.batch, args.prompt_len, llm.engine.model_config.vocab_size, tokenizer=llm.tokenizer,
                      kind=args.prompts)
        t = trace_steps(llm, ps, args.steps)
        traces[loop] = t
        span = max([e for _, _, e in t["host"] + t["gpu"]], default=0.0)
        busy = sum(e - s for _, s, e in t["gpu"])
        rows.append({"loop": loop, "span_us": round(span, 1), "gpu_kernel_us": round(busy, 1),
                     "gpu_busy": round(busy / span, 3) if span else None, "steps": args.steps})
        del llm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(traces, out.with_suffix(".png"))
    result = {"benchmark": "decode-step timeline (profiler trace)", "model": args.model or "default pair",
              "batch": args.batch, **environment(), "rows": rows,
              "lanes": "per loop: host phases (schedule blue, launch orange, result grey, commit green) over GPU kernels (red)",
              "traces": traces}
    out.with_suffix(".json").write_text(json.dumps(result))
    for r in rows:
        print(r)
    return result


def add_timeline_args(p) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--loops", nargs="+", default=["sync", "overlap"], choices=["sync", "overlap"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prompts", choices=("random", "mix"), default="random")
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--out", default="timeline.png")
