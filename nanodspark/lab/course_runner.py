"""Grading: the student's regions in the instructor's copy, pytest in a subprocess, its JUnit XML read back.

The idea
    `grade` never runs the student's tree. For each unit it builds a fresh tree from the
    instructor's copy (the package, the tests and the hidden tests), puts the student's code of
    that unit in — only the lines between the region markers; the rest of the student's files,
    and any conftest or other file of theirs, stays out — and runs pytest there in a subprocess
    whose import path is that tree alone. Other units keep the instructor's reference, so a unit's
    grade never depends on the student's other units. The outcome of each test is read from the
    JUnit XML pytest writes, against the test cases collected from the instructor's copy (a case
    with no result failed), and the points are the groups' weights (course.UNITS).

A canary
    Each run also runs a test file with a random name: one test that must fail, one that must
    pass. A hook that turns failures into passes, or code that rewrites the report, turns the
    canary too: the run then scores 0. Code in the student's regions runs in the same process as
    pytest and can do whatever the grader's user can; the canary stops the usual tricks, not one
    written to find it. So: grade in a container (Gradescope does), and read what results.json
    flags — regions that reach for pytest, atexit, importlib, files or processes, or that equal
    the reference line for line.

Writes a Gradescope `results.json` per student (score, max_score, one entry per test group with
its output and visibility: hidden groups are `after_published`); `grade` exits 1 below the pass mark.
"""
from __future__ import annotations

import json
import os
import resource
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from .course import (HIDDEN, ROOT, UNITS, Unit, _dev, all_regions, bodies_of, hints, instructor_only, read_manifest,
                     render, tree_files, unit)

TREE = ("nanodspark/", "kernels/", "tests/", "pyproject.toml")   # what a graded run needs of the instructor's copy
FLAGS = re.compile(r"\b(_?pytest|atexit|junit\w*|importlib|__import__|subprocess|sys\.argv|sys\.modules|os\._exit|"
                   r"os\.system|os\.kill|gc\.get_objects|inspect|builtins|signal|__file__|__path__)\b"
                   r"|(?<![\w.])(open|exec|eval|compile)\(")
NO_RESULT = "no result: the run stopped, timed out or its report lost this test"


@dataclass
class Run:
    results: dict[str, dict]     # node id -> {"outcome": passed | failed | error | skipped, "message": str}
    returncode: int
    seconds: float
    output: str
    report: bool                 # pytest wrote its JUnit XML
    cpu_seconds: float = 0.0     # the run's CPU time (user + system), a busy machine's fairer clock


# ----------------------------------------------------------------------------- pytest, and its report
def _env(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONINSPECT")}
    env.update(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1")
    return env


def _pytest_args(tree: Path) -> list[str]:
    """pytest with the tree's own configuration only: no addopts (`-m 'not slow'`), no cache, no
    conftest from above the tree, the report format that names each test's file."""
    return ["-p", "no:cacheprovider", "-o", "addopts=", "-o", "junit_family=xunit1", "--rootdir", str(tree),
            "-c", str(tree / "pyproject.toml"), "--confcutdir", str(tree)]


def run_pytest(tree: Path, ids: list[str], capture: bool = True, extra=(), timeout: float | None = None) -> Run:
    with tempfile.TemporaryDirectory(prefix="course-report-") as tmp:
        xml = Path(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", *_pytest_args(tree), "--tb=short", "-q", f"--junitxml={xml}",
               *extra, *ids]
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree), text=True, start_new_session=True,
                                stdout=subprocess.PIPE if capture else None,
                                stderr=subprocess.STDOUT if capture else None)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            output = f"timed out after {timeout:.0f} s"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)      # the run and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        seconds = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        results = read_junit(xml, tree) if xml.exists() else {}
        return Run(results, proc.returncode, seconds, output or "", xml.exists(), cpu)


def read_junit(path: Path, root: Path) -> dict[str, dict]:
    """node id -> outcome, from pytest's JUnit XML. A case's classname is its module's dotted path
    under `root`, then its classes (its `file` may name where the test function was defined, as
    for a hypothesis state machine)."""
    out: dict[str, dict] = {}
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except ET.ParseError:
        return out
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    for c in cases:
        cls, name = c.get("classname", ""), c.get("name", "")
        parts = cls.split(".")
        node = f"<collection> {cls}.{name}"
        for i in range(len(parts), 0, -1):
            file = "/".join(parts[:i]) + ".py"
            if (root / file).is_file():
                node = "::".join([file, *parts[i:], name])
                break
        outcome, message = "passed", ""
        for child in c:
            tag = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if tag:
                outcome = tag
                message = ((child.get("message") or "") + "\n" + (child.text or "")).strip()[-3000:]
        prev = out.get(node)
        if prev is None or rank[outcome] > rank[prev["outcome"]]:
            out[node] = {"outcome": outcome, "message": message}
    return out


_collected: dict[tuple, list[str]] = {}


def collect(ids: list[str], root: Path = ROOT) -> list[str]:
    """The test cases `ids` expand to in the instructor's copy (parameters included)."""
    key = (str(root), tuple(ids))
    if key not in _collected:
        proc = subprocess.run([sys.executable, "-m", "pytest", *_pytest_args(root), "--collect-only", "-q", *ids],
                              cwd=root, env=_env(root), capture_output=True, text=True)
        nodes = [line.strip() for line in proc.stdout.splitlines() if "::" in line and " " not in line.strip()]
        if proc.returncode != 0 or not nodes:
            raise RuntimeError(f"collecting the graded tests failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
        _collected[key] = nodes
    return _collected[key]


def belongs(node: str, ids) -> bool:
    return any(node == i or node.startswith(i + "[") or node.startswith(i + "::") for i in ids)


def score_groups(u: Unit, results: dict, expected: list[str] | None, hidden: bool = True) -> list[dict]:
    """One row per test group: its points, the share of its counted cases that passed (skipped
    cases count neither way; a group whose every case was skipped is not counted), failures."""
    rows = []
    pool = expected if expected is not None else list(results)
    for i, g in enumerate(u.groups, 1):
        if g.hidden and not hidden:
            continue
        cases = [n for n in pool if belongs(n, [_dev(t) for t in g.tests])]
        if not cases:
            continue
        got = {n: results.get(n, {"outcome": "failed", "message": NO_RESULT}) for n in cases}
        counted = {n: r for n, r in got.items() if r["outcome"] != "skipped"}
        passed = sum(r["outcome"] == "passed" for r in counted.values())
        rows.append(dict(unit=u.name, number=f"{u.name}.{i}", name=g.name, hidden=g.hidden,
                         max_score=g.points if counted else 0,
                         score=round(g.points * passed / len(counted), 2) if counted else 0,
                         passed=passed, counted=len(counted), skipped=len(got) - len(counted),
                         failures=[(n, r["message"]) for n, r in counted.items() if r["outcome"] != "passed"]))
    return rows


def todo(u: Unit, results: dict) -> list[str]:
    """The unit's regions whose failing stub the failures show, in region order, with their hints."""
    text = "\n".join(r["message"] for r in results.values())
    hint = hints(u.name)
    seen = []
    for r in (r for r in all_regions() if r.unit == u.name):
        if f"unit {u.name}, region {r.rid}:" in text and r.rid not in seen:
            seen.append(r.rid)
    return [f"region {rid}: {hint.get(rid, '')}" for rid in seen]


def print_rows(who: str, rows: list[dict]) -> None:
    for r in rows:
        mark = "" if not r["hidden"] else " (hidden)"
        extra = f", {r['skipped']} skipped" if r["skipped"] else ""
        print(f"  {r['score']:6.1f} / {r['max_score']:<3d} {r['name']}{mark}: {r['passed']}/{r['counted']} passed{extra}")
    score, most = sum(r["score"] for r in rows), sum(r["max_score"] for r in rows)
    print(f"  {score:6.1f} / {most:<3d} {who}")


# ----------------------------------------------------------------------------- the grading tree
def build_tree(dest: Path, student: Path | None, names: list[str], hidden: bool = True) -> dict:
    """The instructor's copy in dest, with the regions of units `names` taken from the student's
    files (a region the student's file lacks, or cannot be read, keeps the failing stub).
    Returns what was taken: {unit/rid: {"from", "flags", "same_as_reference"}} and notes."""
    info: dict = {"regions": {}, "notes": []}
    ref_regions = [r for r in all_regions() if r.unit in names]
    files = sorted({r.path for r in ref_regions})
    for rel in tree_files(ROOT):
        if not rel.startswith(TREE) or (instructor_only(rel) and not rel.startswith(HIDDEN + "/")):
            continue
        if rel.startswith(HIDDEN + "/") and not hidden:
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel not in files:
            shutil.copy2(ROOT / rel, dest / rel)
    for rel in files:
        ref = (ROOT / rel).read_text()
        ref_bodies = bodies_of(ref, rel)
        bodies = ref_bodies if student is None else {}
        if student is not None:
            try:
                theirs = bodies_of((Path(student) / rel).read_text(), rel)
            except FileNotFoundError:
                theirs = {}
                info["notes"].append(f"{rel}: not in the submission")
            except (ValueError, SyntaxError, UnicodeDecodeError) as e:
                theirs = {}
                info["notes"].append(f"{rel}: its regions cannot be read ({e})")
            for r in (r for r in ref_regions if r.path == rel):
                body = theirs.get(r.key)
                if body is None or _is_stub(body, r):
                    info["regions"][f"{r.unit}/{r.rid}"] = {"from": "missing"}
                    continue
                bodies[r.key] = body
                code = "".join(body)
                info["regions"][f"{r.unit}/{r.rid}"] = {
                    "from": "student",
                    "flags": sorted({m.group(0).rstrip("(") for m in FLAGS.finditer(_code_only(code))}),
                    "same_as_reference": _normal(code) == _normal("".join(ref_bodies[r.key]))}
        try:
            text = render(ref, rel, set(names), bodies)
        except SyntaxError:                   # some region does not parse in place: it keeps the stub
            for key in [k for k in bodies if student is not None]:
                try:
                    render(ref, rel, set(names), {key: bodies[key]})
                except SyntaxError as e:
                    del bodies[key]
                    info["regions"][f"{key[0]}/{key[1]}"] = {"from": "missing"}
                    info["notes"].append(f"{rel}: region {key[1]} does not parse ({e.msg}, line {e.lineno})")
            text = render(ref, rel, set(names), bodies)
        (dest / rel).write_text(text)
    return info


def _is_stub(body: list[str], r) -> bool:
    return len(body) == 1 and f"unit {r.unit}, region {r.rid}:" in body[0]


def _code_only(code: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in code.splitlines())


def _normal(code: str) -> str:
    return "\n".join(" ".join(line.split()) for line in _code_only(code).splitlines() if line.strip())


def _canary(tree: Path) -> tuple[str, str, str]:
    """A test file with a random name: one test that must fail and one that must pass."""
    tag = secrets.token_hex(6)
    rel = f"tests/test_zz_{tag}.py"
    (tree / rel).write_text(f"def test_{tag}_fails():\n    raise AssertionError('this test must fail')\n\n\n"
                            f"def test_{tag}_passes():\n    pass\n")
    return rel, f"{rel}::test_{tag}_fails", f"{rel}::test_{tag}_passes"


def grade_units(student: Path | None, names: list[str], hidden: bool = True, quick: bool = False,
                timeout: float = 1800, verbose: bool = False) -> dict:
    """Grade units `names` of one submission together, in one tree and one pytest run."""
    ids = [t for n in names for t in unit(n).test_ids(hidden=hidden, quick=quick)]
    expected = collect(ids)
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        tree = Path(tmp)
        info = build_tree(tree, student, names, hidden)
        canary, must_fail, must_pass = _canary(tree)
        run = run_pytest(tree, ids + [canary], timeout=timeout)
    if verbose:
        print(run.output)
    fail, ok = run.results.get(must_fail, {}).get("outcome"), run.results.get(must_pass, {}).get("outcome")
    if not run.report:
        verdict = f"pytest wrote no report (exit {run.returncode}): {run.output.strip()[-300:]}"
    elif fail != "failed" or ok != "passed" or run.returncode != 1:
        verdict = ("the test report was altered: the canary that must fail "
                   f"{'passed' if fail == 'passed' else 'is missing' if fail is None else fail}"
                   f" (pytest exit {run.returncode}); graded 0")
    else:
        verdict = "ok"
    rows = []
    for n in names:
        got = score_groups(unit(n), run.results if verdict == "ok" else {}, expected, hidden)
        if verdict != "ok":
            for r in got:
                r.update(score=0, passed=0, failures=[("(all)", verdict)])
        rows += got
    return {"rows": rows, "report": verdict, "seconds": run.seconds, "cpu_seconds": run.cpu_seconds,
            "units": names, "regions": info["regions"],
            "notes": info["notes"], "output": run.output[-20000:]}


def grade_student(student: Path | None, names: list[str], hidden: bool, quick: bool, together: bool,
                  timeout: float, verbose: bool) -> dict:
    """Every unit of one submission (each in its own tree unless `together`): Gradescope's results."""
    parts = ([grade_units(student, names, hidden, quick, timeout, verbose)] if together
             else [grade_units(student, [n], hidden, quick, timeout, verbose) for n in names])
    rows = [r for p in parts for r in p["rows"]]
    tests = []
    for r in rows:
        lines = [f"{r['passed']}/{r['counted']} passed" + (f", {r['skipped']} skipped" if r["skipped"] else "")]
        for node, msg in r["failures"][:8]:
            lines.append(f"--- {node}\n{msg[-1500:]}")
        tests.append({"name": f"{r['unit']}: {r['name']}", "number": r["number"], "score": r["score"],
                      "max_score": r["max_score"], "status": "passed" if r["score"] == r["max_score"] else "failed",
                      "output": "\n".join(lines), "visibility": "after_published" if r["hidden"] else "visible"})
    score, most = round(sum(r["score"] for r in rows), 2), sum(r["max_score"] for r in rows)
    regions = {k: v for p in parts for k, v in p["regions"].items()}
    flagged = {k: v for k, v in regions.items() if v.get("flags") or v.get("same_as_reference")}
    summary = [f"{score:g} / {most} points"] + [f"{p['report']}" for p in parts if p["report"] != "ok"]
    summary += [n for p in parts for n in p["notes"]]
    return {"score": score, "max_score": most, "execution_time": round(sum(p["seconds"] for p in parts), 1),
            "visibility": "visible", "stdout_visibility": "hidden", "output": "\n".join(summary), "tests": tests,
            "extra_data": {"student": str(student) if student else "the reference", "units": names,
                           "reports": [p["report"] for p in parts], "regions": regions, "flagged": flagged,
                           "seconds": {",".join(p["units"]): [round(p["seconds"], 1), round(p["cpu_seconds"], 1)]
                                       for p in parts},
                           "percent": round(100.0 * score / most, 2) if most else 0.0}}


def _units_for(student: Path | None, arg: str | None) -> list[str]:
    if arg:
        return [unit(n).name for n in arg.split(",")]
    m = read_manifest(student) if student else None
    return [unit(n).name for n in m["units"]] if m else [u.name for u in UNITS]


def grade_many(args) -> int:
    students = [Path(s) for s in args.student] if args.student else [None]
    if args.out and len(students) > 1:
        raise SystemExit("--out names one results file: grade one student with it")
    hidden = not args.no_hidden and not args.quick
    if hidden and not (ROOT / HIDDEN).is_dir():
        print(f"note: no {HIDDEN}/ in this copy (an export): grading without the hidden tests", file=sys.stderr)
        hidden = False
    worst = 0
    for s in students:
        if s is not None and not s.is_dir():
            raise SystemExit(f"{s} is not a folder")
        names = _units_for(s, args.units)
        res = grade_student(s, names, hidden, args.quick, args.together, args.timeout, args.verbose)
        pct = res["extra_data"]["percent"]
        below = pct < args.pass_mark or any(r != "ok" for r in res["extra_data"]["reports"])
        worst = max(worst, int(below))
        out = Path(args.out) if args.out else (s / "results.json" if s is not None else None)
        if out is not None:
            out.write_text(json.dumps(res, indent=1) + "\n")
        who = str(s) if s is not None else "the reference"
        print(f"{who}: {res['score']:g} / {res['max_score']} ({pct:.0f} %){'  BELOW THE PASS MARK' if below else ''}"
              + (f"  -> {out}" if out else ""))
        for t in res["tests"]:
            print(f"  {t['score']:6.1f} / {t['max_score']:<3d} {t['name']}"
                  + ("  (hidden)" if t["visibility"] != "visible" else ""))
        for line in res["output"].splitlines()[1:]:
            print(f"  {line}")
        for k, v in res["extra_data"]["flagged"].items():
            why = (["same as the reference"] if v.get("same_as_reference") else []) + v.get("flags", [])
            print(f"  flag {k}: {', '.join(why)}")
    return worst
