"""`python -m nanodspark.bench <subcommand> [...]`: the benchmarks' command line.

The benchmarks are lab code (`nanodspark/lab/bench.py`, `bench_engine.py`, `bench_profile.py`);
this file only hands its arguments to `nanodspark.lab.bench.main`, so that every command written
in the walkthrough and in the result files (`"command": "python -m nanodspark.bench ..."`) runs
as it did. `python -m nanodspark.bench --help` lists the subcommands. No core module imports it.
"""
import sys


def main(argv=None) -> int:
    from nanodspark.lab.bench import main as lab_main
    return lab_main(argv)


if __name__ == "__main__":
    sys.exit(main())
