"""Runs pytest with a student's files in place of the reference's (the course's adapter layer).

The idea
    A unit's starter is a copy of a reference file with its student regions cut out
    (course.py). To grade a student's copy, the tests must import *that* file wherever the
    engine imports the reference one: `from nanodspark.verify import verify_batch` in a test,
    `from .verify import verify_batch` in speculative.py. This bootstrap installs a finder at the
    front of `sys.meta_path` that answers those module names with the student's files, then runs
    pytest. The tests themselves are unchanged and reach the code only through its public names,
    so any implementation that keeps the contract passes.

Invariants
    * Nothing here imports nanodspark (or torch): the finder must be in place before the first
      import of any module it swaps, so this file is loaded by path, not as a package module.
    * A swapped module is loaded under its real name with the student's path as `__file__`:
      relative imports resolve in the real package, tracebacks and Triton's source lookup show
      the student's file.
    * One JSON file holds every test's outcome (passed / failed / error / skipped) and, for a
      failure, the end of its report, which is where the "unit X: implement ..." message is.

Run as `python course_runner.py SWAP_JSON RESULT_JSON -- PYTEST_ARGS...`; course.py does it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys


class StudentFinder(importlib.abc.MetaPathFinder):
    """Answers the module names of `mapping` (name -> file) with those files."""

    def __init__(self, mapping: dict[str, str]):
        self.mapping = dict(mapping)

    def find_spec(self, fullname, path=None, target=None):
        where = self.mapping.get(fullname)
        return None if where is None else importlib.util.spec_from_file_location(fullname, where)


class Recorder:
    """A pytest plugin object: the outcome of every test, by node id."""

    def __init__(self):
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        r = self.results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        if report.failed:
            r["outcome"] = "failed" if report.when == "call" else "error"
            r["message"] = report.longreprtext[-3000:]
        elif report.skipped and r["outcome"] == "passed":
            r["outcome"] = "skipped"

    def pytest_collectreport(self, report):
        if report.failed:
            self.results[report.nodeid or "<collection>"] = {"outcome": "error",
                                                             "message": report.longreprtext[-3000:]}


def main(argv: list[str]) -> int:
    swap_json, result_json, sep, *pytest_args = argv
    assert sep == "--", "usage: course_runner.py SWAP_JSON RESULT_JSON -- PYTEST_ARGS..."
    with open(swap_json) as f:
        mapping = json.load(f)
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)              # run as a script: its folder (nanodspark/lab) must not shadow anything
    if mapping:
        sys.meta_path.insert(0, StudentFinder(mapping))
    import pytest
    rec = Recorder()
    code = pytest.main(pytest_args, plugins=[rec])
    with open(result_json, "w") as f:
        json.dump({"exit_code": int(code), "results": rec.results}, f, indent=1)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
