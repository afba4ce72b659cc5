"""`python -m nanodspark.course list | export UNIT DIR | test UNIT | grade --student DIR`: the course.

The course is lab code (`nanodspark/lab/course.py`, which says how units, regions, exports and
handouts work; `nanodspark/lab/course_runner.py`, which grades); this file only hands its
arguments to `nanodspark.lab.course.main`, as `nanodspark/bench.py` does for the benchmarks, so
that the command the walkthrough and the README give is short. `python -m nanodspark.lab.course`
is the same command. No core module imports it. `test` and `grade` run pytest, which only the
`test` extra installs: without it they print the install line instead of a traceback.
"""
import sys

NEEDS_PYTEST = 'the course runs the unit tests with pytest, which is not installed: pip install -e ".[test]"'


def main(argv=None) -> int:
    import importlib.util
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] and args[0] in ("test", "grade") and importlib.util.find_spec("pytest") is None:
        print(NEEDS_PYTEST, file=sys.stderr)
        return 2
    from nanodspark.lab.course import main as lab_main
    return lab_main(argv)


if __name__ == "__main__":
    sys.exit(main())
