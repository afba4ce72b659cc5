"""The results page quotes its tables from the committed JSON (nanodspark/lab/report.py):
`bench report --check` passes on the page as committed, fails naming the table when a number
on it is changed, and every result file the page names exists and records its command."""
import json
import re
import shutil
from pathlib import Path

import pytest

from nanodspark.lab import report
from nanodspark.lab.bench import main as bench_main
from nanodspark.lab.report_figures import FIGURES

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "walkthrough" / "09_results.md"


def test_check_passes_on_the_committed_page(capsys):
    assert bench_main(["report", "--check", "--root", str(ROOT)]) == 0
    assert f"{len(FIGURES)} figures" in capsys.readouterr().out


def copy_of_the_repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "benchmarks", root / "benchmarks", ignore=shutil.ignore_patterns("*.png", "*.safetensors"))
    (root / "walkthrough").mkdir()
    shutil.copy(PAGE, root / "walkthrough" / PAGE.name)
    return root


def test_a_changed_number_fails_the_check_naming_its_figure(tmp_path, capsys):
    root = copy_of_the_repo(tmp_path)
    page = root / "walkthrough" / PAGE.name
    text = page.read_text()
    a, b = report.blocks(text)["thesis-steady-state"]
    lines = text.split("\n")
    row = next(i for i in range(a, b) if lines[i].startswith("| 256 |"))
    lines[row] = lines[row].replace("1.74", "1.79", 1)
    assert lines[row] != text.split("\n")[row]
    page.write_text("\n".join(lines))
    assert bench_main(["report", "--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "thesis-steady-state" in err and "steady_state_default_overlap_table_h200.json" in err and "1.79" in err
    assert bench_main(["report", "--write", "--root", str(root)]) == 0          # --write puts it back
    assert page.read_text() == text


def test_a_missing_block_or_an_unknown_one_fails_the_check(tmp_path):
    root = copy_of_the_repo(tmp_path)
    page = root / "walkthrough" / PAGE.name
    page.write_text(page.read_text().replace("<!-- report:tp -->", "<!-- report:no-such-figure -->"))
    bad = report.problems(root, page, FIGURES)
    assert any("'tp'" in b and "no block" in b for b in bad)
    assert any("'no-such-figure'" in b for b in bad)
    (root / "benchmarks" / "eplb_h200.json").write_text('{"command": "x", "rows": []}')
    bad = report.problems(root, page, FIGURES)
    assert any("'eplb'" in b and "cannot be read" in b and "eplb_h200.json" in b for b in bad)
    (root / "benchmarks" / "sampling_h200.json").unlink()
    assert any("sampling_h200.json does not exist" in b for b in report.problems(root, page, FIGURES))


def test_every_result_file_the_page_names_exists_and_records_a_command():
    text = PAGE.read_text()
    named = set(re.findall(r"benchmarks/[\w/.-]+\.json", text))
    named |= {rel for fig in FIGURES for rel in fig.files.values()}
    assert len(named) > 20
    for rel in sorted(named):
        path = ROOT / rel
        assert path.exists(), f"09_results.md names {rel}, which is not committed"
        assert report.recorded_command(json.loads(path.read_text())), f"{rel} records no command"


def test_every_figure_has_a_block_on_the_page_and_the_thesis_section_exists():
    text = PAGE.read_text()
    assert set(report.blocks(text)) == {f.name for f in FIGURES}
    assert "\n## DSpark's thesis: compact against static at load\n" in text


def test_queries():
    doc = {"rows": [{"system": "a", "batch": 1, "d": None, "v": 2.0}, {"system": "a", "batch": 1, "d": "x", "v": 6.0}],
           "t": {"only": {"m": [[1, 0, 0.5], [1, 5, 0.75]]}}, "T=0": {"tau": 3}}
    assert report.get(doc, "rows[system=a,d=null].v") == 2.0
    assert report.get(doc, "rows[d=*].v") == 6.0
    assert report.get(doc, "t.*.m[0=1,1=5].2") == 0.75
    assert report.get(doc, "T=0.tau") == 3
    assert report.evaluate({"x": doc}, "x", "rows[d=*].v / rows[d=null].v * 100") == 300
    assert report.cell({"x": doc}, "x", "<rows[d=*].v|.1f> ({n})", {"n": "six"}) == "6.0 (six)"
    with pytest.raises(KeyError):
        report.get(doc, "rows[system=a].v")                     # two rows match: ambiguous


def test_recorded_commands_are_written_as_they_run_today():
    assert report.recorded_command({"argv": "/work/x/nanodspark/bench.py engine --out /root/out/e.json"}) == \
        "python -m nanodspark.bench engine --out $OUT/e.json"
    assert report.recorded_command({"k": {"notes": {"command": "python -m nanodspark.bench profile"}}}) == \
        "python -m nanodspark.bench profile"
    assert report.recorded_command({"rows": []}) is None


def test_a_path_names_a_cost_files_table_by_its_model_name():
    """`@NAME` picks the one table whose key's model name is NAME (a key holds dots, so it
    cannot be a dotted path), and refuses a name no table or several carry."""
    doc = {"m|torch.bfloat16|cuda|tiers=": {"raw": [[4, 0, 1.0]]},
           "m (draft 0)|torch.bfloat16|cuda|tiers=": {"raw": [[4, 0, 2.0]]}}
    assert report.get(doc, "@m (draft 0).raw[0=4,1=0].2") == 2.0
    assert report.get(doc, "@m.raw[0=4,1=0].2") == 1.0
    with pytest.raises(KeyError, match="names 0 tables"):
        report.get(doc, "@m (no drafter).raw")
