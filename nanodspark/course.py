"""`python -m nanodspark.course list | export UNIT DIR | test UNIT | grade --student DIR`: the course.

The course is lab code (`nanodspark/lab/course.py`, which says how units, regions, exports and
handouts work; `nanodspark/lab/course_runner.py`, which grades); this file only hands its
arguments to `nanodspark.lab.course.main`, as `nanodspark/bench.py` does for the benchmarks, so
that the command the walkthrough and the README give is short. `python -m nanodspark.lab.course`
is the same command. No core module imports it.
"""
import sys


def main(argv=None) -> int:
    from nanodspark.lab.course import main as lab_main
    return lab_main(argv)


if __name__ == "__main__":
    sys.exit(main())
