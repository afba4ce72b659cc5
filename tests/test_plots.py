"""The figures (nanodspark/lab/plots.py, lab/figures.py) carry their text: a title, axis labels
with units, tick values, a legend and a caption naming the command. Checked on matplotlib's
artists, not on pixels; every committed figure is drawn again from its committed data."""
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

from nanodspark.lab import figures, plots  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def readable(fig, *, units=True) -> dict:
    """Assert the contract of every figure; return its texts."""
    t = plots.figure_texts(fig)
    assert t["title"], "no title"
    assert "python -m nanodspark" in t["caption"] or "train_heads.py" in t["caption"], t["caption"]
    labelled = [a for a in t["axes"] if a["xlabel"] and a["ylabel"]]
    assert labelled, "no axes with both labels"
    for a in labelled:
        assert a["xticks"] and a["yticks"], f"no tick values on {a['xlabel']!r}"
        if units:
            assert "(" in a["xlabel"] + a["ylabel"] or "rate" in a["ylabel"], f"no unit in {a}"
    assert any(a["legend"] for a in t["axes"]), "no legend"
    return t


def test_lines_has_every_label_and_writes_a_png(tmp_path):
    fig = plots.lines({"a": ([1, 2, 4], [3, 5, 4]), "b": ([1, 2, 4], [1, 2, 3], {"ls": "--"})}, tmp_path / "l.png",
                      title="T", xlabel="batch (requests)", ylabel="tok/s (tokens per second)",
                      caption="python -m nanodspark.bench x", logx=True)
    t = readable(fig)
    assert t["axes"][0]["legend"] == ["a", "b"] and (tmp_path / "l.png").read_bytes()[:4] == b"\x89PNG"


def test_pareto_of_a_sweep(tmp_path):
    result = json.loads((ROOT / "benchmarks" / "dspark_bench_h200.json").read_text())
    fig = plots.pareto(result, tmp_path / "p.png", caption=plots.command_caption(result))
    t = readable(fig)
    assert "python -m nanodspark.bench dspark --cost-table" in t["caption"]      # the recorded argv, runnable
    assert "H200" in t["title"] and "mix" in t["title"]
    right = t["axes"][1]
    assert right["xticks"] == ["16", "64", "256"] and "no speculation" in right["legend"]
    ratios = [x.get_text() for x in fig.axes[1].texts]
    assert "1.40×" in ratios                          # static / no-spec at 16, as chapter 09's table


def test_timeline_reports_the_union_of_kernel_time(tmp_path):
    assert plots.gpu_busy([("k", 0, 10), ("k", 2, 4), ("k", 20, 30)], 40) == pytest.approx(0.5)   # nested once
    result = json.loads((ROOT / "benchmarks" / "timeline_bs1_h200.json").read_text())
    fig = plots.timeline(result, tmp_path / "t.png", caption=plots.command_caption(result))
    t = plots.figure_texts(fig)
    assert t["title"] and t["axes"][-1]["xlabel"].endswith("(ms)") and t["axes"][0]["yticks"] == ["GPU kernels", "host"]
    assert "host: commit" in t["axes"][0]["legend"] and "python -m nanodspark.bench timeline" in t["caption"]
    assert "a kernel running 66 % of the time" in t["axes"][1]["title"]        # not the JSON's 0.904


def test_reliability_diagram(tmp_path):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3000, 3, generator=g)
    y = (torch.rand(3000, 3, generator=g) < torch.sigmoid(z).cumprod(-1)).float()
    fig = plots.reliability(z, y, tmp_path / "r.png", caption="written by: train_heads.py --phases calibrate")
    t = readable(fig, units=False)
    assert [a["title"] for a in t["axes"][:3]] == ["position 1", "position 2", "position 3"]
    assert any("ECE" in s for s in t["axes"][0]["legend"]) and t["axes"][3]["xlabel"] == "mean predicted survival"


def test_kv_block_run_is_a_real_pool_and_its_figure_names_the_states(tmp_path):
    snaps = figures.kv_block_run()
    states = [[c["state"] for c in s["blocks"]] for s in snaps]
    assert states[2][:4] == ["shared", "shared", "owned", "owned"]               # B hit A's two published blocks
    assert states[8][:3] == ["cached", "cached", "cached"]                       # freed, still in the prefix cache
    assert snaps[-1]["tables"]["C"][:3] == [0, 1, 2] and states[-1][:3] == ["published"] * 3   # C hit them
    fig = plots.kv_blocks(snaps, tmp_path / "kv.png", caption="python -m nanodspark.bench figures")
    t = plots.figure_texts(fig)
    assert t["axes"][0]["yticks"][0] == "A = allocate_prompt(10 tokens)" and t["axes"][0]["xticks"][:2] == ["0", "1"]
    assert "free, still cached (evictable)" in t["axes"][0]["legend"] and t["title"]


@pytest.mark.parametrize("spec", figures.FIGURES, ids=lambda s: Path(s.name).name)
def test_every_committed_figure_is_drawn_from_its_data(spec, tmp_path):
    assert (ROOT / spec.name).with_suffix(".png").exists(), f"{spec.name}.png is not committed"
    path, fig = figures.draw(spec, ROOT, tmp_path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    t = plots.figure_texts(fig)
    assert t["title"] and f"--only {Path(spec.name).name}" in t["caption"]
    assert any(a["legend"] for a in t["axes"]) and all(a["xticks"] for a in t["axes"] if a["xlabel"])


def test_every_committed_png_is_in_the_list():
    listed = {(ROOT / s.name).with_suffix(".png") for s in figures.FIGURES}
    committed = {p for p in (ROOT / "benchmarks").rglob("*.png")}
    assert committed <= listed, f"drawn by nothing: {sorted(map(str, committed - listed))}"


def test_no_matplotlib_is_one_clear_line(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(ModuleNotFoundError, match=r'pip install -e "\.\[lab\]"'):
        plots.lines({"a": ([1], [1])}, "/nonexistent/x.png", title="t", xlabel="x", ylabel="y")
