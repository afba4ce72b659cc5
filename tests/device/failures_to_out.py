"""A pytest plugin for runs on the device machine: each failure's traceback is appended to
$OUT/failures.txt the moment it happens, so a run cut at its time limit still says why its
tests failed (pytest-xdist prints tracebacks only in the final summary)."""
import os


def pytest_runtest_logreport(report):
    out = os.environ.get("OUT")
    if report.failed and out and os.environ.get("PYTEST_XDIST_WORKER"):   # once, from the worker
        with open(os.path.join(out, "failures.txt"), "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}, {os.environ['PYTEST_XDIST_WORKER']})\n"
                    f"{report.longreprtext[-5000:]}\n")
