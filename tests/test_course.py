"""The course (nanodspark/lab/course.py, course_runner.py), graded honestly.

Fast checks: regions, hints, handouts, points and test ids agree; starters parse; an export
holds no line of its units' solution (and none of the instructor's files); for every unit, the
grader's tree takes the student's regions only (a conftest, or a report forged from the top of
the file, stays out; the package holds no solution to load). Then grading runs on the
`cost-scheduler` unit (its tests take seconds): the reference copied into an export scores 100;
the exported starter, with a conftest hook, a report forged from outside the regions and the
reference loaded by path, scores 0; a hook registered from inside a region turns the canary and
scores 0; an answer that never trims scores below 40 %. `-m slow`: a report forged from inside a
region; every unit exported at once, the references graded 100 and the starters 0; the
degenerate answers of `verify` and `paged-kv` below 40 %; each unit's tests pass with every unit
it does not need stubbed."""
import ast
import json
import re
import shutil
from pathlib import Path

import pytest

from nanodspark.lab import course, course_runner

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("## Learning goals", "## What to write", "## Points", "## Questions", "## Run times", "## Submit")


# ----------------------------------------------------------------------------- the table of units
def test_regions_are_one_line_markers_and_each_has_its_hint_in_the_handout():
    regions = course.all_regions()
    names = [u.name for u in course.UNITS]
    assert len(set(names)) == len(names) and {r.unit for r in regions} == set(names)
    for u in course.UNITS:
        rids = [r.rid for r in regions if r.unit == u.name]
        hints = course.hints(u.name)
        assert sorted(hints) == sorted(rids), f"{u.handout}: 'What to write' must name exactly {rids}"
        assert all(len(h) > 40 for h in hints.values())
    for path in {r.path for r in regions}:
        for line in (ROOT / path).read_text().splitlines():
            if "STUDENT" in line:
                assert course.BEGIN.match(line) or course.END.match(line), f"{path}: {line.strip()!r}"
    with pytest.raises(ValueError, match="malformed"):
        course.parse_regions("def f():\n    # BEGIN STUDENT verify: a hint on the marker\n    pass\n", "x.py")
    with pytest.raises(ValueError, match="twice"):
        course.parse_regions("# BEGIN STUDENT a b\n# END STUDENT a\n# BEGIN STUDENT a b\n# END STUDENT a\n", "x.py")


def test_markers_are_comment_lines_only():
    """The reference runs unchanged: without its marker lines a file is the same program."""
    for path in sorted({r.path for r in course.all_regions()}):
        text = (ROOT / path).read_text()
        kept = "\n".join(line for line in text.splitlines() if "# BEGIN STUDENT" not in line
                         and "# END STUDENT" not in line)
        assert ast.dump(ast.parse(kept)) == ast.dump(ast.parse(text)), path


def _points_table(handout: str) -> list[tuple[str, int]]:
    text = (ROOT / handout).read_text().split("## Points", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1).strip(), int(m.group(2))) for m in re.finditer(r"^\| ([^|]+) \| (\d+) \|", text, re.M)]


def test_handouts_points_and_tests_agree_with_the_units():
    for u in course.UNITS:
        assert sum(g.points for g in u.groups) == 100, u.name
        assert set(u.needs) <= {v.name for v in course.UNITS} - {u.name}
        text = (ROOT / u.handout).read_text()
        assert all(s in text for s in SECTIONS), f"{u.handout}: needs the sections {SECTIONS}"
        assert _points_table(u.handout) == [(g.name, g.points) for g in u.groups], u.handout
        questions = re.findall(r"^\d+\. ", text.split("## Questions", 1)[1].split("\n## ", 1)[0], re.M)
        key = ROOT / course.KEYS / f"{u.name}.md"
        assert len(questions) >= 3 and len(re.findall(r"^\d+\. ", key.read_text(), re.M)) == len(questions)
        assert "tests/hidden" not in text                      # the handout is exported
        assert all(f"`{n}`" in text.split("## Questions")[0] for n in u.needs), f"{u.handout}: say what it needs"
        for g in u.groups:
            for node in g.tests:
                file, _, rest = course._dev(node).partition("::")
                assert file.startswith(course.HIDDEN + "/") == g.hidden, node
                assert (ROOT / file).exists(), node
                if rest:
                    names = {getattr(n, "name", getattr(n, "id", None)) for n in ast.walk(ast.parse(
                        (ROOT / file).read_text())) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Name))}
                    assert rest.split("[")[0].split("::")[0] in names, f"{node}: no such test"
        visible = u.test_ids(hidden=False)
        assert all(course_runner.belongs(q, visible) for q in u.test_ids(quick=True)), u.name


@pytest.mark.parametrize("name", [u.name for u in course.UNITS])
def test_starters_parse_and_stub_only_function_bodies(name):
    for path in course.unit_files(name):
        text = course.starter_text(path, name)
        tree = ast.parse(text)
        regions = [r for r in course.regions_in_file(path) if r.unit == name]
        stubs = [n for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and n.value.startswith(f"unit {name}, region ")]
        assert len(stubs) == len(regions), f"{path}: every region must sit inside a function body"
        assert all(f"# BEGIN STUDENT {name} {r.rid}" in text for r in regions)   # the student sees where
        others = {r.unit for r in course.regions_in_file(path)} - {name}
        assert not any(f"unit {o}, region" in text for o in others)            # other units' code stays


# ----------------------------------------------------------------------------- export
def solution_lines(name: str) -> set[str]:
    """The unit's reference lines that would give its code away: long enough to be specific, and
    not also a line of the given code outside the regions."""
    out = set()
    for path in course.unit_files(name):
        given = {s.strip() for s in course.starter_text(path, name).splitlines()}
        for body in course.bodies_of((ROOT / path).read_text(), path).values():
            out |= {s.strip() for s in body if len(s.strip()) > 30 and not s.strip().startswith("#")} - given
    return out


@pytest.fixture(scope="module")
def export_all(tmp_path_factory):
    dest = tmp_path_factory.mktemp("export_all")
    course.export([u.name for u in course.UNITS], dest, force=True)
    return dest


def test_an_export_holds_no_solution_and_nothing_of_the_instructors(export_all):
    files = [p for p in export_all.rglob("*") if p.is_file()]
    rel = {p.relative_to(export_all).as_posix() for p in files}
    assert not any(course.instructor_only(r) for r in rel if r != course.MANIFEST)
    assert not any(r.startswith((course.HIDDEN, course.KEYS, ".git/")) for r in rel)
    assert {f"{course.HANDOUTS}/{u.name}.md" for u in course.UNITS} <= rel and "ASSIGNMENT.md" in rel
    secret = {u.name: solution_lines(u.name) for u in course.UNITS}
    for p in files:
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for name, lines in secret.items():
            leaked = [s for s in lines if s in text]
            assert not leaked, f"{p.relative_to(export_all)} holds unit {name}'s code: {leaked[:2]}"
    manifest = json.loads((export_all / course.MANIFEST).read_text())
    assert manifest["units"] == [u.name for u in course.UNITS]
    assert course.outside_changes(export_all) == []
    # ASSIGNMENT.md points at each region's marker line in the starter
    assignment = (export_all / "ASSIGNMENT.md").read_text()
    for r in course.all_regions(export_all):
        assert f"| `{r.path}` | {r.begin} | `{r.rid}` |" in assignment
        assert (export_all / r.path).read_text().splitlines()[r.begin - 1].strip() == f"# BEGIN STUDENT {r.unit} {r.rid}"


def test_an_export_of_one_unit_keeps_the_others_and_refuses_a_folder_in_use(tmp_path):
    course.export(["swa-replay"], tmp_path / "one")
    text = (tmp_path / "one/nanodspark/swa_replay.py").read_text()
    assert 'raise NotImplementedError("unit swa-replay, region plan-replay:' in text
    assert (tmp_path / "one/nanodspark/verify.py").read_text() == (ROOT / "nanodspark/verify.py").read_text()
    assert "(Code of your assignment" not in (tmp_path / "one/walkthrough/05_drafter_verify.md").read_text()
    with pytest.raises(SystemExit, match="not empty"):
        course.export(["verify"], tmp_path / "one")


# ----------------------------------------------------------------------------- the grading tree
UNIT = "cost-scheduler"
FILE = "nanodspark/cost_scheduler.py"

FORGE = '''import atexit, re, sys
def _forge():
    path = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
    text = open(path).read()
    open(path, "w").write(re.sub(r"<(failure|error)[^>]*?(/>|>.*?</\\1>)", "", text, flags=re.S))
atexit.register(_forge)
'''
HOOK = '''import gc, pytest
class _Always:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = (yield).get_result()
        rep.outcome = "passed"
for _c in [o for o in gc.get_objects() if isinstance(o, pytest.Config)]:
    if not _c.pluginmanager.has_plugin("always"):
        _c.pluginmanager.register(_Always(), "always")
'''
LOAD = '''import importlib.util, os, sys, nanodspark
_ref = sys.modules.get("_ref")
if _ref is None:
    _spec = importlib.util.spec_from_file_location("_ref", os.path.join(nanodspark.__path__[0], "cost_scheduler.py"))
    _ref = sys.modules["_ref"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_ref)
'''
NEVER_TRIM = {   # lossless and useless: verify every draft whatever the cost table says
    "algorithm1": "return (torch.cumprod(c, dim=1) > 0).sum(1)\n",
    "budget": "return full\n",
    "topk": "a = torch.cumprod(conf.float().nan_to_num(0.0).clamp(0.0, 1.0), dim=1)\n"
            "return ((a > 0) & (active[:, None] if active is not None else True)).sum(1)\n",
}


def indent(code: str, n: int) -> list[str]:
    return [" " * n + line + "\n" for line in code.splitlines()]


def submission(tmp: Path, export: Path, bodies: dict | None = None, top: str = "", extra: dict | None = None) -> Path:
    """A student's folder: the export's unit file with some region bodies written (by rid) and
    code at the top of the file, plus any other files."""
    tmp.mkdir(parents=True)
    text = (export / FILE).read_text()
    if bodies:
        keyed = {(UNIT, rid): indent(code, 4) for rid, code in bodies.items()}
        text = course.render(text, FILE, {UNIT}, keyed, check=False)
    (tmp / FILE).parent.mkdir(parents=True)
    (tmp / FILE).write_text(top + text)
    shutil.copy(export / course.MANIFEST, tmp / course.MANIFEST)
    for rel, content in (extra or {}).items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(content)
    return tmp


@pytest.fixture(scope="module")
def export_unit(tmp_path_factory):
    dest = tmp_path_factory.mktemp("export_unit")
    course.export([UNIT], dest, force=True)
    return dest


CONFTEST = "import pytest\n" + HOOK.replace("for _c in", "def pytest_configure(config):\n    pass\nfor _c in")


def test_the_grading_tree_takes_the_regions_and_nothing_else(tmp_path, export_unit):
    starter = course.render((ROOT / FILE).read_text(), FILE, {UNIT})
    outside = submission(tmp_path / "outside", export_unit, top=FORGE + HOOK,
                         extra={"tests/conftest.py": CONFTEST, "conftest.py": CONFTEST})
    info = course_runner.build_tree(tmp_path / "tree", outside, [UNIT])
    assert (tmp_path / "tree" / FILE).read_text() == starter                  # the patch stayed out
    assert (tmp_path / "tree/tests/conftest.py").read_text() == (ROOT / "tests/conftest.py").read_text()
    assert not (tmp_path / "tree/conftest.py").exists()
    assert all(v == {"from": "missing"} for v in info["regions"].values())
    package = [p for d in ("nanodspark", "kernels") for p in (tmp_path / "tree" / d).rglob("*.py")]
    for r in solution_lines(UNIT):                                             # no reference to load
        assert not any(r in p.read_text() for p in package)
    ref = submission(tmp_path / "ref", export_unit, bodies={"algorithm1": LOAD + "return _ref.algorithm1(conf, sps)"})
    shutil.copy(ROOT / FILE, ref / FILE)
    info = course_runner.build_tree(tmp_path / "tree2", ref, [UNIT])
    assert (tmp_path / "tree2" / FILE).read_text() == (ROOT / FILE).read_text()
    assert all(v["same_as_reference"] for v in info["regions"].values())
    loads = submission(tmp_path / "loads", export_unit, bodies={"algorithm1": LOAD + "return _ref.algorithm1(conf, sps)",
                                                                 "budget": "return full\n  oops = ("})
    info = course_runner.build_tree(tmp_path / "tree3", loads, [UNIT])
    assert {"importlib", "__path__"} <= set(info["regions"][f"{UNIT}/algorithm1"]["flags"])
    assert info["regions"][f"{UNIT}/budget"] == {"from": "missing"}                # does not parse: the stub
    assert any("region budget does not parse" in n for n in info["notes"])


@pytest.mark.parametrize("name", [u.name for u in course.UNITS])
def test_for_every_unit_an_attack_outside_the_regions_grades_as_the_starter(tmp_path, export_all, name):
    """The exported files with a report forged and a hook registered at their top, conftest
    files beside them: the grading tree holds the starter, the instructor's conftest, and no
    line of the unit's solution anywhere in the package (so there is none to copy or load)."""
    sub = tmp_path / "sub"
    for f in course.unit_files(name):
        (sub / f).parent.mkdir(parents=True, exist_ok=True)
        (sub / f).write_text(FORGE + HOOK + (export_all / f).read_text())
    for rel in ("conftest.py", "tests/conftest.py"):
        (sub / rel).parent.mkdir(parents=True, exist_ok=True)
        (sub / rel).write_text(CONFTEST)
    tree = tmp_path / "tree"
    info = course_runner.build_tree(tree, sub, [name], hidden=False)
    for f in course.unit_files(name):
        assert (tree / f).read_text() == course.starter_text(f, name)
    assert all(v == {"from": "missing"} for v in info["regions"].values())
    assert (tree / "tests/conftest.py").read_text() == (ROOT / "tests/conftest.py").read_text()
    assert not (tree / "conftest.py").exists()
    secret = solution_lines(name)
    for p in (q for d in ("nanodspark", "kernels") for q in (tree / d).rglob("*.py")):
        assert not [s for s in secret if s in p.read_text()], p


def test_the_report_is_read_by_test_case_whatever_file_defined_the_test(tmp_path):
    """pytest's JUnit XML names a case by its module's dotted path and its classes; `file` may
    name the library that defined the test (a hypothesis state machine's runTest)."""
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_paged_kv_contract.test_paged_kv_public_state_machine" name="runTest"'
        ' file=".venv/lib/python3.11/site-packages/hypothesis/stateful.py"/>'
        '<testcase classname="tests.test_verify" name="test_greedy_spec_equals_target_only[True-static]"'
        ' file="tests/test_verify.py"><failure message="boom">trace</failure></testcase>'
        '<testcase classname="tests.hidden.test_hidden_eplb" name="test_x"><skipped message="no gpu"/></testcase>'
        '<testcase classname="" name="tests.test_broken"><error message="collection failed"/></testcase>'
        '</testsuite></testsuites>')
    got = course_runner.read_junit(xml, ROOT)
    assert got["tests/test_paged_kv_contract.py::test_paged_kv_public_state_machine::runTest"]["outcome"] == "passed"
    assert got["tests/test_verify.py::test_greedy_spec_equals_target_only[True-static]"] == {
        "outcome": "failed", "message": "boom\ntrace"}
    assert got["tests/hidden/test_hidden_eplb.py::test_x"]["outcome"] == "skipped"
    assert [r["outcome"] for k, r in got.items() if k.startswith("<collection>")] == ["error"]


# ----------------------------------------------------------------------------- grading, for real
def grade(student, *extra) -> tuple[int, dict]:
    out = Path(student) / "results.json"
    code = course.main(["grade", "--student", str(student), "--units", UNIT, *extra])
    return code, json.loads(out.read_text())


def test_the_reference_copied_into_an_export_scores_100(tmp_path, export_unit):
    ref = submission(tmp_path / "ref", export_unit)
    shutil.copy(ROOT / FILE, ref / FILE)
    code, res = grade(ref, "--quick")
    assert code == 0 and res["score"] == res["max_score"] > 0, res["output"]
    assert res["extra_data"]["reports"] == ["ok"]
    assert {"name", "score", "max_score", "output", "visibility"} <= set(res["tests"][0])


def test_the_starter_and_the_attacks_around_it_score_0(tmp_path, export_unit):
    """The exported starter, with a conftest hook that turns failures into passes, a report
    forged at exit and a hook registered from the top of the file, and the reference loaded by
    path from the package inside a region: 0, and below the pass mark."""
    attack = submission(tmp_path / "attack", export_unit, top=FORGE + HOOK,
                        bodies={"budget": LOAD + "return _ref.budget_from_lagged(survival_lagged, step_time, "
                                                  "min_gain, survival_eps)"},
                        extra={"tests/conftest.py": CONFTEST, "conftest.py": CONFTEST})
    code, res = grade(attack, "--quick")
    assert code == 1 and res["score"] == 0 and res["max_score"] > 0, res["output"]
    assert res["extra_data"]["reports"] == ["ok"]
    assert any("region algorithm1:" in t["output"] for t in res["tests"])        # the starter's hint


@pytest.mark.parametrize("attack", [pytest.param("forge", marks=pytest.mark.slow), "hook"])
def test_a_report_altered_from_inside_a_region_scores_0(tmp_path, export_unit, attack):
    """Code in a region runs in pytest's process: it can rewrite the report at exit or register
    a hook. Either turns the canary too, and the run scores 0."""
    body = (FORGE if attack == "forge" else HOOK) + 'raise NotImplementedError("not yet")'
    sub = submission(tmp_path / attack, export_unit, bodies={"algorithm1": body, "topk": body})
    code, res = grade(sub, "--quick")
    assert code == 1 and res["score"] == 0
    assert "altered" in res["extra_data"]["reports"][0], res["extra_data"]["reports"]
    assert res["extra_data"]["flagged"]


def test_an_answer_that_never_trims_scores_below_40_percent(tmp_path, export_unit):
    sub = submission(tmp_path / "never", export_unit, bodies=NEVER_TRIM)
    code, res = grade(sub)
    assert code == 1 and res["extra_data"]["reports"] == ["ok"]
    assert 0 < res["extra_data"]["percent"] < 40, [(t["name"], t["score"]) for t in res["tests"]]
    hidden = [t for t in res["tests"] if t["visibility"] == "after_published"]      # graded, shown later
    assert len(hidden) == 1 and hidden[0]["max_score"] == 15


# ----------------------------------------------------------------------------- every unit (slow)
@pytest.mark.slow
def test_exporting_every_unit_then_grading_the_references_gives_100_and_the_starters_0(tmp_path, export_all):
    ref = tmp_path / "ref"
    shutil.copytree(export_all, ref)
    for f in {r.path for r in course.all_regions()}:
        shutil.copy(ROOT / f, ref / f)
    assert course.main(["grade", "--student", str(ref)]) == 0
    res = json.loads((ref / "results.json").read_text())
    assert res["score"] == res["max_score"], [t["name"] for t in res["tests"] if t["score"] < t["max_score"]]
    print("seconds per unit, wall and CPU:", res["extra_data"]["seconds"])      # the handouts' run times
    assert course.main(["grade", "--student", str(export_all)]) == 1
    res = json.loads((export_all / "results.json").read_text())
    assert res["score"] == 0 and res["max_score"] > 0, [t["name"] for t in res["tests"] if t["score"]]


NEVER_ACCEPT = {   # lossless and useless: commit the target's own token, never a draft
    "accept-greedy": "return 0\n",
    "accept-sampling": "return 0, (p[0] if drafts.shape[0] else None)\n",
    "verify-greedy": "return VerifyResult([target_argmax[0]], 0, 0 if mode == 'cap-accept' else None)\n",
    "verify-block": "nxt = int(torch.multinomial(target_probs[0], 1, generator=generator))\n"
                    "return VerifyResult([nxt], 0, 0 if mode == 'cap-accept' else None)\n",
    "verify-batch": "m = torch.zeros(R, dtype=torch.long, device=dev)\n"
                    "nxt = logits.argmax(-1)[row_index][:, 0]\n"
                    "if not greedy_only:\n"
                    "    p0 = probs_from_logits(logits[row_index[:, 0]], st)\n"
                    "    drawn = gumbel_argmax(torch.log(p0), st.seed, pos[:, 0], STREAM_TARGET)\n"
                    "    nxt = torch.where(st.temperature < GREEDY_BELOW, nxt, drawn)\n"
                    "return _verdict(drafts, m, m, nxt)\n",
}
NO_PREFIX_CACHE = {"lookup": "return [], _ROOT_HASH\n", "commit": "return\n"}


def reference_with(name: str, bodies: dict, dest: Path) -> Path:
    """A folder holding the unit's reference files with some regions replaced."""
    for f in course.unit_files(name):
        text = (ROOT / f).read_text()
        keyed = {}
        for r in course.regions_in_file(f):
            if r.unit == name and r.rid in bodies:
                keyed[r.key] = indent(bodies[r.rid], len(r.indent))
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        (dest / f).write_text(course.render(text, f, {name}, {**course.bodies_of(text, f), **keyed}))
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("name, bodies", [("verify", NEVER_ACCEPT), ("paged-kv", NO_PREFIX_CACHE)],
                         ids=["verify-never-accepts", "paged-kv-without-a-prefix-cache"])
def test_degenerate_answers_score_below_40_percent(tmp_path, name, bodies):
    sub = reference_with(name, bodies, tmp_path / "sub")
    assert course.main(["grade", "--student", str(sub), "--units", name]) == 1
    res = json.loads((sub / "results.json").read_text())
    assert res["extra_data"]["reports"] == ["ok"]
    assert res["extra_data"]["percent"] < 40, [(t["name"], t["score"]) for t in res["tests"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", [u.name for u in course.UNITS])
def test_a_unit_needs_no_reference_but_its_needs(tmp_path, name):
    """With every other unit stubbed but the ones it declares it needs, a unit's visible tests
    pass on its reference: exporting one unit leaves the others working."""
    u = course.unit(name)
    stubbed = [v.name for v in course.UNITS if v.name != name and v.name not in u.needs]
    course.export(stubbed, tmp_path / "tree")
    run = course_runner.run_pytest(tmp_path / "tree", u.test_ids(hidden=False))
    bad = {k: v["message"][-300:] for k, v in run.results.items() if v["outcome"] not in ("passed", "skipped")}
    assert run.results and not bad, bad
