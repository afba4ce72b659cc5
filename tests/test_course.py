"""The course (nanodspark/lab/course.py): student regions are well formed, starters are generated
from the reference and import, every graded test exists, and — the promise of the course — the
reference passes every unit while a fresh starter fails every unit with a message that says
what to implement. CI checks that on each unit's quick tests (two pytest processes); `-m slow`
runs the whole grade both ways."""
import ast
import re
from pathlib import Path

import pytest

from nanodspark.lab import course

ROOT = Path(__file__).resolve().parents[1]


def test_every_unit_has_regions_and_every_region_a_registered_unit():
    regions = course.all_regions()
    names = {u.name for u in course.UNITS}
    assert len(names) == len(course.UNITS)
    assert {r.unit for r in regions} <= names, "a marker names a unit that is not registered"
    for u in course.UNITS:
        assert course.unit_files(u.name), f"unit {u.name} has no student region"
        assert u.tests and u.quick
    for r in regions:
        assert len(r.hint) > 20, f"{r.path}:{r.begin}: the hint should say what to implement"


def test_markers_are_comment_lines_only():
    """The reference runs unchanged: removing every marker line leaves the same program."""
    for path in sorted({r.path for r in course.all_regions()}):
        text = (ROOT / path).read_text()
        marker = re.compile(r"^\s*# (BEGIN|END) STUDENT |^\s*#   ")
        kept = "\n".join(line for line in text.splitlines() if not marker.match(line))
        assert ast.dump(ast.parse(kept)) == ast.dump(ast.parse(text)), path


@pytest.mark.parametrize("name", [u.name for u in course.UNITS])
def test_starters_import_and_stub_only_function_bodies(name):
    for path in course.unit_files(name):
        text = course.starter_text(path, name)
        tree = ast.parse(text)
        stubs = 0
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and node.value.startswith(f"unit {name}: implement "):
                    stubs += 1
        regions = [r for r in course.regions_in(ROOT / path) if r.unit == name]
        assert stubs == len(regions), f"{path}: every region must sit inside a function body"
        assert f"# BEGIN STUDENT {name}:" in text                     # the student sees where to write
        for other in {r.unit for r in course.regions_in(ROOT / path)} - {name}:
            assert f"unit {other}: implement" not in text            # other units' code stays


def test_registered_tests_exist():
    for u in course.UNITS:
        for node in course.test_ids(u) + course.test_ids(u, quick=True):
            file, _, rest = node.partition("::")
            assert (ROOT / file).exists(), node
            if rest:
                func = rest.split("[")[0]
                names = {n.name for n in ast.walk(ast.parse((ROOT / file).read_text()))
                         if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                assert func in names, f"{node}: no such test"


def test_start_writes_the_starter_and_refuses_to_overwrite(tmp_path, capsys):
    assert course.main(["start", "swa-replay", str(tmp_path)]) == 0
    starter = (tmp_path / "nanodspark" / "swa_replay.py").read_text()
    assert starter == course.starter_text("nanodspark/swa_replay.py", "swa-replay")
    assert "raise NotImplementedError(\"unit swa-replay: implement" in starter
    assert "course test swa-replay --student" in (tmp_path / "swa-replay.md").read_text()
    assert course.main(["start", "swa-replay", str(tmp_path)]) == 1          # the student's work is safe
    assert "exists" in capsys.readouterr().err
    course.main(["list"])
    assert "paged-kv" in capsys.readouterr().out


def quick_ids(u):
    return course.test_ids(u, quick=True)


def test_reference_passes_and_fresh_starters_fail_with_their_hints(tmp_path):
    """For every unit: its quick tests pass on the reference, and with every unit's fresh starter
    swapped in (one process), each of them fails with that unit's 'implement ...' message."""
    names = [u.name for u in course.UNITS]
    ref = course.run_tests(names, None, quick=True, timeout=600)
    for u in course.UNITS:
        got = course.results_of(u, ref, quick=True)
        assert got and all(r["outcome"] in ("passed", "skipped") for r in got.values()), \
            (u.name, {k: v["message"][-500:] for k, v in got.items() if v["outcome"] != "passed"})
    assert course.main(["start", "all", str(tmp_path)]) == 0
    starters = course.run_tests(names, tmp_path, quick=True, timeout=600)
    for u in course.UNITS:
        got = course.results_of(u, starters, quick=True)
        assert len(got) >= len(quick_ids(u)), (u.name, sorted(got))
        for node, r in got.items():
            assert r["outcome"] in ("failed", "error"), f"{node} passed on a fresh starter"
            assert f"unit {u.name}: implement" in r["message"], (node, r["message"][-800:])


@pytest.mark.slow
def test_grade_is_full_on_the_reference_and_zero_on_fresh_starters(tmp_path):
    """Every graded test of every unit, both ways (minutes: the engine-level tests included)."""
    course.main(["start", "all", str(tmp_path)])
    for u in course.UNITS:
        ref = course.results_of(u, course.run_tests([u.name], None))
        passed, counted = course.score(ref)
        assert counted and passed == counted, (u.name, {k: v["message"][-500:] for k, v in ref.items()
                                                        if v["outcome"] not in ("passed", "skipped")})
        fresh = course.results_of(u, course.run_tests([u.name], tmp_path))
        passed, counted = course.score(fresh)
        assert counted and passed == 0, (u.name, [k for k, v in fresh.items() if v["outcome"] == "passed"])
