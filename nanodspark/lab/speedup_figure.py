"""The picture of DSpark's thesis: total throughput over no speculation, against concurrency.

    python -m nanodspark.bench speedup-figure --measured serve_default.json serve_smol.json \\
        --predicted predict_8b.json --out speedup.png

The idea
    One axis of concurrency (requests in flight, log scale, 1 ... 256), one of total tok/s
    divided by no speculation's at the same concurrency (1.0: a dashed line, "no speculation").
    Per input file and system (static, compact): the measured curve solid with filled markers,
    the predicted one (`bench simulate`, `"kind": "prediction"`) dashed with hollow markers and
    "predicted" in its legend entry. Where the file holds paired repeats, the point is the median
    of the per-repeat ratios and the bar their range. The caption under the axes holds the
    commands that made the inputs. `pareto_figure` draws one sweep's per-user against total
    tok/s, the points of the Pareto front ringed. matplotlib, no display needed (Agg).

Invariants: a prediction is never drawn like a measurement; every curve's label names its file
(or `--labels`) and system; the figure says what was divided by what.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

COLORS = {"static": "#c8553d", "compact": "#2d6fb5", "compact-no-trim": "#7a7a7a", "static-b": "#b58e2d"}


def ratios(result: dict, system: str, workload: str = "mix") -> list[tuple[int, float, float, float]]:
    """(concurrency, ratio, low, high) of `system` over no-spec: paired medians where the file
    has them, else the ratio of its median rows (low = high = ratio)."""
    paired = {(p["concurrency"]): p for p in result.get("paired", [])
              if p["ratio"] == f"{system}/no-spec" and p.get("workload", "mix") == workload}
    rows = {(r["mode"], r["concurrency"]): r["total_tok_s"] for r in result.get("sweep", [])
            if r.get("workload", "mix") == workload}
    out = []
    for c in sorted({c for m, c in rows if m == system}):
        if c in paired:
            p = paired[c]
            out.append((c, p["median"], p["min"], p["max"]))
        elif rows.get(("no-spec", c)):
            q = rows[(system, c)] / rows[("no-spec", c)]
            out.append((c, q, q, q))
    return out


def speedup_figure(measured: list[dict], predicted: list[dict], path: str, labels: list[str] | None = None,
                   systems=("static", "compact"), title: str | None = None, workload: str = "mix") -> list[str]:
    """Draw the figure to `path`; returns its legend's labels."""
    import matplotlib.pyplot as plt
    fig = speedup_plot(measured, predicted, path, labels, systems, title, workload)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    plt.close(fig)
    return labels


def speedup_plot(measured: list[dict], predicted: list[dict], path: str, labels: list[str] | None = None,
                 systems=("static", "compact"), title: str | None = None, workload: str = "mix",
                 caption_end: str = ""):
    """`speedup_figure`, returning the matplotlib Figure (left open); `caption_end`: a last caption line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 5.2))
    names = labels or []
    commands, styles = [], ["o", "s", "^", "D", "v", "P"]
    drawn = 0
    for n, (res, pred) in enumerate([(r, False) for r in measured] + [(r, True) for r in predicted]):
        name = names[n] if n < len(names) else res.get("label_short") or Path(res.get("_path", f"run {n}")).stem
        commands.append(res.get("command", ""))
        for s in systems:
            pts = ratios(res, s, workload)
            if not pts:
                continue
            cs, q, lo, hi = zip(*pts)
            kind = "predicted" if pred or res.get("kind") == "prediction" else "measured"
            ax.errorbar(cs, q, yerr=[[a - b for a, b in zip(q, lo)], [b - a for a, b in zip(q, hi)]],
                        color=COLORS.get(s, "k"), marker=styles[n % len(styles)], capsize=3,
                        linestyle="--" if kind == "predicted" else "-",
                        markerfacecolor="none" if kind == "predicted" else COLORS.get(s, "k"),
                        label=f"{s}, {name} ({kind})")
            drawn += 1
    ax.axhline(1.0, color="k", linestyle=":", linewidth=1, label="no speculation")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight, closed loop)")
    ax.set_ylabel("total tok/s ÷ no speculation's")
    fig.suptitle(title or "Total throughput over no speculation, by concurrency")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))     # beside the axes: never over a curve
    caption = "\n".join([textwrap.shorten(c, 160) for c in dict.fromkeys(commands) if c]
                        + ([caption_end] if caption_end else []))
    fig.text(0.01, 0.01, caption, fontsize=6, family="monospace", va="bottom")
    fig.subplots_adjust(bottom=0.14 + 0.025 * caption.count("\n"), right=0.6)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    if not drawn:
        plt.close(fig)
        raise ValueError("no curve to draw: the inputs hold no system next to no-spec")
    return fig


def pareto_figure(result: dict, path: str, workload: str = "mix") -> str:
    """Per-user tok/s (x) against total tok/s (y), one line per system over the concurrencies,
    each point labelled with its concurrency, the Pareto front's points ringed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5))
    rows = [r for r in result["sweep"] if r.get("workload", "mix") == workload] or result["sweep"]
    front = {(p["mode"], p["concurrency"]) for p in result.get("pareto", []) if p.get("on_front")}
    for s in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r for r in rows if r["mode"] == s), key=lambda r: r["concurrency"])
        kw = dict(color=COLORS.get(s, "#444444"), marker="o")
        ax.plot([r["per_user_tok_s"] for r in pts], [r["total_tok_s"] for r in pts], label=s, **kw)
        for r in pts:
            ax.annotate(str(r["concurrency"]), (r["per_user_tok_s"], r["total_tok_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
            if (s, r["concurrency"]) in front:
                ax.plot(r["per_user_tok_s"], r["total_tok_s"], marker="o", markersize=12, markerfacecolor="none",
                        color="k")
    kind = "predicted" if result.get("kind") == "prediction" else "measured"
    ax.set_xlabel("per-user tok/s (median of (tokens − 1) / (end − first token))")
    ax.set_ylabel("total tok/s")
    ax.set_title(f"Per-user against total throughput ({kind}; labels: concurrency; ringed: Pareto front)",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, textwrap.shorten(result.get("command", ""), 160), fontsize=6, family="monospace")
    fig.subplots_adjust(bottom=0.15)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def _load(paths) -> list[dict]:
    out = []
    for p in paths or ():
        d = json.loads(Path(p).read_text())
        d["_path"] = p
        out.append(d)
    return out


def run(args) -> list[str]:
    labels = speedup_figure(_load(args.measured), _load(args.predicted), args.out, args.labels, args.systems,
                            args.title, args.workload)
    print(f"wrote {args.out}: " + "; ".join(labels))
    return labels


def add_args(p) -> None:
    p.add_argument("--measured", nargs="*", default=[], help="`bench serve` / `bench dspark` JSON files")
    p.add_argument("--predicted", nargs="*", default=[], help="`bench simulate` JSON files")
    p.add_argument("--labels", nargs="*", default=None, help="one name per file, measured first")
    p.add_argument("--systems", nargs="+", default=["static", "compact"],
                   help="speculative systems drawn (each over no-spec)")
    p.add_argument("--workload", default="mix", help="workload of the rows drawn")
    p.add_argument("--title", default=None, help="figure title (default: from the inputs)")
    p.add_argument("--out", default="speedup.png", help="the PNG to write")
