"""What a new user meets first: every `python -m nanodspark.bench <sub> --help` shows each flag's
default and a line of help; the course without pytest prints the install line, not a traceback."""
import argparse
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def subcommands():
    from nanodspark.lab.bench import build_parser
    p = build_parser()
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_bench_flag_has_help_and_its_default(name):
    sp = subcommands()[name]
    assert sp.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    assert all(a.help for a in sp._actions), [a.dest for a in sp._actions if not a.help]
    text = " ".join(sp.format_help().split())
    shown = [a for a in sp._actions if a.option_strings and a.default is not argparse.SUPPRESS]
    assert text.count("(default: ") >= len(shown)


def test_bench_help_runs_as_a_command():
    out = subprocess.run([sys.executable, "-m", "nanodspark.bench", "dspark", "--help"], cwd=ROOT, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0 and "(default: 128)" in out.stdout and "new tokens per request" in out.stdout


def test_the_course_without_pytest_prints_the_install_line():
    """A child interpreter that cannot find pytest: one line on stderr, exit 2 (was a 26-line traceback)."""
    code = ("import sys, importlib.util as u; real = u.find_spec; "
            "u.find_spec = lambda n, *a: None if n == 'pytest' else real(n, *a); "
            "from nanodspark.course import main; sys.exit(main(sys.argv[1:]))")
    for argv in (["test", "verify"], ["grade", "--units", "verify"]):
        out = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, text=True, capture_output=True,
                             timeout=120)
        assert out.returncode == 2 and out.stderr.strip() == \
            'the course runs the unit tests with pytest, which is not installed: pip install -e ".[test]"'
    out = subprocess.run([sys.executable, "-c", code, "list"], cwd=ROOT, text=True, capture_output=True, timeout=120)
    assert out.returncode == 0 and "verify" in out.stdout            # `list` needs no pytest
