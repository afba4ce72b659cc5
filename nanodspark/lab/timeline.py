"""The timeline of decode steps, drawn from a profiler trace (`python -m nanodspark.bench timeline`).

For each loop (synchronous, overlapped) it runs a batch to steady decoding, records a few steps
under torch.profiler, and draws one PNG (`plots.timeline`): per loop a host lane (the engine loop's phases,
marked with `record_function` in `LLMEngine.step`: schedule, launch, result, commit) above a GPU
lane (every kernel). In the synchronous loop the GPU lane has a gap for every host phase but
`result`; in the overlapped one the next step's kernels are queued before the host waits, so the
gaps close as long as the host work of a step is shorter than its GPU work. Writes the PNG and
a JSON of the intervals (hardware, versions, command); `gpu_busy` is the share of the span in
which a kernel runs (the union of their intervals). Walkthrough chapter 11.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import plots
from .bench_engine import environment
from .bench_speed import _decoding_batch, _finish, _prompts

PHASES = tuple(plots.PHASE_COLOURS)      # the engine loop's record_function names


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
        if e.device_type == DeviceType.CPU and e.name in PHASES:
            host.append((e.name, e.time_range.start, e.time_range.end))
        elif e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower():
            gpu.append(("kernel", e.time_range.start, e.time_range.end))
    t0 = min([s for _, s, _ in host + gpu], default=0)
    return {"host": [(n, s - t0, e - t0) for n, s, e in host], "gpu": [(n, s - t0, e - t0) for n, s, e in gpu]}


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
                     "gpu_busy": round(plots.gpu_busy(t["gpu"], span), 3) if span else None, "steps": args.steps})
        del llm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "decode-step timeline (profiler trace)", "model": args.model or "default pair",
              "batch": args.batch, **environment(), "rows": rows,
              "lanes": "per loop: host phases (schedule blue, launch orange, result grey, commit green) over GPU kernels (red)",
              "gpu_busy": "the union of the kernel intervals over the span (JSONs written before this field: "
                          "their sum, which counted nested profiler events twice)",
              "traces": traces}
    out.with_suffix(".json").write_text(json.dumps(result))
    try:
        plots.timeline(result, out.with_suffix(".png"), caption=f"{plots.command_caption(result)}")
    except ModuleNotFoundError as e:      # the JSON is the measurement; the picture can be drawn later
        print(f"{out.with_suffix('.png')} not drawn: {e}")
    for r in rows:
        print(r)
    return result


def add_timeline_args(p) -> None:
    p.add_argument("--model", default=None, help="target checkpoint directory; none: the shipped default model")
    p.add_argument("--drafter", default=None,
                   help="drafter directory; none: the model's drafter/ if shipped; 'none': no speculation")
    p.add_argument("--loops", nargs="+", default=["sync", "overlap"], choices=["sync", "overlap"],
                   help="engine loops traced")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--steps", type=int, default=6, help="decode steps traced per loop")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--prompts", choices=("random", "mix"), default="random",
                   help="random token ids, or the mixed workload's real prompts")
    p.add_argument("--kv-gb", type=float, default=1.0, help="KV cache memory (GB)")
    p.add_argument("--out", default="timeline.png", help="the PNG to write; the JSON of the intervals goes beside it")
