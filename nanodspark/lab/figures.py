"""Every committed figure and how it is drawn from its data: `python -m nanodspark.bench figures`.

Each entry of `FIGURES` names a PNG under `benchmarks/`, the data it is drawn from (a committed
JSON, the shipped calibration records, or a run made here on the CPU) and the function of
`plots.py` that draws it, so that every picture in the repository can be redrawn in seconds on
any machine and none is drawn by hand. The caption of each names the command that measured the
data and the command that drew it.

`kv_block_run` is the run behind the KV block figure: a real `BlockManager` (paged_kv.py) of 8
blocks of 4 tokens going through the calls the paged-KV chapter walks through (a prompt, a prefix hit, a
speculative window reserved and rolled back, a sliding window's release, frees and a hit on a
freed, still cached prefix), with the pool's invariants checked after every call.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import plots

DRAWN_BY = "drawn by: python -m nanodspark.bench figures --only {name}"


@dataclass
class FigureSpec:
    name: str            # the PNG's path under the root, without .png
    kind: str            # pareto | timeline | timeline-steps | reliability | kv-blocks | speedup
    data: str | None     # the data file under the root
    predicted: tuple = ()   # speedup: predictions drawn beside the measured data
    labels: tuple = ()      # speedup: one name per file, measured first
    measured: tuple = ()    # speedup: more measured files, drawn after `data`


FIGURES = [
    FigureSpec("benchmarks/dspark_pareto_h200", "pareto", "benchmarks/dspark_bench_h200.json"),
    FigureSpec("benchmarks/dspark_pareto_workloads_h200", "pareto", "benchmarks/dspark_workloads_h200.json"),
    FigureSpec("benchmarks/dspark_graphs_h200", "pareto", "benchmarks/dspark_graphs_h200.json"),
    FigureSpec("benchmarks/timeline_bs1_h200", "timeline", "benchmarks/timeline_bs1_h200.json"),
    FigureSpec("benchmarks/timeline_bs64_h200", "timeline", "benchmarks/timeline_bs64_h200.json"),
    FigureSpec("benchmarks/timeline_bs1_h200_steps", "timeline-steps", "benchmarks/timeline_bs1_h200.json"),
    FigureSpec("benchmarks/drafter/reliability", "reliability", "benchmarks/drafter/train_heads_report.json"),
    FigureSpec("benchmarks/kv_blocks_cpu", "kv-blocks", None),
    FigureSpec("benchmarks/dspark_speedup_h200", "speedup", "benchmarks/steady_state_default_static_fallback_h200.json",
               ("benchmarks/prediction_qwen3_8b_tau3.21_h200.json", "benchmarks/prediction_qwen3_8b_tau6.17_h200.json",
                "benchmarks/prediction_qwen3_30b_a3b_tau3.21_h200.json"),
               ("default pair", "SmolLM2-135M pair (eager prefill, text in the step)",
                "SmolLM2-135M shapes, synthetic acceptance, tau 1.8",
                "Qwen3-8B shape, synthetic acceptance, tau 3.1",
                "Qwen3-8B shape, tau 3.21", "Qwen3-8B shape, tau 6.17", "Qwen3-30B-A3B shape, tau 3.21"),
               ("benchmarks/steady_state_smollm2_h200.json", "benchmarks/steady_state_smollm2_shape_final_h200.json",
                "benchmarks/steady_state_qwen3_8b_law0.475-0.97_h200.json")),
]
RECORDS = "benchmarks/drafter/calibration_records.safetensors"


# ----------------------------------------------------------------------------- the KV run
def _kv_snapshot(m, call: str, tables: dict) -> dict:
    m.check_invariants(tables.values())
    cells = []
    for b in range(m.num_blocks):
        owners = ",".join(n for n, t in tables.items() if b in t.blocks)
        ref, published = m.ref_count[b], m.block_hash[b] is not None
        state = ("cached" if published else "free") if ref == 0 else \
            "shared" if ref > 1 else "published" if published else "owned"
        cells.append({"state": state, "owners": owners, "ref": ref})
    return {"call": call, "blocks": cells, "tables": {n: list(t.blocks) for n, t in tables.items()}}


def kv_block_run() -> list[dict]:
    """Snapshots of a real BlockManager's pool after each call (see the module docstring)."""
    from ..paged_kv import BlockManager
    m, tables, snaps = BlockManager(num_blocks=8, block_size=4), {}, []
    tables["A"] = m.allocate_prompt(list(range(10)))
    snaps.append(_kv_snapshot(m, "A = allocate_prompt(10 tokens)", tables))
    m.commit(tables["A"], list(range(10)))
    snaps.append(_kv_snapshot(m, "commit(A, 10 tokens)", tables))
    tables["B"] = m.allocate_prompt(list(range(8)) + [42, 43])
    snaps.append(_kv_snapshot(m, "B = allocate_prompt(A's first 8 + 2)", tables))
    m.ensure_capacity(tables["A"], 10 + 5)
    snaps.append(_kv_snapshot(m, "ensure_capacity(A, 10 + window 5)", tables))
    m.truncate(tables["A"], 10 + 2)
    snaps.append(_kv_snapshot(m, "truncate(A, 12): 2 drafts accepted", tables))
    m.commit(tables["A"], list(range(12)))
    snaps.append(_kv_snapshot(m, "commit(A, 12 tokens)", tables))
    m.release_outside_window(tables["A"], window=4, num_committed=12)
    snaps.append(_kv_snapshot(m, "release_outside_window(A, W = 4)", tables))
    m.free(tables.pop("A"))
    snaps.append(_kv_snapshot(m, "free(A)", tables))
    m.free(tables.pop("B"))
    snaps.append(_kv_snapshot(m, "free(B)", tables))
    tables["C"] = m.allocate_prompt(list(range(12)) + [7])
    snaps.append(_kv_snapshot(m, "C = allocate_prompt(A's first 12 + 1)", tables))
    return snaps


# ----------------------------------------------------------------------------- drawing
def draw(spec: FigureSpec, root: Path = Path("."), out_dir: Path | None = None):
    """Draw one figure from its data; returns (the PNG's path, the matplotlib Figure)."""
    out = (out_dir / Path(spec.name).name if out_dir else root / spec.name).with_suffix(".png")
    drawn = DRAWN_BY.format(name=Path(spec.name).name)
    data = json.loads((root / spec.data).read_text()) if spec.data else None
    if spec.kind == "pareto":
        fig = plots.pareto(data, out, caption=f"Data: {spec.data}, {plots.command_caption(data)}\n{drawn}")
    elif spec.kind in ("timeline", "timeline-steps"):
        caption = f"Data: {spec.data} (torch.profiler), {plots.command_caption(data)}\n{drawn}"
        window = None
        if spec.kind == "timeline-steps":     # two steps of the overlapped loop, from its second schedule on
            starts = [s / 1e3 for n, s, _ in data["traces"]["overlap"]["host"] if n == "schedule"]
            window = (starts[1] - 0.2, starts[3] + 0.2) if len(starts) > 3 else None
            data = {**data, "traces": {"overlap": data["traces"]["overlap"]},
                    "rows": [r for r in data.get("rows", []) if r["loop"] == "overlap"]}
        fig = plots.timeline(data, out, caption=caption, window_ms=window,
                             title=None if window is None else
                             f"Two decode steps of the overlapped loop: {data.get('model')}, batch {data.get('batch')}, "
                             f"on {data.get('device')}")
    elif spec.kind == "reliability":
        from safetensors.torch import load_file
        rec, cal = load_file(str(root / RECORDS)), data["calibration"]
        fig = plots.reliability(rec["held.z"], rec["held.labels"], out, valid=rec["held.valid"],
                                temps=cal["temperatures"], shifts=cal.get("shifts"),
                                caption=f"Data: {RECORDS} (the held-out half) and the fit of {spec.data}; "
                                        f"{plots.command_caption(data)}\n{drawn}")
    elif spec.kind == "kv-blocks":
        fig = plots.kv_blocks(kv_block_run(), out,
                              caption="Data: a real BlockManager (nanodspark/paged_kv.py), 8 blocks of 4 tokens, "
                                      "run on the CPU by nanodspark/lab/figures.py kv_block_run: the calls the "
                                      "paged-KV chapter walks through, the pool's invariants checked after each.\n"
                                      + drawn)
    elif spec.kind == "speedup":
        from .speedup_figure import speedup_plot
        preds = [json.loads((root / p).read_text()) for p in spec.predicted]
        more = [json.loads((root / p).read_text()) for p in spec.measured]
        fig = speedup_plot([data, *more], preds, str(out), labels=list(spec.labels),
                           title="Speculation over no speculation at load, H200",
                           caption_end=f"Data: {', '.join((spec.data, *spec.measured, *spec.predicted))}; {drawn}")
    else:
        raise ValueError(f"unknown figure kind {spec.kind!r}")
    return out, fig


def figures(args) -> list[str]:
    root, out_dir = Path(args.root), Path(args.out_dir) if args.out_dir else None
    names = {Path(s.name).name: s for s in FIGURES}
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        raise SystemExit(f"unknown figure(s) {unknown}; the figures are {sorted(names)}")
    if not (root / "benchmarks").is_dir():
        raise SystemExit(f"no benchmarks/ under {root.resolve()}: run from the repository root, or pass --root")
    done = []
    for name in args.only or names:
        path, _ = draw(names[name], root, out_dir)
        print("wrote", path)
        done.append(str(path))
    return done


def add_figures_args(p) -> None:
    p.add_argument("--only", nargs="+", metavar="NAME", help="draw only these figures (PNG names without .png)")
    p.add_argument("--root", default=".", help="the repository root the data is read from")
    p.add_argument("--out-dir", default=None, help="write the PNGs here instead of next to their data")
