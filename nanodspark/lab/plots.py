"""Figures of measurements, drawn with matplotlib (the `lab` extra: `pip install -e ".[lab]"`).

The idea
    One function per kind of figure. Each takes the data (a benchmark's JSON as a dict, or
    tensors), the PNG path and a `caption=` (what was measured and the command that measured
    it; `command_caption` turns a JSON's recorded `argv` into that line), draws with
    matplotlib's object API on the Agg canvas (no pyplot, no global state, no display), writes
    the PNG and returns the `Figure`, whose artists (`figure_texts`) the tests read: axis labels
    with units, tick values, a legend, a title and the caption are the contract, not pixels.

    `lines` is the general one (series of x, y); `pareto` draws a `bench dspark` sweep
    (per-user against total tok/s, and total tok/s against concurrency); `timeline` the host
    phases over the GPU kernels of a `bench timeline` trace; `reliability` the confidence head's
    calibration (calibration.py); `kv_blocks` the states of a BlockManager's blocks over a few
    calls (lab/figures.py records a real run).

Invariants
    * Drawing reads its inputs and changes nothing; the bins are `calibration.reliability`'s,
      the temperatures `calibration.fit_sts`'s when not given.
    * matplotlib is imported when a figure is drawn, never at import: without it a drawing
      function raises `ModuleNotFoundError` with the install line (`MISSING`).

Used by `train_heads.py` (reliability.png), `python -m nanodspark.bench dspark | pareto |
timeline | figures` (`lab/figures.py` redraws every committed figure from its JSON). Walkthrough
chapters 02 (KV blocks), 06 (reliability), 09 (Pareto), 11 (timeline).
"""
from __future__ import annotations

import textwrap
from pathlib import Path

MISSING = 'figures need matplotlib, which is not installed: pip install -e ".[lab]"'
MODE_STYLE = {"no-spec": ("#555555", "o", "no speculation"), "static": ("#d62728", "s", "static (full blocks)"),
              "compact": ("#1f77b4", "^", "compact (cost scheduler)"),
              "compact-no-trim": ("#9467bd", "v", "compact, never trims"),
              "static-b": ("#ff7f0e", "D", "static, A/A copy")}
PHASE_COLOURS = {"schedule": "#1f77b4", "launch": "#ff7f0e", "result": "#bbbbbb", "commit": "#2ca02c"}
PHASE_ALIASES = {"wait": "result"}      # the phase's name in timelines recorded before it was renamed
KERNEL_COLOUR = "#d62728"


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ModuleNotFoundError(MISSING) from None
    return Figure(figsize=(width, height), layout="constrained")


def _save(fig, path, caption: str | None, title: str | None = None):
    """Title on top, the caption (wrapped) in a band the layout keeps free at the bottom."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    if title:
        fig.suptitle(title, fontsize=11, fontweight="bold")
    if caption:
        width_in, height_in = fig.get_size_inches()
        chars = int(width_in * 15)                       # ~15 characters per inch at 7.5 pt
        lines = [w for part in caption.split("\n") for w in (textwrap.wrap(part, chars) or [""])]
        band = (0.13 * len(lines) + 0.08) / height_in
        fig.get_layout_engine().set(rect=(0, band, 1, 1 - band))
        fig.text(0.01, band - 0.02 / height_in, "\n".join(lines), ha="left", va="top", fontsize=7.5,
                 color="#333333", linespacing=1.25)
    FigureCanvasAgg(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, facecolor="white")
    return fig


def figure_texts(fig) -> dict:
    """The text a figure carries, by role (what the tests check): title, caption, and per axes
    its title, x/y labels, tick labels and legend entries."""
    axes = []
    for ax in fig.axes:
        leg = ax.get_legend()
        axes.append({"title": " ".join(x for x in (ax.get_title("left"), ax.get_title(), ax.get_title("right")) if x),
                     "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                     "xticks": [t.get_text() for t in ax.get_xticklabels() if t.get_text()],
                     "yticks": [t.get_text() for t in ax.get_yticklabels() if t.get_text()],
                     "legend": [t.get_text() for t in leg.get_texts()] if leg else []})
    sup = fig._suptitle.get_text() if fig._suptitle else ""
    return {"title": sup, "caption": "\n".join(t.get_text() for t in fig.texts), "axes": axes}


def command_caption(result: dict) -> str:
    """`measured on DEVICE by: python -m nanodspark.bench ...` from a result's recorded argv."""
    argv = result.get("argv") or result.get("command") or ""
    argv = " ".join(argv) if isinstance(argv, list) else str(argv)
    for entry in ("nanodspark/bench.py", "nanodspark/lab/bench.py"):
        if entry in argv:
            argv = "python -m nanodspark.bench" + argv.split(entry, 1)[1]
    device = result.get("device") or "?"
    return f"measured on {device}" + (f" by: {argv}" if argv else "")


# ----------------------------------------------------------------------------- general
def lines(series: dict, path, *, title: str, xlabel: str, ylabel: str, caption: str | None = None,
          logx: bool = False, logy: bool = False, size=(6.4, 4.2)):
    """One line per series: {label: (xs, ys)} (or {label: (xs, ys, {matplotlib kwargs})})."""
    fig = _figure(*size)
    ax = fig.add_subplot()
    for label, s in series.items():
        xs, ys, *kw = s
        ax.plot(xs, ys, marker="o", label=label, **(kw[0] if kw else {}))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, caption, title)


# ----------------------------------------------------------------------------- the economics sweep
def _sweep_rows(result: dict, workload: str) -> list[dict]:
    rows = [r for r in result["sweep"] if r.get("workload", "mix") == workload]
    if not rows:                     # a sweep without the mix: its first workload
        workload = result["sweep"][0].get("workload", "mix")
        rows = [r for r in result["sweep"] if r.get("workload", "mix") == workload]
    return rows


def pareto(result: dict, path, *, caption: str | None = None, workload: str = "mix", title: str | None = None):
    """A `bench dspark` sweep: left, per-user against total tok/s (one line per mode over the
    concurrencies, each point labelled with its concurrency); right, total tok/s against
    concurrency (the concurrency curve), with speculation's ratio over none."""
    from matplotlib.ticker import FuncFormatter
    rows = _sweep_rows(result, workload)
    wl = rows[0].get("workload", "mix")
    fig = _figure(11, 4.6)
    left, right = fig.subplots(1, 2)
    modes = [m for m in MODE_STYLE if any(r["mode"] == m for r in rows)]
    conc = sorted({r["concurrency"] for r in rows})
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    for m in modes:
        colour, marker, label = MODE_STYLE[m]
        pts = [by[(m, c)] for c in conc if (m, c) in by]
        xs, ys = [r["per_user_tok_s"] for r in pts], [r["total_tok_s"] for r in pts]
        left.plot(xs, ys, marker=marker, color=colour, label=label)
        if m in ("no-spec", "static"):
            for r, x, y in zip(pts, xs, ys):
                left.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(5, 4),
                              fontsize=7, color=colour)
        right.plot([r["concurrency"] for r in pts], ys, marker=marker, color=colour, label=label)
    if "no-spec" in modes and "static" in modes:
        for c in conc:
            if ("no-spec", c) in by and ("static", c) in by:
                ratio = by[("static", c)]["total_tok_s"] / by[("no-spec", c)]["total_tok_s"]
                right.annotate(f"{ratio:.2f}×", (c, by[("static", c)]["total_tok_s"]), textcoords="offset points",
                               xytext=(0, 8), ha="center", fontsize=7, color=MODE_STYLE["static"][0])
    thousands = FuncFormatter(lambda v, _: f"{v:,.0f}")
    left.set_xlabel("per-user decode rate (tok/s per request)")
    left.set_ylabel("total throughput (tok/s)")
    left.set_title("Pareto: each request's speed against the total", fontsize=9)
    left.set_xlim(0, 1.12 * max(r["per_user_tok_s"] for r in rows))
    right.set_xscale("log", base=2)
    right.set_xticks(conc, [str(c) for c in conc])
    right.set_xlabel("concurrent requests")
    right.set_ylabel("total throughput (tok/s)")
    right.set_title("throughput against concurrency (label: static / no speculation)", fontsize=9)
    top = 1.12 * max(r["total_tok_s"] for r in rows)
    left.set_ylim(0, top)
    right.set_ylim(0, top)
    for ax in (left, right):
        ax.yaxis.set_major_formatter(thousands)
        ax.grid(alpha=0.3)
    right.legend(fontsize=7, loc="upper left")      # one legend: the same modes on both sides
    others = sorted({r.get("workload", "mix") for r in result["sweep"]} - {wl})
    wl += f" (the JSON also has {', '.join(others)})" if others else ""
    title = title or (f"DSpark economics, workload {wl}, T = {result.get('temperature', 0):g}, "
                      f"{result.get('max_tokens', '?')} new tokens, on {result.get('device', '?')}")
    return _save(fig, path, caption, title)


# ----------------------------------------------------------------------------- step timeline
def gpu_busy(intervals, span: float) -> float:
    """Share of [0, span] during which at least one kernel runs: the union of the intervals
    (the profiler reports some events nested inside others; a sum would count them twice)."""
    busy, end = 0.0, float("-inf")
    for _, s, e in sorted(intervals, key=lambda x: x[1]):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / span if span else 0.0


def timeline(result: dict, path, *, caption: str | None = None, title: str | None = None,
             window_ms: tuple[float, float] | None = None):
    """A `bench timeline` result: per loop (sync, overlap) a host lane of the engine loop's
    phases over a GPU lane of kernels, on one time axis in ms; `window_ms` zooms in."""
    from matplotlib.patches import Patch
    traces = result["traces"]
    rows = {r["loop"]: r for r in result.get("rows", [])}
    fig = _figure(11, 1.5 + 1.45 * len(traces))
    axes = fig.subplots(len(traces), 1, sharex=True, squeeze=False)[:, 0]
    names = {"sync": "synchronous loop", "overlap": "overlapped loop"}
    for ax, (loop, t) in zip(axes, traces.items()):
        for phase, colour in PHASE_COLOURS.items():
            bars = [(s / 1e3, (e - s) / 1e3) for n, s, e in t["host"] if PHASE_ALIASES.get(n, n) == phase]
            ax.broken_barh(bars, (1.1, 0.8), facecolors=colour)
        ax.broken_barh([(s / 1e3, (e - s) / 1e3) for _, s, e in t["gpu"]], (0.1, 0.8), facecolors=KERNEL_COLOUR)
        ax.set_yticks([0.5, 1.5], ["GPU kernels", "host"])
        ax.set_ylim(0, 2)
        if window_ms:                 # zoomed in: name the phases on their bars
            lo, hi = window_ms
            for n, s, e in t["host"]:
                a, b = max(s / 1e3, lo), min(e / 1e3, hi)
                if b - a > 0.06 * (hi - lo):
                    ax.text((a + b) / 2, 1.5, n, ha="center", va="center", fontsize=8)
        r, span = rows.get(loop, {}), max([e for _, _, e in t["host"] + t["gpu"]], default=0.0)
        steps = f"{r['steps']} steps in " if r.get("steps") else ""
        busy = f", a kernel running {100 * gpu_busy(t['gpu'], span):.0f} % of the time" if span and t["gpu"] else ""
        ax.set_title(f"{names.get(loop, loop)}: {steps}{span / 1e3:.1f} ms{busy}", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time since the first traced event (ms)")
    if window_ms:
        axes[-1].set_xlim(*window_ms)
    handles = [Patch(color=c, label=f"host: {p}") for p, c in PHASE_COLOURS.items()]
    handles.append(Patch(color=KERNEL_COLOUR, label="GPU: a kernel"))
    axes[0].legend(handles=handles, fontsize=7, ncol=5, loc="lower right", bbox_to_anchor=(1, 1.18), frameon=False)
    title = title or (f"Decode steps, host over GPU: {result.get('model', '?')}, batch {result.get('batch', '?')}, "
                      f"on {result.get('device', '?')}")
    return _save(fig, path, caption, title)


# ----------------------------------------------------------------------------- reliability
def reliability(logits, labels, path, *, valid=None, temps=None, shifts=None, caption: str | None = None,
                title: str | None = None, n_bins: int | None = None, min_count: int = 20):
    """Reliability diagrams of cumulative survival, one column per draft position: the raw head
    (T = 1) and the calibrated one (STS `temps`, fitted if None, with `shifts` if given), mean
    predicted survival against the observed prefix acceptance rate per bin, the diagonal being
    perfect calibration (a bin of fewer than `min_count` proposals is a hollow marker off the
    line); below, how many proposals fall in each bin after calibration."""
    import torch

    from ..calibration import N_BINS, apply_temperatures, as_float64, ece, fit_sts, reliability as bins_of, survival
    n_bins = n_bins or N_BINS
    z = as_float64(logits)
    temps = fit_sts(z, labels, valid, n_bins=n_bins) if temps is None else as_float64(temps)
    v = torch.ones_like(z, dtype=torch.bool) if valid is None else torch.as_tensor(valid).cpu().bool()
    cal = survival(apply_temperatures(z, temps, None if shifts is None else as_float64(shifts)))
    raw, y = survival(torch.sigmoid(z)), as_float64(labels)
    gamma = z.shape[-1]
    fig = _figure(2.3 * gamma + 0.6, 4.9)
    grid = fig.add_gridspec(2, gamma, height_ratios=(3, 1))
    top = [fig.add_subplot(grid[0, k]) for k in range(gamma)]
    bottom = [fig.add_subplot(grid[1, k], sharex=top[k]) for k in range(gamma)]
    cal_name = "STS + shift" if shifts is not None else "STS"
    for k in range(gamma):
        m = v[:, k]
        rb, cb = bins_of(raw[m, k], y[m, k], n_bins), bins_of(cal[m, k], y[m, k], n_bins)
        ax = top[k]
        ax.plot([0, 1], [0, 1], ls="--", color="#888888", lw=1, label="perfect")
        for b, p, colour, marker, name in ((rb, raw, "#d62728", "o", "raw head"),
                                           (cb, cal, "#1f77b4", "s", cal_name)):
            dense, sparse = b.count >= min_count, (b.count > 0) & (b.count < min_count)
            e = ece(p[m, k], y[m, k], n_bins)
            ax.plot(b.mean_pred[dense].numpy(), b.mean_label[dense].numpy(), marker=marker, ms=3.5, lw=1,
                    color=colour, label=f"{name}, ECE {100 * e:.1f} %")
            ax.plot(b.mean_pred[sparse].numpy(), b.mean_label[sparse].numpy(), marker=marker, ms=3.5, lw=0,
                    markerfacecolor="none", color=colour)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {k + 1}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left")
        ax.tick_params(labelsize=7)
        if k == 0:
            ax.set_ylabel("observed prefix acceptance rate")
        centres = ((cb.edges[:-1] + cb.edges[1:]) / 2).numpy()
        bottom[k].bar(centres, cb.count.numpy(), width=1 / n_bins, color="#999999")
        bottom[k].set_xlabel("mean predicted survival")
        bottom[k].tick_params(labelsize=7)
        if k == 0:
            bottom[k].set_ylabel("proposals\nper bin", fontsize=8)
    title = title or (f"Confidence head calibration: raw against {cal_name}, {int(v.sum()):,} proposal positions "
                      f"(hollow: a bin of fewer than {min_count})")
    return _save(fig, path, caption, title)


# ----------------------------------------------------------------------------- KV blocks
KV_STATES = {"free": ("#ffffff", "free"), "cached": ("#c6dbef", "free, still cached (evictable)"),
             "owned": ("#fdae6b", "held by one table, unpublished"),
             "published": ("#6baed6", "held, published in the prefix cache"),
             "shared": ("#9e9ac8", "shared by two tables (published)")}


def kv_blocks(snapshots: list[dict], path, *, caption: str | None = None, title: str | None = None):
    """The pool's blocks after each call of a run: one row per snapshot {"call": str, "blocks":
    [{"state": KV_STATES key, "owners": "A" | "A,B" | ""}, ...], "tables": {name: [block ids]}},
    one column per physical block; each cell names its owners and shows its ref count."""
    from matplotlib.patches import Patch, Rectangle
    n_blocks = len(snapshots[0]["blocks"])
    fig = _figure(2.6 + 0.62 * n_blocks + 2.6, 0.9 + 0.5 * len(snapshots))
    ax = fig.add_subplot()
    for i, snap in enumerate(snapshots):
        y = len(snapshots) - 1 - i
        for b, cell in enumerate(snap["blocks"]):
            ax.add_patch(Rectangle((b, y + 0.08), 0.92, 0.84, facecolor=KV_STATES[cell["state"]][0],
                                   edgecolor="#444444", lw=0.8, hatch="//" if cell["state"] == "cached" else None))
            if cell["owners"]:
                ax.text(b + 0.46, y + 0.5, cell["owners"], ha="center", va="center", fontsize=7.5)
        tables = "   ".join(f"{k}: {v}" for k, v in snap.get("tables", {}).items())
        ax.text(n_blocks + 0.15, y + 0.5, tables, ha="left", va="center", fontsize=7, family="monospace")
    ax.set_xlim(0, n_blocks + 2.6 * n_blocks / 8 + 1.2)
    ax.set_ylim(0, len(snapshots))
    ax.set_xticks([b + 0.46 for b in range(n_blocks)], [str(b) for b in range(n_blocks)])
    ax.set_yticks([len(snapshots) - 0.5 - i for i in range(len(snapshots))], [s["call"] for s in snapshots],
                  fontsize=7.5)
    ax.set_xlabel("physical block id (cell text: the tables that hold it; right: each table's block list, "
                  "-1 = released)")
    ax.set_ylabel("after the call")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.spines["bottom"].set_bounds(0, n_blocks)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#444444", hatch="//" if s == "cached" else None, label=lab)
                       for s, (c, lab) in KV_STATES.items()], fontsize=7, ncol=3, loc="lower left",
              bbox_to_anchor=(0, 1.0), frameon=False)
    return _save(fig, path, caption, title or "Paged KV: the states of a pool's blocks, call by call")
