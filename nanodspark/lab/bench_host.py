"""Host milliseconds per decode step, by phase (`python -m nanodspark.bench host`).

When a step is a few graph replays, the engine is as fast as its host: scheduling, the launch's
bookkeeping, reading the result and committing it (tokens, stops, blocks, text, observers) are
Python work per request, and at batch >= 64 on a small model they are longer than the GPU's
step (walkthrough 09 §8, chapter 11). This measures that work on any machine: it runs a batch
to steady decoding and times, per step, `schedule`, `launch` less the forward it starts (the
`graphs.run` call: a replay on CUDA, the computation itself on the CPU), `result` (waiting for
the device and building the `StepResult`) and `commit`, with the synchronous loop so that each
phase is its own. Medians over steps and repeats; the JSON has the machine and the command.
The host's work does not depend on the device, so the CPU's figures compare two versions of the
engine honestly, though not the CPU with the H200's host. `--compact-plain`: the cost scheduler
(verify_mode compact) on step-cost tables by which drafting never pays, so every step is a
plain step chosen by the real scheduler: its host price beside plain decoding's (`--drafter none`).
`--compact-drafting`: tables by which every row drafting always pays: compact's host price when it
drafts, beside static's (the default verify mode).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from .bench_engine import environment
from .bench_speed import _decoding_batch, _finish, _prompts

PHASES = ("schedule", "launch_less_forward", "result", "commit")


def time_phases(llm, prompts, steps: int, stop: list[str], stream_text: bool = False) -> dict:
    """Per-step host ms of each phase over `steps` decode steps of a batch already decoding."""
    eng = llm.engine
    eng.overlap = False                         # phases one after the other: each timed alone
    reqs = _decoding_batch(llm, prompts, steps + 3, stop, stream_text)
    graphs, forward = eng.executor.graphs, []
    run = graphs.run

    def timed_run(*a, **k):
        t = time.perf_counter()
        out = list(run(*a, **k))
        forward.append(time.perf_counter() - t)
        return out
    graphs.run = timed_run
    rows = []
    try:
        for _ in range(steps):
            eng.clock.reset()
            forward.clear()
            eng.step()
            ms = eng.clock.per_step_ms()
            rows.append(dict(schedule=ms["schedule"], launch_less_forward=ms["launch"] - 1e3 * sum(forward),
                             result=ms["result"], commit=ms["commit"]))
    finally:
        graphs.run = run
        _finish(llm, reqs)
    return {k: statistics.median(r[k] for r in rows) for k in PHASES}


def _use_tables(engine, full: dict, plain: dict) -> None:
    """Give `engine` (verify_mode compact) a cost scheduler on these synthetic tables."""
    from ..cost_scheduler import CostScheduler
    from ..cost_table import CostTable
    from ..windows import CostWindows
    engine.windows = CostWindows(CostScheduler(engine.gamma, engine.config.max_num_seqs, "compact", CostTable(full),
                                               plain_table=CostTable(plain),
                                               plain_hold=engine.config.verify_plain_hold))


def force_plain_steps(engine) -> None:
    """Tables by which drafting never pays: a step that drafts costs 10 ms with no drafts verified
    and 20 ms with full blocks (a table that rises, or the scheduler would take it for flat and
    verify full blocks), one that does not draft 1 ms, at every batch (synthetic; the scheduler's
    own work per step is what is timed)."""
    R, g = engine.config.max_num_seqs, engine.gamma
    _use_tables(engine, {(b, k): 0.010 * (1 + k / (g * b)) for b in (1, R) for k in (0, b, g * b)},
                {(b, 0): 0.001 for b in (1, R)})
    graphs = engine.executor.graphs       # the engine captured no plain step (its tables had none): as it would
    if graphs.use_graphs and 0.0 in engine.executor.draft_tiers:
        graphs.capture([(True, False, 0.0), (False, False, 0.0)], progress=False,
                       tiers=engine.executor.draft_tiers[0.0])


def force_drafting_steps(engine) -> None:
    """Tables by which every row drafting always pays, by far: a drafting step costs 1 ms (a
    little more with drafts at batch 1, or the table would be flat and the scheduler static), one
    that does not draft 2 ms (synthetic; the scheduler's own work per step, when it drafts, is
    what is timed)."""
    R, g = engine.config.max_num_seqs, engine.gamma
    _use_tables(engine, {**{(1, k): 1e-3 * (1 + 0.05 * k) for k in range(g + 1)},
                         **{(R, k): 1e-3 for k in (0, R, g * R)}},
                {(b, 0): 2e-3 for b in (1, R)})


def host_bench(args) -> dict:
    from .. import LLM
    rows = []
    compact = args.compact_plain or getattr(args, "compact_drafting", False)
    if args.compact_plain and getattr(args, "compact_drafting", False):
        raise SystemExit("--compact-plain and --compact-drafting are two runs")
    if compact and args.drafter == "none":
        raise SystemExit("--compact-plain / --compact-drafting need a drafter (not --drafter none)")
    if args.plain_hold is not None and not compact:
        raise SystemExit("--plain-hold applies to --compact-plain or --compact-drafting only")
    for batch in args.batches:
        kw = dict(verify_mode="compact") if compact else {}
        if args.plain_hold is not None:
            kw["verify_plain_hold"] = args.plain_hold
        llm = LLM(args.model, drafter_path=args.drafter, max_num_seqs=batch, use_tqdm=False,
                  max_num_batched_tokens=max(2048, batch * 16), cpu_kv_blocks=64 * batch, **kw)
        if args.compact_plain:
            force_plain_steps(llm.engine)
        elif compact:
            force_drafting_steps(llm.engine)
        prompts = _prompts(batch, args.prompt_len, llm.engine.model_config.vocab_size)
        reps = [time_phases(llm, prompts, args.steps, args.stop, args.stream_text) for _ in range(args.repeats)]
        row = {k: round(statistics.median(r[k] for r in reps), 3) for k in PHASES}
        row.update(batch=batch, total=round(sum(row[k] for k in PHASES), 3),
                   commit_us_per_request=round(1e3 * row["commit"] / batch, 2))
        rows.append(row)
        print(f"batch {batch:4d}: " + "  ".join(f"{k} {row[k]:.3f}" for k in PHASES + ("total",))
              + f" ms  commit/request {row['commit_us_per_request']} us", flush=True)
        del llm
    result = dict(experiment="host ms per decode step by phase (synchronous loop)", rows=rows,
                  model=str(args.model or "default"), drafter=args.drafter, compact_plain=args.compact_plain,
                  compact_drafting=getattr(args, "compact_drafting", False),
                  plain_hold=args.plain_hold,
                  stop=args.stop, stream_text=args.stream_text,
                  steps=args.steps,
                  repeats=args.repeats, prompt_len=args.prompt_len, environment=environment(),
                  argv=["python", "-m", "nanodspark.bench", *sys.argv[1:]])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def add_host_args(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default model)")
    p.add_argument("--drafter", default=None, help="drafter directory; 'none' = no speculation")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256], help="batch sizes")
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per repeat")
    p.add_argument("--repeats", type=int, default=3, help="repeats per batch size; medians over steps and repeats")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--stop", nargs="*", default=[], help="stop strings every request carries (a path of its own)")
    p.add_argument("--stream-text", action="store_true",
                   help="requests as LLM.stream adds them: text decoded every step in the engine (default: as "
                        "serve.py's engine core and LLM.generate add them, no text in the step)")
    p.add_argument("--compact-plain", action="store_true",
                   help="the cost scheduler choosing plain steps at every step (tables where drafting never pays)")
    p.add_argument("--compact-drafting", action="store_true",
                   help="the cost scheduler choosing every row drafting at every step (tables where it always pays)")
    p.add_argument("--plain-hold", type=int, default=None,
                   help="with --compact-plain or --compact-drafting: verify_plain_hold (steps a plain choice, or a "
                        "clear choice of every row drafting, holds; 1 = choose every step)")
    p.add_argument("--out", default=None, help="JSON path")
